"""The poison-storm guard: when the sink rejects most rows of one queue and job type as
invalid (400, 413, 422 in its own error format), the cause is almost never the rows. A
schema or validation change on the sink's side, or one producer's bad release, makes every
row of that kind look like poison, and dead-lettering them all would turn one mistake into
an operator's afternoon of redrives. So past a threshold relayd stops dead-lettering rows of
that queue and type: it pauses them (that queue and type only: every other one keeps
flowing), says so, and retries, refunded, what it was about to dead-letter.

The guard counts per (queue, type) and per process: each replica dead-letters at most
`window` rows of one queue and type before its own guard trips (docs/operations.md).

While a tripped key's pause is not stored yet (or cannot be: a refused INSERT), the process
holds that key itself: its rows are not sent, and come back later without using an attempt.

Pure: the caller feeds each claim's outcomes with their keys, passes the loop time, and acts
on the verdicts.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relayd.models import DeadLetter, DeadReason, NotStarted, Outcome

# The sink's verdicts that say "this row is invalid": the ones a misconfigured sink gives for
# every row. Our own checks (invalid_envelope, too_large) and a conflict are not its verdicts.
SINK_REJECTIONS = frozenset(
    {DeadReason.SINK_REJECTED, DeadReason.SINK_TOO_LARGE, DeadReason.SINK_UNPROCESSABLE}
)

# (queue, type): the effective queue and the job type of a row, what a storm pause holds.
Key = tuple[str, str]

# The keys whose recent outcomes are remembered: a producer inventing types cannot make the
# guard's memory grow without bound (the least recently seen key is forgotten first).
MAX_KEYS = 1024


def sink_rejected(outcome: Outcome) -> bool:
    return isinstance(outcome, DeadLetter) and outcome.reason in SINK_REJECTIONS


def settled_by_key(
    outcomes: Mapping[str, Outcome], keys: Mapping[str, Key]
) -> tuple[dict[Key, list[bool]], list[str]]:
    """A claim's outcomes as the guard counts them: per key, whether each settled row was
    rejected by the sink (rows released unstarted were not settled; rows without a key, whose
    envelope did not parse, are not the sink's to reject), and the ids of the rejected rows."""
    settled: dict[Key, list[bool]] = {}
    rejected: list[str] = []
    for event_id, outcome in outcomes.items():
        key = keys.get(event_id)
        if key is None or isinstance(outcome, NotStarted):
            continue
        refused = sink_rejected(outcome)
        settled.setdefault(key, []).append(refused)
        if refused:
            rejected.append(event_id)
    return settled, rejected


@dataclass(slots=True)
class Trip:
    """A key the guard tripped on: `rejected` of the last `settled` rows were rejected."""

    rejected: int
    settled: int
    at: float  # loop time
    stored_at: float | None = None  # loop time its pause was committed; None: held locally

    def reason(self, key: Key) -> str:
        queue, job_type = key
        return (
            f"poison storm: the sink rejected {self.rejected} of the last {self.settled} rows "
            f"of queue {queue}, type {job_type}"
        )


class StormGuard:
    """Trips a (queue, type) when more than `threshold` of its last `window` settled rows
    were rejected by the sink; the trip lasts until a claim sent after its pause was stored
    returns rows of that key again (an operator resumed), or the process ends."""

    def __init__(self, *, threshold: float, window: int, max_keys: int = MAX_KEYS) -> None:
        self._threshold = threshold
        self._window = window
        self._max_keys = max_keys
        self._recent: OrderedDict[Key, deque[bool]] = OrderedDict()
        self.trips: dict[Key, Trip] = {}

    def record(self, settled: Mapping[Key, Sequence[bool]], now: float) -> list[Key]:
        """Record a claim's settled rows, grouped by key (`settled_by_key`); the keys this
        trips (each once per storm). A claim holds few keys: the guard's memory is touched
        once per key, not once per row."""
        tripped: list[Key] = []
        for key in sorted(settled):
            if key in self.trips:
                continue
            recent = self._recent.get(key)
            if recent is None:
                recent = self._recent[key] = deque(maxlen=self._window)
                if len(self._recent) > self._max_keys:
                    self._recent.popitem(last=False)
            else:
                self._recent.move_to_end(key)
            recent.extend(settled[key])
            if len(recent) < self._window:
                continue
            rejected = sum(recent)
            if rejected > self._threshold * len(recent):
                self.trips[key] = Trip(rejected, len(recent), now)
                del self._recent[key]
                tripped.append(key)
        return tripped

    def holds(self, key: Key, claimed_at: float) -> bool:
        """Whether rows of `key` from a claim sent at `claimed_at` (loop time) must not be
        sent. A trip whose pause was stored before that claim was sent is over: the claim
        skips paused rows, so rows of that key mean an operator lifted the pause."""
        trip = self.trips.get(key)
        if trip is None:
            return False
        if trip.stored_at is not None and claimed_at > trip.stored_at:
            del self.trips[key]  # a fresh window from now on
            return False
        return True

    def unstored(self) -> list[Key]:
        """The tripped keys whose pause is not stored yet: held by this process alone."""
        return sorted(key for key, trip in self.trips.items() if trip.stored_at is None)

    def stored(self, key: Key, now: float) -> None:
        """The pause of `key` is committed (at loop time `now`, or earlier)."""
        trip = self.trips.get(key)
        if trip is not None and trip.stored_at is None:
            trip.stored_at = now
