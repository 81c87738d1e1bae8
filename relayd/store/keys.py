"""Parked keys of ordered delivery: what `relayd keys` lists, and its three actions (retry,
skip, release), each in one transaction with its audit row."""

from __future__ import annotations

import dataclasses

import asyncpg

from relayd.core.errors import SchemaError
from relayd.core.outcomes import clean_error
from relayd.store.connection import _translated
from relayd.store.dead_letters import DeadLetterQueries
from relayd.store.records import AuditEntry, HeadState, KeyAction, KeyOutcome, ParkedKey

# What `relayd keys skip` puts before the head's last error.
SKIPPED_PREFIX = "skipped by an operator: "


class KeyQueries(DeadLetterQueries):
    """A parked key is a row of relayd_parked_keys: the ordered claim skips its key, and its
    head waits at available_at 'infinity' (sql/keys.sql). Each action deletes that row, which
    is enough for the claim to take the key's head again, and does what it says to the head,
    in one transaction with its audit row."""

    async def check_ordering_schema(self) -> None:
        """`SchemaError` unless the outbox has ordered delivery's columns and the parked keys'
        table (migration 0011)."""
        with _translated("ordering_schema"):
            ready: bool = await self._pool.fetchval(
                self._q["ordering_schema"], self.table.schema_name, self.table.name
            )
        if not ready:
            raise SchemaError(
                f"outbox table {self.table} lacks ordered delivery (migration 0011): "
                "run `relayd migrate`"
            )

    async def parked_keys(self, *, route: str | None, limit: int, bound: int) -> list[ParkedKey]:
        """The parked keys of this outbox (of one route, if given), parked longest first; each
        key's other pending rows are counted up to `bound` + 1."""
        records = await self._fetch("keys_list", str(self.table), route, limit, bound + 1)
        return [
            ParkedKey(
                key=r["ordering_key"],
                route=r["type"],
                event_id=r["event_id"],
                reason=r["reason"],
                error=r["error"],
                parked_at=r["parked_at"],
                parked_age_s=max(r["parked_age_s"], 0.0),
                head_state=HeadState(r["head_state"]),
                attempts=r["attempts"],
                last_attempt_at=r["last_attempt_at"],
                waiting=int(r["waiting"]),
                waiting_bound=bound,
            )
            for r in records
        ]

    async def act_on_key(
        self, action: KeyAction, key: str, *, audit: AuditEntry, dry_run: bool = False
    ) -> KeyOutcome | None:
        """Un-park `key` and do what `action` says to the row that parked it, in one
        transaction with the action's audit row and a NOTIFY that wakes idle relays (a dry
        run does it all and rolls it back); None, and nothing changed, if the key is not
        parked. Fenced: the park's row is deleted first (a second action on the same key
        waits, then finds nothing), and the head is locked before it is changed. A head that
        is no longer pending (dead-lettered or published since it parked) is left as it is:
        the key is un-parked only."""
        async with self._batch("keys_act", dry_run=dry_run) as conn:
            with _translated("key_unpark"):
                parked = await conn.fetchrow(self._q["key_unpark"], str(self.table), key)
            if parked is None:
                return None
            with _translated("key_head"):
                head = await conn.fetchrow(self._q["key_head"], parked["event_id"])
            state = _state(head)
            attempts_before = None if head is None else head["attempts"]
            after = None
            if state is HeadState.PENDING and action is KeyAction.RETRY:
                with _translated("key_retry"):
                    after = await conn.fetchrow(self._q["key_retry"], parked["event_id"])
            elif state is HeadState.PENDING and action is KeyAction.SKIP:
                assert head is not None  # noqa: S101 - pending: the row is there
                error = clean_error(SKIPPED_PREFIX + (head["last_error"] or parked["error"] or ""))
                with _translated("key_skip"):
                    after = await conn.fetchrow(
                        self._q["key_skip"], parked["event_id"], parked["reason"], error
                    )
            audit_id = None
            if not dry_run:
                entry = dataclasses.replace(
                    audit,
                    filters={"key": key, "route": parked["type"], "parked_reason": parked["reason"]}
                    | audit.filters,
                )
                with _translated("audit_insert"):
                    audit_id = await self._audit(conn, entry, None, [parked["event_id"]])
            with _translated("outbox_notify"):
                await conn.fetchval(self._q["outbox_notify"], self.table.channel)
        return KeyOutcome(
            action=action,
            key=key,
            route=parked["type"],
            event_id=parked["event_id"],
            reason=parked["reason"],
            error=parked["error"],
            parked_at=parked["parked_at"],
            head_state=state,
            attempts_before=attempts_before,
            attempts_after=attempts_before if after is None else after["attempts"],
            last_error=(None if head is None else head["last_error"])
            if after is None
            else after["last_error"],
            dry_run=dry_run,
            audit_id=audit_id,
        )


def _state(head: asyncpg.Record | None) -> HeadState:
    if head is None:
        return HeadState.MISSING
    if head["published"]:
        return HeadState.PUBLISHED
    return HeadState.DEAD if head["dead"] else HeadState.PENDING
