"""Rows a pause holds: what `relayd held list` shows and `relayd held discard` takes out."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg

from relayd.operator_models import (
    AuditEntry,
    DeadLetterBatch,
    HeldFilter,
    HeldPage,
    HeldRow,
    RowOutcome,
    RowResult,
)
from relayd.store.connection import _translated
from relayd.store.operator import OperatorQueries


class HeldQueries(OperatorQueries):
    """Held rows are pending rows in a paused queue and type (the claim skips them): the
    poison-storm guard's, or an operator's pause. Their audit rows are the operator's."""

    async def held_rows(self, filters: HeldFilter, *, limit: int) -> list[HeldRow]:
        """Held rows matching `filters`, in claim order."""
        records = await self._fetch(
            "held_list", str(self.table), filters.queue, filters.type, filters.error_contains, limit
        )
        return [
            HeldRow(
                event_id=r["event_id"],
                created_at=r["created_at"],
                available_at=r["available_at"],
                queue=r["queue"],
                type=r["type"],
                attempts=r["attempts"],
                last_error=r["last_error"],
                last_attempt_at=r["last_attempt_at"],
                in_flight=r["in_flight"],
            )
            for r in records
        ]

    async def discard_held(
        self,
        target: HeldPage | Sequence[str],
        *,
        audit: AuditEntry,
        audit_id: int | None,
        dry_run: bool = False,
    ) -> DeadLetterBatch:
        """One batch of `relayd held discard`, in one short transaction, as
        `act_on_dead_letters` does for dead letters: lock the rows (the next page of held
        rows, or the named ids), discard those still held and not in flight, extend the
        action's audit row; a dry run rolls it all back. `audit.reason` is the discard's."""
        reason = audit.reason or ""
        async with self._batch("held_batch", dry_run=dry_run) as conn:
            if isinstance(target, HeldPage):
                with _translated("held_page"):
                    page = await conn.fetch(self._q["held_page"], *self._held_args(target))
                ids = [r["event_id"] for r in page]
                examined = len(page)
                after = (page[-1]["available_at"], page[-1]["event_id"]) if page else None
            else:
                ids, examined, after = list(target), len(target), None
            results: list[RowResult] = []
            if ids:
                with _translated("held_discard"):
                    records = await conn.fetch(
                        self._q["held_discard"], ids, reason, str(self.table)
                    )
                results = self._held_results(ids, records)
            audit_id = await self._audited(conn, results, audit, audit_id, dry_run=dry_run)
        return DeadLetterBatch(
            results=results, examined=examined, next_after=after, audit_id=audit_id
        )

    def _held_args(self, page: HeldPage) -> tuple[object, ...]:
        # From before the lowest key there is: asyncpg sends datetime.min as '-infinity'.
        after_at, after_id = page.after or (datetime.min.replace(tzinfo=UTC), str(uuid.UUID(int=0)))
        f = page.filters
        return (str(self.table), after_at, after_id, f.queue, f.type, page.limit, f.error_contains)

    @staticmethod
    def _held_results(ids: list[str], records: list[asyncpg.Record]) -> list[RowResult]:
        found: dict[str, RowResult] = {}
        for record in records:
            event_id = record["event_id"]
            if record["changed"]:
                found[event_id] = RowResult(event_id, RowOutcome.DISCARDED)
            elif not record["pending"]:
                state = "published" if record["published"] else "dead-lettered"
                found[event_id] = RowResult(event_id, RowOutcome.NOT_HELD, f"not held: {state}")
            elif not record["held"]:
                found[event_id] = RowResult(
                    event_id, RowOutcome.NOT_HELD, "not held: no pause holds its queue and type"
                )
            else:
                found[event_id] = RowResult(
                    event_id,
                    RowOutcome.IN_FLIGHT,
                    "in flight: its attempt started before the pause; try again once it settles",
                )
        return [found.get(i) or RowResult(i, RowOutcome.NOT_FOUND, "no such row") for i in ids]
