"""Values of the operator surface (`relayd dlq`, `relayd held`, `relayd pause`, `relayd
resume`, `relayd keys`) that cross between the commands (relayd/operator/) and the store:
which dead letters (or held rows) to act on, what a batch did to each row, the audit entry it
wrote, the pauses and the parked keys. Nothing here does I/O; how each value is printed, in
JSON or for people, is the commands' (the store imports this module, so it sits below both).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# The queue (relayd_pauses.queue) or type (relayd_pauses.type) of a pause that holds every
# queue, or every type.
EVERY_QUEUE = "*"
EVERY_TYPE = "*"


class DlqAction(enum.StrEnum):
    """A mutating operator action on rows; its value is the audit trail's `action`."""

    REDRIVE = "dlq.retry"
    DISCARD = "dlq.discard"
    DISCARD_HELD = "held.discard"  # pending rows held by a pause, discarded from there


class PauseAction(enum.StrEnum):
    PAUSE = "pause"
    RESUME = "resume"


class KeyAction(enum.StrEnum):
    """An operator's action on a parked key (`relayd keys`); its value is the audit trail's
    `action`."""

    RETRY = "keys.retry"  # the head gets its attempts back; the key goes on from it
    SKIP = "keys.skip"  # the head is dead-lettered; the key goes on from its next row
    RELEASE = "keys.release"  # un-parked only: the head keeps its attempts


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which dead letters: each set field narrows the selection (all unset: every one).

    `since` and `until` bound `dead_at` (`since <= dead_at < until`), already resolved to
    absolute times on the database's clock.
    """

    queue: str | None = None  # the effective queue: options.queue, else queue, else default
    type: str | None = None
    dead_reason: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    error_contains: str | None = None  # a substring of last_error, case-insensitive

    def matching(self) -> tuple[object, ...]:
        """The parameters of the dead_letter_filters fragment (sql/dead_letters.sql), in its
        order (from $5 on). The time bounds are each statement's own (a range, or a walk's
        cursor and end)."""
        return (self.queue, self.type, self.dead_reason, self.error_contains)


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    """One outbox row as the dead-letter commands show it (`dlq list`, `dlq show`)."""

    event_id: str
    created_at: datetime
    published_at: datetime | None
    dead_at: datetime | None
    dead_reason: str | None
    queue: str | None
    type: str | None
    attempts: int
    last_error: str | None
    last_attempt_at: datetime | None
    discarded_at: datetime | None
    discard_reason: str | None
    job: str | None = None  # the envelope's text; read by `dlq show` only

    @property
    def state(self) -> str:
        if self.published_at is not None:
            return "published"
        if self.dead_at is None:
            return "pending"
        return "discarded" if self.discarded_at is not None else "dead"


@dataclass(frozen=True, slots=True)
class DeadLetterPage:
    """One batch of a bulk walk: the next `limit` entries of the dead-letter index (dead and
    not discarded) in `(dead_at, event_id)` order after the keyset cursor `after` (None:
    from `filters.since`), of which the batch acts on those `filters` select, dead-lettered
    before `until`."""

    filters: DeadLetterFilter
    until: datetime  # the walk's end: --until, never past the command's start
    limit: int
    after: tuple[datetime, str] | None = None


class RowOutcome(enum.StrEnum):
    """What an action did, or would do, to one row."""

    REDRIVEN = "redriven"
    DISCARDED = "discarded"
    REFUSED = "refused"  # the table's checks would refuse it as a pending row
    ALREADY_DISCARDED = "already_discarded"
    NOT_DEAD = "not_dead"  # pending or published: not a dead letter
    NOT_HELD = "not_held"  # published, dead, or pending in no paused queue and type
    # An ordered row whose key moved on: later rows of its key were delivered (dlq retry
    # without --out-of-order).
    OUT_OF_ORDER = "out_of_order"
    IN_FLIGHT = "in_flight"  # held, but its attempt (claimed before the pause) still runs
    NOT_FOUND = "not_found"

    @property
    def changed(self) -> bool:
        return self in {RowOutcome.REDRIVEN, RowOutcome.DISCARDED}


@dataclass(frozen=True, slots=True)
class RowResult:
    event_id: str
    outcome: RowOutcome
    detail: str | None = None  # why it was skipped


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One operator action for `relayd_audit`; `event_ids` are kept while they number at
    most `AUDIT_MAX_IDS` (explicitly listed ids are always kept)."""

    actor: str
    action: str
    filters: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    keep_all_ids: bool = False


# How many ids an audit row lists for a bulk action before it records only the count.
AUDIT_MAX_IDS = 100


@dataclass(frozen=True, slots=True)
class DeadLetterBatch:
    """What one batch (one short transaction) did."""

    results: list[RowResult]  # one per row selected (or named)
    examined: int  # index entries the page read, or ids named (a full page: more may follow)
    next_after: tuple[datetime, str] | None  # the keyset cursor after this page
    audit_id: int | None  # the action's audit row, once a batch changed something


def describe_pause(queue: str, job_type: str) -> str:
    """What a pause holds, in words: `every queue`, `queue orders`, `type mail.send in every
    queue`, `queue orders, type order.fulfill`."""
    if job_type == EVERY_TYPE:
        return "every queue" if queue == EVERY_QUEUE else f"queue {queue}"
    if queue == EVERY_QUEUE:
        return f"type {job_type} in every queue"
    return f"queue {queue}, type {job_type}"


@dataclass(frozen=True, slots=True)
class Pause:
    """A row of relayd_pauses: `queue` and `type` held (`'*'`: every one)."""

    queue: str
    type: str
    reason: str
    paused_by: str
    paused_at: datetime

    def describe(self) -> str:
        return describe_pause(self.queue, self.type)

    def holds(self, queue: str, job_type: str) -> bool:
        """Whether this pause holds rows of `queue` and `job_type`."""
        return self.queue in (EVERY_QUEUE, queue) and self.type in (EVERY_TYPE, job_type)


@dataclass(frozen=True, slots=True)
class HeldFilter:
    """Which held rows: each set field narrows the selection (all unset: every one)."""

    queue: str | None = None
    type: str | None = None
    error_contains: str | None = None


@dataclass(frozen=True, slots=True)
class HeldRow:
    """A pending row a pause holds, as `relayd held list` shows it."""

    event_id: str
    created_at: datetime
    available_at: datetime
    queue: str | None
    type: str | None
    attempts: int
    last_error: str | None
    last_attempt_at: datetime | None
    in_flight: bool


@dataclass(frozen=True, slots=True)
class HeldPage:
    """One batch of `relayd held discard --all`: the next `limit` held rows that `filters`
    select after the keyset cursor `after` ((available_at, event_id) in claim order; None:
    from the start)."""

    filters: HeldFilter
    limit: int
    after: tuple[datetime, str] | None = None


@dataclass(frozen=True, slots=True)
class QueueUse:
    """Whether any row of the outbox, in any state, routes to a queue, as far as it was read:
    when none does, `rows_read` rows were read (every row, unless it reached the bound)."""

    used: bool
    rows_read: int


@dataclass(frozen=True, slots=True)
class OutOfOrder:
    """A dead letter of an ordered key that later rows of the key overtook: redriving it
    would deliver it after them."""

    event_id: str
    key: str
    delivered_after: int  # rows of its key, numbered after it, published

    def describe(self) -> str:
        """Why it is refused, in words."""
        n = self.delivered_after
        rows = "1 later row of its key was" if n == 1 else f"{n} later rows of its key were"
        return (
            f"out of order: {rows} delivered (key {self.key!r}); "
            "--out-of-order redrives it all the same"
        )


class HeadState(enum.StrEnum):
    """Where the row that parked a key is now."""

    PENDING = "pending"  # as parking left it: waiting for an operator
    DEAD = "dead"  # dead-lettered since (a pause's rows discarded, say)
    PUBLISHED = "published"
    MISSING = "missing"  # no such row any more


@dataclass(frozen=True, slots=True)
class ParkedKey:
    """A row of relayd_parked_keys, with the row that parked it (the key's head when it
    parked) and how many of the key's rows wait behind it."""

    key: str
    route: str  # the head's event type: the route that parks
    event_id: str  # the head that parked the key
    reason: str  # a dead reason: max_attempts, sink_rejected, ...
    error: str | None
    parked_at: datetime
    parked_age_s: float
    head_state: HeadState
    attempts: int | None  # the head's (None: no such row)
    last_attempt_at: datetime | None
    waiting: int  # the key's other pending rows, counted up to `waiting_bound`
    waiting_bound: int

    @property
    def waiting_capped(self) -> bool:
        """More rows wait than were counted."""
        return self.waiting > self.waiting_bound


@dataclass(frozen=True, slots=True)
class KeyOutcome:
    """What an action on a parked key did (or, dry, would do): the park it lifted and the
    head's attempts before and after."""

    action: KeyAction
    key: str
    route: str
    event_id: str
    reason: str
    error: str | None
    parked_at: datetime
    head_state: HeadState  # before the action
    attempts_before: int | None
    attempts_after: int | None
    last_error: str | None  # the head's, after the action
    dry_run: bool
    audit_id: int | None

    @property
    def head_state_after(self) -> HeadState:
        """Where the head is once the action is committed."""
        if self.action is KeyAction.SKIP and self.head_state is HeadState.PENDING:
            return HeadState.DEAD
        return self.head_state


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One outbox row, whatever its state, as an event's timeline shows it (`relayd
    console`): its times, attempts, last error, key and envelope."""

    event_id: str
    created_at: datetime
    available_at: datetime
    published_at: datetime | None
    dead_at: datetime | None
    dead_reason: str | None
    queue: str | None
    type: str | None
    attempts: int
    last_error: str | None
    last_attempt_at: datetime | None
    redriven_at: datetime | None
    discarded_at: datetime | None
    discard_reason: str | None
    leased: bool
    ordering_key: str | None
    ordering_seq: int | None
    parks_its_key: bool
    job: str
    read_at: datetime  # the database's clock when it was read

    @property
    def state(self) -> str:
        if self.published_at is not None:
            return "published"
        if self.dead_at is not None:
            return "discarded" if self.discarded_at is not None else "dead"
        if self.parks_its_key:
            return "parked"
        return "leased" if self.leased else "pending"


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One row of the audit trail (relayd_audit) as the console shows it."""

    id: int
    at: datetime
    actor: str
    action: str
    filters: dict[str, Any]
    row_count: int
    reason: str | None
