"""Parked keys of ordered delivery, one function per action: what `relayd keys` runs, and what
another front end (a web console) calls to do the same, with the same checks and audit.

A key parks when its head (its pending row with the lowest number) exhausts its attempts or
is refused for good on a route that parks: the head stays pending at available_at
'infinity', its key's row in relayd_parked_keys makes the ordered claim skip the key, and
every later row of the key waits. Each action takes that row away in one transaction, which
is enough for the claim to take the key's head again, with one audit row:

- `retry_key`: the head gets its attempts back (its last_attempt_at kept, so its next
  attempt reconciles or reads back before it sends again);
- `skip_key`: the head is dead-lettered with the reason that parked the key, and the key goes
  on from its next row (`relayd dlq retry` can bring the head back later);
- `release_key`: the key is un-parked only; the head keeps its attempts, so one more failure
  parks the key again.

A key that is not parked raises `NotParked`, and nothing is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relayd.operator.render import iso
from relayd.store.records import AuditEntry, KeyAction, KeyOutcome, ParkedKey

if TYPE_CHECKING:
    from relayd.store import Store

DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 10_000
# How many of a key's waiting rows are counted, at most (more shows as "10000+").
WAITING_BOUND = 10_000
# A key is 1 to 256 characters (the outbox's check relayd_ordering_key_length).
MAX_KEY_CHARS = 256


class NotParked(LookupError):
    """The key named is not parked (never was, or another action lifted its park first)."""

    def __init__(self, key: str, table: str) -> None:
        super().__init__(f"key {key} is not parked in {table}")
        self.key = key
        self.table = table


def check_key(value: str) -> str:
    """A key as the outbox stores it: 1 to 256 characters, taken as given (a key may hold
    spaces). ValueError says what is wrong."""
    if not value:
        raise ValueError("must not be empty")
    if len(value) > MAX_KEY_CHARS:
        raise ValueError(f"a key is at most {MAX_KEY_CHARS} characters, got {len(value)}")
    return value


async def parked_keys(
    store: Store,
    *,
    route: str | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    bound: int = WAITING_BOUND,
) -> list[ParkedKey]:
    """The parked keys of the store's outbox (of one route: the event type of the head that
    parked it), parked longest first, each with its head and its waiting rows counted up to
    `bound`. A key whose rows flow is not parked and not listed."""
    return await store.parked_keys(route=route, limit=limit, bound=bound)


async def retry_key(
    store: Store, key: str, *, actor: str, reason: str | None = None, dry_run: bool = False
) -> KeyOutcome:
    """Give the head of parked `key` its attempts back and un-park the key: the relays take
    the head next, then the key's waiting rows in order. Audited as `keys.retry`."""
    return await _act(store, KeyAction.RETRY, key, actor=actor, reason=reason, dry_run=dry_run)


async def skip_key(
    store: Store, key: str, *, actor: str, reason: str, dry_run: bool = False
) -> KeyOutcome:
    """Dead-letter the head of parked `key` and un-park the key: its next row becomes its
    head. `reason` is required (the key's order is broken on purpose). Audited as
    `keys.skip`."""
    if not reason:
        raise ValueError("a skip needs a reason: say why this row may be passed over")
    return await _act(store, KeyAction.SKIP, key, actor=actor, reason=reason, dry_run=dry_run)


async def release_key(
    store: Store, key: str, *, actor: str, reason: str | None = None, dry_run: bool = False
) -> KeyOutcome:
    """Un-park `key` only: its head is tried again with the attempts it has, and one more
    failure parks the key again. Audited as `keys.release`."""
    return await _act(store, KeyAction.RELEASE, key, actor=actor, reason=reason, dry_run=dry_run)


async def _act(  # noqa: PLR0913 - the action, its key, and the audit's fields by keyword
    store: Store,
    action: KeyAction,
    key: str,
    *,
    actor: str,
    reason: str | None,
    dry_run: bool,
) -> KeyOutcome:
    audit = AuditEntry(actor=actor, action=action.value, reason=reason, keep_all_ids=True)
    outcome = await store.act_on_key(action, check_key(key), audit=audit, dry_run=dry_run)
    if outcome is None:
        raise NotParked(key, str(store.table))
    return outcome


# --- JSON: what `relayd keys --json` prints, and what a console may serve ---------------


def parked_key_json(parked: ParkedKey) -> dict[str, Any]:
    return {
        "key": parked.key,
        "route": parked.route,
        "parked_at": iso(parked.parked_at),
        "parked_age_s": round(parked.parked_age_s, 3),
        "event_id": parked.event_id,
        "head_state": parked.head_state.value,
        "reason": parked.reason,
        "error": parked.error,
        "attempts": parked.attempts,
        "last_attempt_at": iso(parked.last_attempt_at),
        "rows_waiting": min(parked.waiting, parked.waiting_bound),
        "rows_waiting_capped": parked.waiting_capped,
    }


def outcome_json(outcome: KeyOutcome) -> dict[str, Any]:
    return {
        "action": outcome.action.value,
        "dry_run": outcome.dry_run,
        "key": outcome.key,
        "route": outcome.route,
        "event_id": outcome.event_id,
        "parked": {
            "reason": outcome.reason,
            "error": outcome.error,
            "parked_at": iso(outcome.parked_at),
        },
        "head_state": outcome.head_state_after.value,
        "head_state_before": outcome.head_state.value,
        "attempts_before": outcome.attempts_before,
        "attempts": outcome.attempts_after,
        "last_error": outcome.last_error,
        "audit_id": outcome.audit_id,
    }
