"""The only asyncpg user: one method per named query in `sql/queries.sql`.

Connection-level failures (refused, reset, server shutting down, statement timeout) are
translated here into `DatabaseUnavailable`; callers back off and retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import TYPE_CHECKING, Any

import asyncpg

from relayd.errors import (
    ConfigError,
    DatabaseUnavailable,
    MigrationError,
    SchemaError,
    StatementError,
)
from relayd.models import ClaimedRow, OutboxTable
from relayd.operator_models import (
    AUDIT_MAX_IDS,
    AuditEntry,
    DeadLetterBatch,
    DeadLetterFilter,
    DeadLetterPage,
    DeadLetterRow,
    DlqAction,
    Pause,
    PauseAction,
    RowOutcome,
    RowResult,
)

if TYPE_CHECKING:
    from relayd.status import Heartbeat

# Columns `relayd run` needs; their absence means the outbox was never migrated.
RELAY_COLUMNS = frozenset(
    {
        "event_id",
        "job",
        "created_at",
        "published_at",
        "attempts",
        "available_at",
        "lease_owner",
        "last_error",
        "last_attempt_at",
        "dead_at",
        "dead_reason",
        "sink_state",
    }
)

# Failures that say "this connection is gone, or the server cannot serve it right now", not
# "this statement is wrong". A PostgreSQL restart or failover, pg_terminate_backend, a network
# cut and a statement timeout all surface as one of these, at any statement, in any state of
# asyncpg's protocol machine (hence InternalClientError and InterfaceError).
_CONNECTION_GONE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,  # class 08, and "connection was closed in the middle"
    asyncpg.InterfaceError,  # "connection is closed", "another operation is in progress"
    asyncpg.InternalClientError,  # protocol state errors after the server went away
    asyncpg.exceptions.InvalidCachedStatementError,  # a schema change: re-prepared next time
)
_SQLSTATE_CLASSES_GONE = frozenset(
    {
        "08",  # connection exception
        "40",  # transaction rollback: serialization failure, deadlock
        "53",  # insufficient resources: too many connections, disk full
        "57",  # operator intervention: shutdown, terminated, statement timeout
        "58",  # system error: I/O
    }
)
_SQLSTATES_GONE = frozenset(
    {
        "55P03",  # lock_not_available (lock_timeout)
        "25006",  # read_only_sql_transaction: a failover left us on a standby
    }
)


def connection_gone(exc: BaseException) -> bool:
    """Whether `exc` means "retry on another connection" rather than "this statement fails"."""
    if isinstance(exc, asyncpg.ClientConfigurationError):
        return False  # a bad DSN or option: an operator must fix it
    if isinstance(exc, _CONNECTION_GONE):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = exc.sqlstate or ""
        return sqlstate[:2] in _SQLSTATE_CLASSES_GONE or sqlstate in _SQLSTATES_GONE
    return False


# Failures an operator must fix (bad password, missing database): retrying will not help.
FATAL_CONNECT: tuple[type[BaseException], ...] = (
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
)

_NAME_LINE = re.compile(r"^-- name: (\w+)\s*$", re.M)
# Section banners between blocks (`-- ====`) organise the file; they are not sent to the server.
_BANNER_LINE = re.compile(r"^-- =+\n(?:-- .*\n)*?-- =+\s*$", re.M)


def load_queries(table: OutboxTable) -> dict[str, str]:
    """Read the named blocks and bind the table identifiers into them, once."""
    text = resources.files("relayd").joinpath("sql/queries.sql").read_text(encoding="utf-8")
    pieces = _NAME_LINE.split(_BANNER_LINE.sub("", text))
    queries: dict[str, str] = {}
    for name, body in zip(pieces[1::2], pieces[2::2], strict=True):
        queries[name] = render(body.strip(), table)
    return queries


def render(sql: str, table: OutboxTable) -> str:
    """Substitute the validated, quoted identifiers for the @placeholders@."""
    return (
        sql.replace("@outbox@", table.qualified)
        .replace("@schema@", table.quoted_schema)
        .replace("@name@", table.name)
    )


@contextlib.contextmanager
def _translated(statement: str = "connect") -> Iterator[None]:
    """asyncpg's exceptions become relayd's: `DatabaseUnavailable` when the connection is
    gone (callers retry), `StatementError` naming `statement` when PostgreSQL refused it."""
    try:
        yield
    except Exception as exc:
        if connection_gone(exc):
            raise DatabaseUnavailable(describe_db_error(exc)) from exc
        if isinstance(exc, asyncpg.PostgresError):
            raise StatementError(statement, describe_db_error(exc)) from exc
        raise


def describe_db_error(exc: BaseException) -> str:
    """A short, secret-free description of a database failure."""
    if isinstance(exc, asyncpg.PostgresError):
        return f"{type(exc).__name__}: {exc.sqlstate}: {str(exc)[:200]}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return type(exc).__name__


@dataclass(frozen=True, slots=True)
class AppliedMigration:
    version: int
    name: str
    checksum: str
    applied_at: datetime


@dataclass(frozen=True, slots=True)
class MigrationStep:
    """One migration as the ledger sees it: recorded under `checksum`; an entry under any of
    `accepted` (today's text, or an earlier one differing in comments) is the same step."""

    version: int
    name: str
    checksum: str
    accepted: frozenset[str]
    sql: str


class Store:
    """Named queries over an asyncpg pool for one outbox table."""

    def __init__(self, pool: asyncpg.Pool, table: OutboxTable, dsn: str) -> None:
        self._pool = pool
        self._dsn = dsn
        self.table = table
        self._q = load_queries(table)

    @classmethod
    async def connect(
        cls,
        dsn: str,
        table: OutboxTable,
        *,
        max_size: int = 10,
        connect_timeout_s: float = 10.0,
        statement_timeout_s: float = 30.0,
    ) -> Store:
        """Open a pool; `DatabaseUnavailable` if PostgreSQL cannot be reached, `ConfigError`
        if it refuses us for good (bad credentials, no such database, a malformed DSN, an
        unknown server option)."""
        with _translated():
            try:
                pool = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    max_size=max_size,
                    timeout=connect_timeout_s,
                    server_settings=_server_settings(statement_timeout_s),
                )
            except (ValueError, asyncpg.ClientConfigurationError) as exc:
                # The message may quote the DSN, which may hold a password: name the type only.
                raise ConfigError("database.dsn", f"invalid DSN ({type(exc).__name__})") from None
            except asyncpg.PostgresError as exc:
                # Unreachable, shutting down, too many connections: _translated() makes it
                # DatabaseUnavailable. Anything else the server says while we connect
                # (FATAL_CONNECT, an unknown option in the DSN: 42704) it will say again.
                if connection_gone(exc) and not isinstance(exc, FATAL_CONNECT):
                    raise
                # The server's message names a user, a database or a setting, never the
                # password; the DSN itself is not quoted.
                raise ConfigError(
                    "database.dsn",
                    f"the server refused the connection: {exc.message} ({exc.sqlstate})",
                ) from None
        return cls(pool, table, dsn)

    async def close(self) -> None:
        with contextlib.suppress(*_CONNECTION_GONE):
            await asyncio.wait_for(self._pool.close(), timeout=5)

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with _translated(name):
            return await self._pool.fetch(self._q[name], *args)

    # --- the cycle ----------------------------------------------------------------------

    async def claim(self, limit: int, owner: uuid.UUID, lease_s: float) -> list[ClaimedRow]:
        records = await self._fetch("claim", limit, owner, lease_s, str(self.table))
        return [
            ClaimedRow(
                event_id=r["event_id"],
                job=r["job"],
                attempts=r["attempts"],
                previous_attempt_at=r["previous_attempt_at"],
                age_s=r["age_s"],
            )
            for r in records
        ]

    async def settle_published(
        self, owner: uuid.UUID, event_ids: Sequence[str], sink_states: Sequence[str]
    ) -> set[str]:
        return await self._settle("settle_published", owner, event_ids, sink_states)

    async def settle_retry(
        self,
        owner: uuid.UUID,
        event_ids: Sequence[str],
        delays_s: Sequence[float],
        errors: Sequence[str],
        refunds: Sequence[int],
    ) -> set[str]:
        return await self._settle("settle_retry", owner, event_ids, delays_s, errors, refunds)

    async def settle_dead(
        self,
        owner: uuid.UUID,
        event_ids: Sequence[str],
        reasons: Sequence[str],
        errors: Sequence[str],
    ) -> set[str]:
        return await self._settle("settle_dead", owner, event_ids, reasons, errors)

    async def release(
        self,
        owner: uuid.UUID,
        event_ids: Sequence[str],
        previous_attempt_at: Sequence[datetime | None],
    ) -> set[str]:
        return await self._settle("release", owner, event_ids, previous_attempt_at)

    async def _settle(
        self, name: str, owner: uuid.UUID, event_ids: Sequence[str], *columns: Sequence[Any]
    ) -> set[str]:
        """Run one fenced settle; returns the ids this owner still held (and so updated)."""
        if not event_ids:
            return set()
        records = await self._fetch(name, owner, list(event_ids), *map(list, columns))
        return {record[0] for record in records}

    async def next_due_s(self) -> float | None:
        with _translated("next_due_s"):
            value: float | None = await self._pool.fetchval(self._q["next_due_s"], str(self.table))
        return value

    async def ping(self) -> None:
        with _translated("ping"):
            await self._pool.fetchval(self._q["ping"])

    async def delete_published(self, retention_s: float, limit: int) -> int:
        with _translated("delete_published"):
            status: str = await self._pool.execute(self._q["delete_published"], retention_s, limit)
        return int(status.rsplit(" ", 1)[-1])

    # --- schema ----------------------------------------------------------------------------

    async def check_schema(self) -> None:
        """`SchemaError` unless the outbox table exists with every relay column."""
        records = await self._fetch("outbox_columns", self.table.schema_name, self.table.name)
        present = {r["column_name"] for r in records}
        if not present:
            raise SchemaError(f"outbox table {self.table} does not exist: run `relayd migrate`")
        missing = sorted(RELAY_COLUMNS - present)
        if missing:
            raise SchemaError(
                f"outbox table {self.table} lacks {', '.join(missing)}: run `relayd migrate`"
            )

    async def apply_migrations(
        self, migrations: Sequence[MigrationStep]
    ) -> tuple[list[AppliedMigration], list[int]]:
        """Apply the steps in order, in one transaction, under an advisory lock; returns the
        ledger as it was and the versions applied now.

        `MigrationError` (and nothing applied) if an applied migration's checksum differs.
        """
        outbox = str(self.table)
        accepted = {step.version: step.accepted for step in migrations}
        with _translated("migrations"):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(self._q["migrations_lock"], outbox)
                await conn.execute(self._q["migrations_schema_create"])
                await conn.execute(self._q["migrations_ledger_create"])
                ledger = [
                    AppliedMigration(
                        version=r["version"],
                        name=r["name"],
                        checksum=r["checksum"],
                        applied_at=r["applied_at"],
                    )
                    for r in await conn.fetch(self._q["migrations_applied"], outbox)
                ]
                for entry in ledger:
                    if entry.checksum not in accepted.get(entry.version, {entry.checksum}):
                        raise MigrationError(
                            f"migration {entry.version:04d}_{entry.name} was applied to "
                            f"{self.table} from a different file; restore the original file"
                        )
                done = {m.version for m in ledger}
                applied_now: list[int] = []
                for step in migrations:
                    if step.version in done:
                        continue
                    await conn.execute(step.sql)
                    await conn.execute(
                        self._q["migrations_record"], outbox, step.version, step.name, step.checksum
                    )
                    applied_now.append(step.version)
        return ledger, applied_now

    # --- the backlog as operators see it: sampler, status, heartbeats --------------------
    # Rows come back as plain dicts; relayd/status.py gives them their meaning and types.

    async def backlog_sample(self, limit: int, lease_s: float) -> dict[str, Any]:
        """The sampler's one bounded statement: each scan reads at most `limit` rows; leases
        are looked for among the rows due within `lease_s`."""
        records = await self._fetch("backlog_sample", str(self.table), limit, lease_s)
        return dict(records[0].items())

    async def status_rows(
        self, bound: int, top: int, lease_s: float
    ) -> dict[str, list[dict[str, Any]]]:
        """Every part of `relayd status`, by query name, read in one read-only snapshot so
        that the parts agree (and share one now())."""
        outbox = str(self.table)
        statements: dict[str, tuple[Any, ...]] = {
            "backlog_sample": (outbox, bound + 1, lease_s),
            "backlog_top": (bound, top),
            "dead_by_reason": (bound,),
            "pauses_list": (outbox,),
            "instances_list": (outbox,),
        }
        rows: dict[str, list[dict[str, Any]]] = {}
        with _translated("status"):
            async with (
                self._pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                for name, args in statements.items():
                    with _translated(name):
                        records = await conn.fetch(self._q[name], *args)
                        rows[name] = [dict(record.items()) for record in records]
        return rows

    async def heartbeat(self, beat: Heartbeat) -> None:
        """Insert or refresh a relay's row in relayd_instances; prune day-old rows."""
        with _translated("heartbeat"):
            await self._pool.execute(
                self._q["heartbeat"],
                str(self.table),
                beat.instance_id,
                beat.host,
                beat.pid,
                beat.version,
                beat.started_at,
                beat.breaker_state,
                beat.in_flight,
            )

    async def heartbeat_delete(self, instance_id: uuid.UUID) -> None:
        with _translated("heartbeat_delete"):
            await self._pool.execute(self._q["heartbeat_delete"], str(self.table), instance_id)

    # --- dead letters, pauses, audit -------------------------------------------------------

    async def check_operator_schema(self) -> None:
        """`SchemaError` unless the outbox has the discard columns, the pauses and the audit
        trail (migration 0003)."""
        await self.check_schema()
        with _translated("operator_schema"):
            ready: bool = await self._pool.fetchval(
                self._q["operator_schema"], self.table.schema_name, self.table.name
            )
        if not ready:
            raise SchemaError(
                f"outbox table {self.table} lacks the dead-letter and pause tables: "
                "run `relayd migrate`"
            )

    async def operator_now(self) -> datetime:
        """The database's clock."""
        with _translated("operator_now"):
            now: datetime = await self._pool.fetchval(self._q["operator_now"])
        return now

    async def list_dead_letters(
        self, filters: DeadLetterFilter, *, limit: int, include_discarded: bool
    ) -> list[DeadLetterRow]:
        """Dead letters matching `filters`, newest first."""
        f = filters
        records = await self._fetch(
            "dlq_list",
            f.since,
            f.until,
            f.queue,
            f.type,
            f.dead_reason,
            f.error_contains,
            include_discarded,
            limit,
        )
        return [self._dead_letter_row(r) for r in records]

    async def dead_letter(self, event_id: str) -> DeadLetterRow | None:
        """The outbox row `event_id` with its envelope, whatever its state; None if absent."""
        records = await self._fetch("dlq_show", event_id)
        return self._dead_letter_row(records[0]) if records else None

    async def act_on_dead_letters(
        self,
        action: DlqAction,
        target: DeadLetterPage | Sequence[str],
        *,
        audit: AuditEntry,
        audit_id: int | None,
        dry_run: bool = False,
    ) -> DeadLetterBatch:
        """One batch of a dead-letter action, in one short transaction: lock the rows (a
        keyset page of the filtered dead letters, or the named ids), redrive or discard
        those that can be, and add the rows changed to the action's audit row (inserted by
        the first batch that changes anything: `audit_id` None), so that the audit trail
        always counts exactly what was committed. A dry run does the same and rolls it back:
        it reports exactly what the action would do, and leaves no audit row. A discard
        records `audit.reason` on the rows.
        """
        statement = "dlq_redrive" if action is DlqAction.REDRIVE else "dlq_discard"
        discard_reason = audit.reason if action is DlqAction.DISCARD else None
        with _translated("dlq_batch"):
            async with self._pool.acquire() as conn:
                transaction = conn.transaction()
                await transaction.start()
                try:
                    if isinstance(target, DeadLetterPage):
                        with _translated("dlq_page"):
                            page = await conn.fetch(self._q["dlq_page"], *self._page_args(target))
                        ids = [r["event_id"] for r in page if r["selected"]]
                        examined = len(page)
                        after = (page[-1]["dead_at"], page[-1]["event_id"]) if page else None
                    else:
                        ids, examined, after = list(target), len(target), None
                    results = []
                    if ids:
                        with _translated(statement):
                            results = await self._act(conn, statement, ids, discard_reason)
                    changed = [r.event_id for r in results if r.outcome.changed]
                    if changed and not dry_run:
                        with _translated("audit_insert" if audit_id is None else "audit_extend"):
                            audit_id = await self._audit(conn, audit, audit_id, changed)
                except BaseException:
                    # The connection may be gone too: what it failed with is what matters.
                    with contextlib.suppress(*_CONNECTION_GONE):
                        await transaction.rollback()
                    raise
                if dry_run:
                    await transaction.rollback()
                else:
                    await transaction.commit()
        return DeadLetterBatch(
            results=results, examined=examined, next_after=after, audit_id=audit_id
        )

    async def _act(
        self,
        conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record],
        name: str,
        ids: list[str],
        discard_reason: str | None,
    ) -> list[RowResult]:
        """Run `dlq_redrive` or `dlq_discard` over `ids`; results in the order of `ids`.

        The statement refuses, by name, the rows the table's checks would refuse. Should a
        check it does not know of (a later migration, a check the owner added) still fail
        it, the batch is not lost: each row is tried alone under a savepoint, and those the
        check refuses are reported with its name.
        """
        extra = () if discard_reason is None else (discard_reason,)
        found: dict[str, RowResult] = {}
        try:
            async with conn.transaction():  # a savepoint
                records = await conn.fetch(self._q[name], ids, *extra)
        except asyncpg.CheckViolationError:
            records = []
            for event_id in ids:
                try:
                    async with conn.transaction():
                        records.extend(await conn.fetch(self._q[name], [event_id], *extra))
                except asyncpg.CheckViolationError as exc:
                    found[event_id] = RowResult(
                        event_id,
                        RowOutcome.REFUSED,
                        f"the table's check {exc.constraint_name} refuses it as a pending row",
                    )
        for record in records:
            found[record["event_id"]] = self._row_result(record, name)
        return [found.get(i) or RowResult(i, RowOutcome.NOT_FOUND, "no such row") for i in ids]

    async def _audit(
        self,
        conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record],
        audit: AuditEntry,
        audit_id: int | None,
        ids: list[str],
    ) -> int:
        most = 2**31 - 1 if audit.keep_all_ids else AUDIT_MAX_IDS
        if audit_id is not None:
            await conn.execute(self._q["audit_extend"], audit_id, len(ids), ids, most)
            return audit_id
        new_id: int = await conn.fetchval(
            self._q["audit_insert"],
            str(self.table),
            audit.actor,
            audit.action,
            json.dumps(audit.filters),
            ids if len(ids) <= most else None,
            len(ids),
            audit.reason,
        )
        return new_id

    async def pause(self, queue: str, reason: str, actor: str) -> bool:
        """Pause `queue` (`'*'`: every queue) for every relay of this outbox, and audit it,
        in one transaction; True if it was not paused before (pausing again updates the
        reason and the actor). Relays obey from their next claim."""
        with _translated("pause_upsert"):
            async with self._pool.acquire() as conn, conn.transaction():
                inserted: bool = await conn.fetchval(
                    self._q["pause_upsert"], str(self.table), queue, reason, actor
                )
                await conn.fetchval(
                    self._q["audit_insert"],
                    str(self.table),
                    actor,
                    PauseAction.PAUSE.value,
                    json.dumps({"queue": queue}),
                    None,
                    1,
                    reason,
                )
        return inserted

    async def resume(self, queue: str, actor: str, reason: str | None = None) -> Pause | None:
        """Lift the pause of `queue`, audit it and wake idle relays (NOTIFY on the outbox's
        channel, delivered at commit), in one transaction; the pause lifted, or None (and
        nothing written) if `queue` was not paused."""
        with _translated("pause_delete"):
            async with self._pool.acquire() as conn, conn.transaction():
                record = await conn.fetchrow(self._q["pause_delete"], str(self.table), queue)
                if record is None:
                    return None
                await conn.fetchval(
                    self._q["audit_insert"],
                    str(self.table),
                    actor,
                    PauseAction.RESUME.value,
                    json.dumps({"queue": queue}),
                    None,
                    1,
                    reason,
                )
                await conn.fetchval(self._q["outbox_notify"], self.table.channel)
        return self._pause(record)

    async def pauses(self) -> list[Pause]:
        """The pauses in force for this outbox."""
        return [self._pause(r) for r in await self._fetch("pauses_list", str(self.table))]

    @staticmethod
    def _page_args(page: DeadLetterPage) -> tuple[Any, ...]:
        # The first page starts at --since, or before the lowest key there is: asyncpg
        # sends datetime.min as '-infinity'.
        start = page.filters.since or datetime.min.replace(tzinfo=UTC)
        after_at, after_id = page.after or (start, str(uuid.UUID(int=0)))
        f = page.filters
        return (
            after_at,
            after_id,
            page.until,
            f.queue,
            f.type,
            f.dead_reason,
            f.error_contains,
            page.limit,
        )

    @staticmethod
    def _dead_letter_row(record: asyncpg.Record) -> DeadLetterRow:
        return DeadLetterRow(
            event_id=record["event_id"],
            created_at=record["created_at"],
            published_at=record["published_at"],
            dead_at=record["dead_at"],
            dead_reason=record["dead_reason"],
            queue=record["queue"],
            type=record["type"],
            attempts=record["attempts"],
            last_error=record["last_error"],
            last_attempt_at=record["last_attempt_at"],
            discarded_at=record["discarded_at"],
            discard_reason=record["discard_reason"],
            job=record.get("job"),
        )

    @staticmethod
    def _row_result(record: asyncpg.Record, statement: str) -> RowResult:
        event_id = record["event_id"]
        if record["changed"]:
            done = RowOutcome.REDRIVEN if statement == "dlq_redrive" else RowOutcome.DISCARDED
            return RowResult(event_id, done)
        if not record["dead"]:
            state = "published" if record["published"] else "pending"
            return RowResult(event_id, RowOutcome.NOT_DEAD, f"not a dead letter: {state}")
        if record["refusal"] is not None:
            return RowResult(event_id, RowOutcome.REFUSED, record["refusal"])
        return RowResult(event_id, RowOutcome.ALREADY_DISCARDED, "discarded already")

    @staticmethod
    def _pause(record: asyncpg.Record) -> Pause:
        return Pause(
            queue=record["queue"],
            reason=record["reason"],
            paused_by=record["paused_by"],
            paused_at=record["paused_at"],
        )

    # --- the outbox's health: check, doctor ------------------------------------------------

    async def check_identity(self) -> asyncpg.Record:
        [record] = await self._fetch("check_identity")
        return record

    async def check_ledger_exists(self) -> bool:
        [record] = await self._fetch(
            "check_ledger_exists", f"{self.table.quoted_schema}.relayd_migrations"
        )
        return bool(record[0])

    async def applied_versions(self) -> list[int]:
        """The migration versions applied to this outbox (none if there is no ledger)."""
        if not await self.check_ledger_exists():
            return []
        return [r["version"] for r in await self._fetch("migrations_applied", str(self.table))]

    async def check_privileges(
        self, wanted: Sequence[tuple[str, str]]
    ) -> list[tuple[str, str, bool]]:
        """Whether the current user holds each (relation, privilege)."""
        records = await self._fetch(
            "check_privileges", [r for r, _ in wanted], [p for _, p in wanted]
        )
        return [(r["relation"], r["privilege"], r["held"]) for r in records]

    async def check_listen(self) -> None:
        """LISTEN on the outbox's channel works (it does not on a hot standby)."""
        with _translated("check_listen"):
            async with self._pool.acquire() as conn:
                await conn.execute(f'LISTEN "{self.table.channel}"')
                await conn.execute(f'UNLISTEN "{self.table.channel}"')

    async def doctor_table(self) -> asyncpg.Record | None:
        records = await self._fetch("doctor_table", self.table.schema_name, self.table.name)
        return records[0] if records else None

    async def doctor_indexes(self) -> list[asyncpg.Record]:
        return await self._fetch("doctor_indexes", self.table.schema_name, self.table.name)

    async def doctor_xmin_holders(self, limit: int) -> list[asyncpg.Record]:
        return await self._fetch("doctor_xmin_holders", limit)

    async def doctor_horizon_others(self) -> list[asyncpg.Record]:
        return await self._fetch("doctor_horizon_others")

    async def explain_claim(self, limit: int, lease_s: float) -> Any:
        """The claim's plan (EXPLAIN, not run), as PostgreSQL's JSON."""
        with _translated("explain_claim"):
            return await self._pool.fetchval(
                "EXPLAIN (FORMAT JSON) " + self._q["claim"],
                limit,
                uuid.UUID(int=0),
                lease_s,
                str(self.table),
            )

    # --- wakeup ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def listen(self, on_notify: Callable[[], None]) -> AsyncIterator[Listener]:
        """A dedicated connection LISTENing on the outbox's insert channel."""
        with _translated("listen"):
            conn = await asyncpg.connect(
                self._dsn, timeout=10, server_settings={"application_name": "relayd-listen"}
            )
        listener = Listener(conn)
        try:
            with _translated("listen"):
                conn.add_termination_listener(lambda _conn: listener.lost.set())
                await conn.add_listener(self.table.channel, lambda *_args: on_notify())
            yield listener
        finally:
            with contextlib.suppress(*_CONNECTION_GONE):
                await asyncio.wait_for(conn.close(), timeout=5)
            conn.terminate()


class Listener:
    """A live LISTEN connection: `lost` is set when it breaks; `ping()` proves it is alive."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self.lost = asyncio.Event()

    async def ping(self) -> None:
        with _translated("listen_ping"):
            await self._conn.fetchval("SELECT 1")


def _server_settings(statement_timeout_s: float) -> dict[str, str]:
    # Whole milliseconds, never 0: truncating a sub-millisecond timeout would send 0, which
    # PostgreSQL reads as "no limit" (config refuses one too; this is defence in depth).
    # Nearest rather than ceil, so float noise (4.03 s -> 4030.0000000000005 ms) adds nothing.
    return {
        "application_name": "relayd",
        "statement_timeout": str(max(1, round(statement_timeout_s * 1000))),
    }
