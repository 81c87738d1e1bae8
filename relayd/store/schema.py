"""The outbox's schema: the relay's columns, and migrations applied under a ledger."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from relayd.core.errors import MigrationError, SchemaError
from relayd.store.connection import StoreBase, _translated

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
        "redriven_at",  # 0007: the claim reads it (a redrive's one re-send past the window)
    }
)


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


class SchemaQueries(StoreBase):
    """Whether the outbox is migrated, and migrating it."""

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
        self,
        migrations: Sequence[MigrationStep],
        *,
        notify_trigger: bool,
        key_column: str | None = None,
    ) -> tuple[list[AppliedMigration], list[int], bool]:
        """Apply the steps in order, then create or drop the NOTIFY trigger as
        `notify_trigger` says, in one transaction, under an advisory lock; returns the ledger
        as it was, the versions applied now and whether the trigger was created or dropped.

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
                state = await conn.fetchval(self._q["notify_trigger_state"], outbox)
                # 'D' is a trigger disabled by hand: recreated when wanted, dropped if not.
                changed = state in (None, "D") if notify_trigger else state is not None
                if changed:
                    await conn.execute(self._q["notify_trigger_drop"])
                    if notify_trigger:
                        await conn.execute(self._q["notify_trigger_create"])
                await self._key_column(conn, key_column)
        return ledger, applied_now, changed

    async def _key_column(
        self, conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record], column: str | None
    ) -> None:
        """Give the outbox the trigger that copies `column` into ordering_key, or take it away
        (None), as outbox.ordering_key_column says; `MigrationError` if the table has no
        such column."""
        outbox = str(self.table)
        current = await conn.fetchval(self._q["key_column_trigger_state"], outbox)
        if current == column:
            return
        if column is not None and not await conn.fetchval(
            self._q["key_column_exists"], outbox, column
        ):
            raise MigrationError(
                f"outbox.ordering_key_column: {outbox} has no column {column!r} to take each "
                "row's ordering key from"
            )
        await conn.execute(self._q["key_column_trigger_drop"])
        if column is not None:
            await conn.execute(self._q["key_column_trigger_create"].replace("%column%", column))
