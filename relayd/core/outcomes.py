"""What became of one publish attempt, as values: produced once, at the sink boundary
(`relayd/sinks/`), consumed by the engine, which turns them into settle groups
(`relayd/engine/settle.py`); why a row was dead-lettered; and how each claimed row was
recorded. Nothing here does I/O.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class DeadReason(enum.StrEnum):
    """Why a row was dead-lettered (the `dead_reason` column; a bounded metric label)."""

    INVALID_ENVELOPE = "invalid_envelope"
    TOO_LARGE = "too_large"
    SINK_REJECTED = "sink_rejected"  # 400 invalid_request
    SINK_TOO_LARGE = "sink_too_large"  # 413
    SINK_UNPROCESSABLE = "sink_unprocessable"  # 422 validation_error / unsupported
    CONFLICT = "conflict"  # the id holds a different job on the sink (C2)
    NO_ROUTE = "no_route"  # the sink has no destination for the event's type (NATS routes)
    # A re-send could store the event twice: an earlier attempt may have stored it, and the
    # sink's dedupe has forgotten its id since (NATS, sink.past_window = "dead_letter").
    PAST_WINDOW = "past_window"
    MAX_ATTEMPTS = "max_attempts"
    # Set by an operator, never by the relay: a row held by a pause, discarded from there
    # (`relayd held discard`). Such a row is marked discarded at once.
    HELD_DISCARDED = "held_discarded"


@dataclass(frozen=True, slots=True)
class Published:
    """The sink holds this exact envelope."""

    sink_state: str
    reconciled: bool = False  # proven by a GET, not by a 2xx to our POST
    sink_job_id: str | None = None  # a unique policy kept another job instead (200)


@dataclass(frozen=True, slots=True)
class RetryLater:
    """A failure of this row that may pass (a paused queue, an odd answer); costs an attempt."""

    error: str
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class SinkDown:
    """A failure of the sink, not the row: feeds the circuit breaker (C5).

    `reached` is False when the request certainly never reached the server (connection
    refused), `severe` when every request will fail until an operator acts (401/403, a wrong
    base URL): the breaker opens at once.
    """

    error: str
    reached: bool = True
    severe: bool = False
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """This row can never succeed."""

    reason: DeadReason
    error: str


@dataclass(frozen=True, slots=True)
class NotStarted:
    """The attempt never began (stop or open breaker): release the claim."""


@dataclass(frozen=True, slots=True)
class Held:
    """Not sent, or not accepted for a reason that is not the row's: the poison-storm guard
    holds the row's queue and type (relayd/engine/storm.py), or the sink's endpoint asks to be left
    alone (a webhook receiver's 429 or 410). Due again after `retry_after_s`, without using
    an attempt. `pause`, when set, is the (queue, type) the sink asks to pause, `'*'` for
    every one (a webhook endpoint that answered 410 Gone): stored and audited with `error`
    as its reason."""

    error: str
    retry_after_s: float
    pause: tuple[str, str] | None = None


Outcome = Published | RetryLater | SinkDown | DeadLetter | NotStarted | Held


@dataclass(frozen=True, slots=True)
class NotFound:
    """Reconciliation found nothing under the row's id: the sink never stored it, or
    purged it since; sending it (again) is safe."""


def timed_out(elapsed_s: float) -> SinkDown:
    """The attempt's deadline passed mid-exchange: the sink may have stored the job."""
    return SinkDown(f"no answer within the attempt deadline ({elapsed_s:.1f}s)")


# Characters that break a line or a terminal when stored text is shown: C0 and C1 controls,
# DEL, and Unicode's line and paragraph separators.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_ERROR_BYTES = 512


def clean_error(text: str) -> str:
    """`last_error` text: control characters stripped, at most 512 UTF-8 bytes."""
    text = CONTROL_CHARS.sub(" ", text)
    data = text.encode()
    if len(data) <= MAX_ERROR_BYTES:
        return text
    return data[: MAX_ERROR_BYTES - 3].decode(errors="ignore") + "..."


class Settled(enum.StrEnum):
    """How a claimed row's attempt was recorded: the `outcome` label of
    `relayd_outcomes_total`, and (through `event`) the name of its log event."""

    PUBLISHED = "published"
    RECONCILED = "reconciled"  # published, proven by a GET rather than a 2xx to our POST
    RETRIED = "retried"
    DEAD = "dead"
    PARKED = "parked"  # an ordered key's head that can never be delivered: its key waits
    RELEASED = "released"  # handed back unstarted, attempt refunded
    STALE = "stale"  # the settle found another owner's lease: nothing changed (C3)

    @property
    def event(self) -> str:
        return _EVENTS[self]


_EVENTS = {
    Settled.PUBLISHED: "relay.published",
    Settled.RECONCILED: "relay.reconciled",
    Settled.RETRIED: "relay.retry_scheduled",
    Settled.DEAD: "relay.dead_lettered",
    Settled.PARKED: "relay.key_parked",
    Settled.RELEASED: "relay.released",
    Settled.STALE: "relay.stale_settle",
}
