"""Dead letters and the audit trail: what `relayd dlq` reads and changes, and the batched,
audited transaction every operator action over many rows runs in (held rows' too)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg

from relayd.core.errors import SchemaError
from relayd.store.connection import _CONNECTION_GONE, _translated
from relayd.store.records import (
    AUDIT_MAX_IDS,
    AuditEntry,
    DeadLetterBatch,
    DeadLetterFilter,
    DeadLetterPage,
    DeadLetterRow,
    DlqAction,
    OutOfOrder,
    RowOutcome,
    RowResult,
)
from relayd.store.schema import SchemaQueries


class DeadLetterQueries(SchemaQueries):
    """`relayd dlq`; its schema check, shared by every operator command, starts with the
    relay's (hence SchemaQueries)."""

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
        records = await self._fetch(
            "dlq_list", filters.since, filters.until, include_discarded, limit, *filters.matching()
        )
        return [self._dead_letter_row(r) for r in records]

    async def dead_letter(self, event_id: str) -> DeadLetterRow | None:
        """The outbox row `event_id` with its envelope, whatever its state; None if absent."""
        records = await self._fetch("dlq_show", event_id)
        return self._dead_letter_row(records[0]) if records else None

    async def act_on_dead_letters(  # noqa: PLR0913 - the batch, then keyword-only options
        self,
        action: DlqAction,
        target: DeadLetterPage | Sequence[str],
        *,
        audit: AuditEntry,
        audit_id: int | None,
        dry_run: bool = False,
        out_of_order: bool = False,
    ) -> DeadLetterBatch:
        """One batch of a dead-letter action, in one short transaction: lock the rows (a
        keyset page of the filtered dead letters, or the named ids), redrive or discard
        those that can be, and add the rows changed to the action's audit row (inserted by
        the first batch that changes anything: `audit_id` None), so that the audit trail
        always counts exactly what was committed. A dry run does the same and rolls it back:
        it reports exactly what the action would do, and leaves no audit row. A discard
        records `audit.reason` on the rows. A redrive skips, as out of order, a row of an
        ordered key that later rows of the key overtook, unless `out_of_order`.
        """
        statement = "dlq_redrive" if action is DlqAction.REDRIVE else "dlq_discard"
        discard_reason = audit.reason if action is DlqAction.DISCARD else None
        async with self._batch("dlq_batch", dry_run=dry_run) as conn:
            if isinstance(target, DeadLetterPage):
                with _translated("dlq_page"):
                    page = await conn.fetch(self._q["dlq_page"], *self._page_args(target))
                ids = [r["event_id"] for r in page if r["selected"]]
                examined = len(page)
                after = (page[-1]["dead_at"], page[-1]["event_id"]) if page else None
            else:
                ids, examined, after = list(target), len(target), None
            refused: dict[str, RowResult] = {}
            if ids and action is DlqAction.REDRIVE and not out_of_order:
                # Again, once the rows are locked: a later row of a key may have been
                # published since the command looked (`dead_letters_out_of_order`).
                with _translated("dlq_out_of_order"):
                    records = await conn.fetch(
                        self._q["dlq_out_of_order"], None, None, ids, len(ids), *(None,) * 4
                    )
                for record in records:
                    row = self._out_of_order(record)
                    refused[row.event_id] = RowResult(
                        row.event_id, RowOutcome.OUT_OF_ORDER, row.describe()
                    )
            results: list[RowResult] = []
            acting = [i for i in ids if i not in refused]
            if acting:
                with _translated(statement):
                    done = {
                        r.event_id: r
                        for r in await self._act(conn, statement, acting, discard_reason)
                    }
                results = [refused.get(i) or done[i] for i in ids]
            else:
                results = [refused[i] for i in ids]
            audit_id = await self._audited(conn, results, audit, audit_id, dry_run=dry_run)
        return DeadLetterBatch(
            results=results, examined=examined, next_after=after, audit_id=audit_id
        )

    async def dead_letters_out_of_order(
        self,
        ids: Sequence[str] | None,
        filters: DeadLetterFilter,
        *,
        until: datetime | None,
        limit: int,
    ) -> tuple[list[OutOfOrder], int]:
        """The dead letters among `ids` (None: those a bulk walk with `filters` up to
        `until` would meet) that belong to an ordered key whose later rows were published,
        the first `limit` of them, and how many there are in all."""
        records = await self._fetch(
            "dlq_out_of_order",
            filters.since if ids is None else None,
            until if ids is None else None,
            None if ids is None else list(ids),
            limit,
            *filters.matching(),
        )
        total = int(records[0]["offenders"]) if records else 0
        return [self._out_of_order(r) for r in records], total

    @staticmethod
    def _out_of_order(record: asyncpg.Record) -> OutOfOrder:
        return OutOfOrder(
            event_id=record["event_id"],
            key=record["ordering_key"],
            delivered_after=int(record["delivered_after"]),
        )

    @contextlib.asynccontextmanager
    async def _batch(
        self, name: str, *, dry_run: bool
    ) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
        """One batch of an operator action in its own short transaction, failures translated
        under `name`: committed, or rolled back for a dry run (which thereby reports exactly
        what it would do) or a failure."""
        with _translated(name):
            async with self._pool.acquire() as conn:
                transaction = conn.transaction()
                await transaction.start()
                try:
                    yield conn
                except BaseException:
                    # The connection may be gone too: what it failed with is what matters.
                    with contextlib.suppress(*_CONNECTION_GONE):
                        await transaction.rollback()
                    raise
                if dry_run:
                    await transaction.rollback()
                else:
                    await transaction.commit()

    async def _audited(
        self,
        conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record],
        results: Sequence[RowResult],
        audit: AuditEntry,
        audit_id: int | None,
        *,
        dry_run: bool,
    ) -> int | None:
        """Add a batch's changed rows to its action's audit row (inserted by the first batch
        that changes anything); a dry run writes none."""
        changed = [r.event_id for r in results if r.outcome.changed]
        if changed and not dry_run:
            with _translated("audit_insert" if audit_id is None else "audit_extend"):
                return await self._audit(conn, audit, audit_id, changed)
        return audit_id

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
            ids,
            len(ids),
            audit.reason,
            most,
        )
        return new_id

    @classmethod
    def _page_args(cls, page: DeadLetterPage) -> tuple[Any, ...]:
        # The first page starts at --since, or before the lowest key there is: asyncpg
        # sends datetime.min as '-infinity'.
        start = page.filters.since or datetime.min.replace(tzinfo=UTC)
        after_at, after_id = page.after or (start, str(uuid.UUID(int=0)))
        return (after_at, after_id, page.until, page.limit, *page.filters.matching())

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
