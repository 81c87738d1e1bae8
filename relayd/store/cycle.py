"""The relay's cycle: claim, settle, release, the next due row, ping, retention."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from relayd.core.rows import ClaimBatch, ClaimedRow
from relayd.store.connection import StoreBase, _translated


class CycleQueries(StoreBase):
    """The statements `relayd run` issues every cycle."""

    async def claim(self, limit: int, owner: uuid.UUID, lease_s: float) -> list[ClaimedRow]:
        """A claim scanning the whole index (see `claim_from`)."""
        return (await self.claim_from(limit, owner, lease_s, None)).rows

    async def claim_from(  # noqa: PLR0913 - the claim's inputs, the walk's by keyword
        self,
        limit: int,
        owner: uuid.UUID,
        lease_s: float,
        scan_from: datetime | None,
        *,
        walk_from: str | None = None,
        ordered: bool = False,
        marks: bool = True,
    ) -> ClaimBatch:
        """Lease up to `limit` due rows, scanning the claim index from `scan_from` (None: from
        its start); the answer carries the next due time of the rows it left, whether rows of
        ordered keys are pending, and, if `marks`, the marks of the next watermark.
        `ordered`: the heads of keys too (`claim_ordered`), walking the keys from
        `walk_from`; without it, no row of a key is claimed before it was a head."""
        args: tuple[object, ...] = (limit, owner, lease_s, str(self.table), scan_from, marks)
        rows: list[ClaimedRow] = []
        head = writers_since = walked_to = next_due_s = None
        keyed = True
        if not ordered:
            # By position, in the statement's column order: a name lookup per field per row
            # costs more than the row's decoding. The one row without an id carries the marks.
            for (
                event_id,
                job,
                attempts,
                previous,
                age_s,
                redriven,
                row_head,
                row_writers,
                row_due,
                row_keyed,
            ) in await self._fetch("claim", *args):
                if event_id is None:
                    head, writers_since, next_due_s = row_head, row_writers, row_due
                    keyed = row_keyed
                else:
                    rows.append(ClaimedRow(event_id, job, attempts, previous, age_s, redriven))
            return ClaimBatch(rows, head, writers_since, None, next_due_s, marks, keyed)
        for (
            event_id,
            job,
            attempts,
            previous,
            age_s,
            redriven,
            key,
            row_head,
            row_writers,
            row_walked,
            row_due,
            row_keyed,
        ) in await self._fetch("claim_ordered", *args, walk_from):
            if event_id is None:
                head, writers_since, walked_to = row_head, row_writers, row_walked
                next_due_s, keyed = row_due, row_keyed
            else:
                rows.append(ClaimedRow(event_id, job, attempts, previous, age_s, redriven, key))
        return ClaimBatch(rows, head, writers_since, walked_to, next_due_s, marks, keyed)

    async def settle_published(
        self, owner: uuid.UUID, event_ids: Sequence[str], sink_states: Sequence[str]
    ) -> set[str]:
        return await self._settle("settle_published", owner, event_ids, sink_states)

    async def settle_retry(  # noqa: PLR0913, PLR0917 - one array per column, bound in order
        self,
        owner: uuid.UUID,
        event_ids: Sequence[str],
        delays_s: Sequence[float],
        errors: Sequence[str],
        refunds: Sequence[int],
        sent: Sequence[bool],
        previous_attempt_at: Sequence[datetime | None],
    ) -> set[str]:
        return await self._settle(
            "settle_retry", owner, event_ids, delays_s, errors, refunds, sent, previous_attempt_at
        )

    async def settle_dead(
        self,
        owner: uuid.UUID,
        event_ids: Sequence[str],
        reasons: Sequence[str],
        errors: Sequence[str],
    ) -> set[str]:
        return await self._settle("settle_dead", owner, event_ids, reasons, errors)

    async def settle_parked(
        self,
        owner: uuid.UUID,
        event_ids: Sequence[str],
        reasons: Sequence[str],
        errors: Sequence[str],
    ) -> set[str]:
        """Park the keys of heads that can never be delivered (`settle_parked`)."""
        if not event_ids:
            return set()
        [record] = await self._fetch(
            "settle_parked", owner, list(event_ids), list(reasons), list(errors), str(self.table)
        )
        updated: list[str] | None = record[0]
        return set(event_ids) if updated is None else set(updated)

    async def release(
        self,
        owner: uuid.UUID,
        event_ids: Sequence[str],
        previous_attempt_at: Sequence[datetime | None],
    ) -> set[str]:
        return await self._settle("release", owner, event_ids, previous_attempt_at)

    async def take_back(self, lowest: uuid.UUID, highest: uuid.UUID) -> int:
        """Make the running leases of owner tokens from `lowest` to `highest` due now (a
        dead process's, as its successor knows them); how many."""
        with _translated("take_back"):
            taken: int = await self._pool.fetchval(self._q["take_back"], lowest, highest)
        return taken

    async def _settle(
        self, name: str, owner: uuid.UUID, event_ids: Sequence[str], *columns: Sequence[Any]
    ) -> set[str]:
        """Run one fenced settle; returns the ids this owner still held (and so updated)."""
        if not event_ids:
            return set()
        [record] = await self._fetch(name, owner, list(event_ids), *map(list, columns))
        updated: list[str] | None = record[0]
        return set(event_ids) if updated is None else set(updated)

    async def next_due_s(self, scan_from: datetime | None = None) -> float | None:
        with _translated("next_due_s"):
            value: float | None = await self._pool.fetchval(
                self._q["next_due_s"], str(self.table), scan_from
            )
        return value

    async def ping(self) -> None:
        with _translated("ping"):
            await self._pool.fetchval(self._q["ping"])

    async def delete_published(self, retention_s: float, limit: int) -> int:
        with _translated("delete_published"):
            status: str = await self._pool.execute(self._q["delete_published"], retention_s, limit)
        return int(status.rsplit(" ", 1)[-1])
