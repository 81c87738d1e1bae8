"""What `relayd console` reads beyond the operator commands' queries: dead letters a page at a
time after a keyset cursor, one event whatever its state, and the audit rows naming it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from relayd.store.connection import _translated
from relayd.store.dead_letters import DeadLetterQueries
from relayd.store.records import AuditRecord, DeadLetterFilter, DeadLetterRow, EventRecord

# The most actions on one event its history shows.
AUDIT_MOST = 1_000


class ConsoleQueries(DeadLetterQueries):
    """Bounded reads for the console's pages (sql/console.sql)."""

    async def console_dlq(
        self,
        filters: DeadLetterFilter,
        *,
        before: tuple[datetime, str] | None,
        limit: int,
        window: int,
    ) -> tuple[list[DeadLetterRow], tuple[datetime, str] | None]:
        """Up to `limit` dead letters (not discarded) matching `filters`, newest first, among
        at most `window` entries of the dead-letter index after the keyset cursor `before`
        (None: from `filters.until`, or the newest); and the cursor of the next page, None
        when no older dead letter can match."""
        start: tuple[datetime | None, str | None] = before or (filters.until, None)
        with _translated("console_dlq"):
            async with self._pool.acquire() as conn, conn.transaction(readonly=True):
                await conn.execute(self._q["console_in_order"])
                records = await conn.fetch(
                    self._q["console_dlq"],
                    filters.since,
                    filters.until,
                    start[0],
                    limit + 1,
                    *filters.matching(),
                    start[1],
                    window,
                )
        rows = [self._dead_letter_row(r) for r in records if not r["window_end"]]
        if len(rows) > limit:
            last = rows[limit - 1]
            assert last.dead_at is not None  # noqa: S101 - a dead letter
            return rows[:limit], (last.dead_at, last.event_id)
        # Fewer than a page matched: the scan read its window, or the index ended.
        ends = [r for r in records if r["window_end"]]
        if not ends or (filters.since is not None and ends[0]["dead_at"] < filters.since):
            return rows, None
        return rows, (ends[0]["dead_at"], ends[0]["event_id"])

    async def console_event(self, event_id: str) -> EventRecord | None:
        """The outbox row `event_id`, whatever its state; None if there is none."""
        records = await self._fetch("console_event", event_id, str(self.table))
        if not records:
            return None
        r = records[0]
        return EventRecord(
            event_id=r["event_id"],
            created_at=r["created_at"],
            available_at=r["available_at"],
            published_at=r["published_at"],
            dead_at=r["dead_at"],
            dead_reason=r["dead_reason"],
            queue=r["queue"],
            type=r["type"],
            attempts=r["attempts"],
            last_error=r["last_error"],
            last_attempt_at=r["last_attempt_at"],
            redriven_at=r["redriven_at"],
            discarded_at=r["discarded_at"],
            discard_reason=r["discard_reason"],
            leased=r["leased"],
            ordering_key=r["ordering_key"],
            ordering_seq=r["ordering_seq"],
            parks_its_key=r["parks_its_key"],
            job=r["job"],
            read_at=r["now"],
        )

    async def console_audit(
        self, event_id: str, *, most: int = AUDIT_MOST
    ) -> Sequence[AuditRecord]:
        """The audit rows naming `event_id` (the actions on it), oldest first, at most
        `most`."""
        records = await self._fetch("console_audit", str(self.table), event_id, most)
        return [
            AuditRecord(
                id=r["id"],
                at=r["at"],
                actor=r["actor"],
                action=r["action"],
                filters=_object(r["filters"]),
                row_count=r["row_count"],
                reason=r["reason"],
            )
            for r in records
        ]


def _object(text: str | None) -> dict[str, object]:
    try:
        data = json.loads(text or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
