"""The relay's cycle: claim, settle, release, the next due row, ping, retention."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from relayd.models import ClaimedRow
from relayd.store.connection import StoreBase, _translated


class CycleQueries(StoreBase):
    """The statements `relayd run` issues every cycle."""

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
