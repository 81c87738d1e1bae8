"""The outbox's health as `relayd check` and `relayd doctor` inspect it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg

from relayd.store.connection import StoreBase, _translated
from relayd.store.privileges import Privilege


class HealthQueries(StoreBase):
    """Identity, ledger, privileges, LISTEN, the table, its indexes, the xmin horizon and
    the claim's plan."""

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

    async def check_privileges(self, wanted: Sequence[Privilege]) -> list[bool | None]:
        """Whether the current user holds each privilege, in order; None where the object
        does not exist."""
        records = await self._fetch(
            "check_privileges",
            [p.obj.kind.value for p in wanted],
            [self.table.schema_name] * len(wanted),
            [p.obj.name_in(self.table) for p in wanted],
            [p.privilege for p in wanted],
        )
        return [r["held"] for r in records]

    async def check_sees_writers(self) -> bool:
        [record] = await self._fetch("check_sees_writers")
        return bool(record[0])

    async def notify_trigger_state(self) -> str | None:
        """The outbox's NOTIFY trigger: None if it has none, else pg_trigger.tgenabled."""
        [record] = await self._fetch("notify_trigger_state", str(self.table))
        state: str | None = record[0]
        return state

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
        """The claim's plan (EXPLAIN, not run) as a relay's session gets it, as PostgreSQL's
        JSON: the statement a relay runs, `claim_ordered`, unordered rows and keys' heads."""
        with _translated("explain_claim"):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(self._q["plan_as_relay"])
                return await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) " + self._q["claim_ordered"],
                    limit,
                    uuid.UUID(int=0),
                    lease_s,
                    str(self.table),
                    None,  # a full scan: the plan every claim uses, from the index's start
                    True,  # with the watermark's marks
                    None,  # the walk over the keys from the first
                )
