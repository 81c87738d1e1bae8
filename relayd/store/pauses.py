"""Pauses and the rows they hold: `relayd pause` and `relayd resume`, the poison-storm
guard's and the sink's pauses, and what `relayd held list` shows and `relayd held discard`
takes out."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg

from relayd.store.connection import _translated
from relayd.store.dead_letters import DeadLetterQueries
from relayd.store.records import (
    AuditEntry,
    DeadLetterBatch,
    HeldFilter,
    HeldPage,
    HeldRow,
    Pause,
    PauseAction,
    QueueUse,
    RowOutcome,
    RowResult,
)


class PauseQueries(DeadLetterQueries):
    """Held rows are pending rows in a paused queue and type (the claim skips them): the
    poison-storm guard's, the sink's or an operator's pause. Pausing, resuming and
    discarding held rows are audited as the operator's other actions are."""

    async def pause(self, queue: str, job_type: str, reason: str, actor: str) -> bool:
        """Pause `queue` and `job_type` (`'*'`: every queue, every type) for every relay of
        this outbox, and audit it, in one transaction; True if it was not paused before
        (pausing again updates the reason and the actor). Relays obey from their next claim."""
        with _translated("pause_upsert"):
            async with self._pool.acquire() as conn, conn.transaction():
                inserted: bool = await conn.fetchval(
                    self._q["pause_upsert"], str(self.table), queue, job_type, reason, actor
                )
                await self._audit_note(
                    conn, PauseAction.PAUSE, queue, job_type, reason=reason, actor=actor
                )
        return inserted

    async def pause_insert(self, queue: str, job_type: str, reason: str, actor: str) -> bool:
        """Pause `queue` and `job_type` unless they are paused already, and audit it, in one
        transaction: True if it paused them; False, and nothing written, if they were
        paused. relayd's own pauses (the sink's, the poison-storm guard's) go through it: many
        claims and replicas may ask for the same pause at once, and one pause is one audit
        row, never one per asker, nor an operator's reason overwritten."""
        with _translated("pause_insert"):
            async with self._pool.acquire() as conn, conn.transaction():
                inserted: bool | None = await conn.fetchval(
                    self._q["pause_insert"], str(self.table), queue, job_type, reason, actor
                )
                if not inserted:
                    return False
                await self._audit_note(
                    conn, PauseAction.PAUSE, queue, job_type, reason=reason, actor=actor
                )
        return True

    async def resume(
        self, queue: str, job_type: str, actor: str, reason: str | None = None
    ) -> Pause | None:
        """Lift the pause of `queue` and `job_type`, audit it and wake idle relays (NOTIFY on
        the outbox's channel, delivered at commit), in one transaction; the pause lifted, or
        None (and nothing written) if they were not paused."""
        with _translated("pause_delete"):
            async with self._pool.acquire() as conn, conn.transaction():
                record = await conn.fetchrow(
                    self._q["pause_delete"], str(self.table), queue, job_type
                )
                if record is None:
                    return None
                await self._audit_note(
                    conn, PauseAction.RESUME, queue, job_type, reason=reason, actor=actor
                )
                await conn.fetchval(self._q["outbox_notify"], self.table.channel)
        return self._pause(record)

    async def _audit_note(  # noqa: PLR0913 - the audit row's columns
        self,
        conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record],
        action: PauseAction,
        queue: str,
        job_type: str,
        *,
        reason: str | None,
        actor: str,
    ) -> None:
        """The audit row of a pause or a resume, in the caller's transaction."""
        with _translated("audit_note"):
            await conn.execute(
                self._q["audit_note"],
                str(self.table),
                actor,
                action.value,
                json.dumps({"queue": queue, "type": job_type}),
                reason,
            )

    async def pauses(self) -> list[Pause]:
        """The pauses in force for this outbox."""
        return [self._pause(r) for r in await self._fetch("pauses_list", str(self.table))]

    async def queue_use(self, queue: str, most_rows: int) -> QueueUse | None:
        """Whether any row routes to `queue`, reading at most `most_rows` rows; None when it
        cannot be told (no SELECT on the outbox, the statement timeout): it only feeds a
        warning, after the pause is written."""
        with _translated("queue_use"):
            try:
                record = await self._pool.fetchrow(self._q["queue_use"], queue, most_rows)
            except (asyncpg.InsufficientPrivilegeError, asyncpg.QueryCanceledError):
                return None
        assert record is not None  # noqa: S101 - one row, always
        return QueueUse(used=record["used"], rows_read=record["rows_read"] or 0)

    @staticmethod
    def _pause(record: asyncpg.Record) -> Pause:
        return Pause(
            queue=record["queue"],
            type=record["type"],
            reason=record["reason"],
            paused_by=record["paused_by"],
            paused_at=record["paused_at"],
        )

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
