"""Values of the operator surface (`relayd dlq`, `relayd held`, `relayd pause`, `relayd
resume`) that cross between the commands (relayd/operator/) and the store: which dead letters
(or held rows) to act on, what a batch did to each row, the audit entry it wrote, and the
pauses. Nothing here does I/O; how each value is printed, in JSON or for people, is the
commands' (the store imports this module, so it sits below both).
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
