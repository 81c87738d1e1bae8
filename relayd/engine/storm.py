"""The poison-storm guard: when the sink rejects most rows of one queue and job type as
invalid (400, 413, 422 in its own error format), the cause is almost never the rows. A
schema or validation change on the sink's side, or one producer's bad release, makes every
row of that kind look like poison, and dead-lettering them all would turn one mistake into
an operator's afternoon of redrives. So past a threshold relayd stops dead-lettering rows of
that queue and type: it pauses them (that queue and type only: every other one keeps
flowing), says so, and retries, refunded, what it was about to dead-letter.

The guard counts per (queue, type) and per process: each replica dead-letters at most
`window` rows of one queue and type before its own guard trips (docs/run.md).

While a tripped key's pause is not stored yet (or cannot be: a refused INSERT), the process
holds that key itself: its rows are not sent, and come back later without using an attempt.

Pure: the caller feeds each claim's outcomes with their keys, passes the loop time, and acts
on the verdicts.

The poison-storm guard as a relay process uses it: which rows it keeps from the sink,
which rejections it retries instead of dead-lettering, and storing its pauses (and those the
sink asks for: a webhook endpoint that answered 410 Gone).

`relayd/engine/storm.py` decides (pure); this module acts on the decisions: a trip is logged,
counted and paused (`Store.pause`, with its audit row) at once; a pause PostgreSQL refuses
leaves the queue and type held by this process alone until the `storm_pause` housekeeping
chore stores it (relayd/engine/chores.py).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from relayd.core.errors import DatabaseUnavailable, StatementError
from relayd.core.outcomes import DeadLetter, DeadReason, Held, NotStarted, Outcome
from relayd.engine.chores import Chore, Housekeeping
from relayd.store import Store
from relayd.telemetry.logs import get_logger
from relayd.telemetry.metrics import RelayMetrics

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


@dataclass
class StormHold:
    """One process's storm guard, with what it needs to act: the store, the metrics, the
    housekeeping that reports a refused pause, and the actor its pauses are audited as."""

    guard: StormGuard
    store: Store
    metrics: RelayMetrics
    housekeeping: Housekeeping
    actor: str  # relayd@<host>
    retry_after_s: float  # when a row kept from the sink is due again (retry.cap_s)
    _log: FilteringBoundLogger = field(default_factory=lambda: get_logger("relay"))

    def held(self, key: Key, claimed_at: float) -> Held | None:
        """The outcome of a row of `key` from a claim sent at `claimed_at` that must not be
        sent (its key's pause is not stored yet, or was stored after that claim was sent);
        None to send it. It comes back once the pause could have been stored (the claim then
        skips it) or lifted."""
        if not self.guard.trips or not self.guard.holds(key, claimed_at):
            return None
        queue, job_type = key
        return Held(
            f"poison storm: queue {queue}, type {job_type} held by relayd, not sent",
            retry_after_s=self.retry_after_s,
        )

    async def observe(
        self, outcomes: Mapping[str, Outcome], keys: Mapping[str, Key]
    ) -> tuple[set[str], set[Key]]:
        """Feed a claim's outcomes to the guard, pause what it trips on, and store the
        pauses the sink asked for. Returns the rows whose sink rejections are retried, not
        dead-lettered: those of a queue and type this process holds, and, if any other row
        was rejected, those of a queue and type paused in the database now (another
        replica's guard, or an operator, paused them while this claim was in flight:
        dead-lettering them would exceed the one window each replica may spend); and the
        pauses the sink asked for that are in force now (`_sink_pauses`)."""
        sink_paused = await self._sink_pauses(outcomes)
        settled, rejected_ids = settled_by_key(outcomes, keys)
        tripped = self.guard.record(settled, asyncio.get_running_loop().time())
        if tripped:
            await self._pause(tripped)
        trips = self.guard.trips
        held = {event_id for event_id, key in keys.items() if key in trips} if trips else set()
        rejected = [event_id for event_id in rejected_ids if event_id not in held]
        if not rejected:
            return held, sink_paused
        try:
            pauses = await self.store.pauses()
        except (DatabaseUnavailable, StatementError) as exc:
            # Without the pauses the process's own view decides; the settle that follows
            # meets the same database and handles it.
            self._log.warning("relay.pauses_unknown", error=str(exc))
            return held, sink_paused
        return held | {
            event_id
            for event_id in rejected
            if any(pause.holds(*keys[event_id]) for pause in pauses)
        }, sink_paused

    async def _sink_pauses(self, outcomes: Mapping[str, Outcome]) -> set[Key]:
        """Store each pause the sink asked for (a webhook endpoint's 410), once per claim,
        with its audit row, unless it is in force already (another claim, another replica
        or an operator stored it: one pause, one audit row); its rows were held, not
        dead-lettered. The pauses in force now, which hold those rows from here on. A pause
        PostgreSQL refuses is logged: the rows come back after their own delay, and the
        endpoint's next 410 asks again."""
        asked = {
            outcome.pause: outcome.error
            for outcome in outcomes.values()
            if isinstance(outcome, Held) and outcome.pause is not None
        }
        stored: set[Key] = set()
        for (queue, job_type), error in asked.items():
            reason = f"the sink asked for it: {error}"
            try:
                inserted = await self.store.pause_insert(queue, job_type, reason, self.actor)
            except (DatabaseUnavailable, StatementError) as exc:
                self._log.error(
                    "relay.sink_pause_failed", queue=queue, type=job_type, error=str(exc)
                )
                continue
            stored.add((queue, job_type))
            if inserted:
                self.metrics.sink_pauses.inc()
                self._log.error("relay.sink_paused", queue=queue, type=job_type, reason=reason)
        return stored

    async def store_pauses(self) -> None:
        """Store the pause of every queue and type the guard holds without one, each with its
        audit row: the `storm_pause` chore's step, and the first try after a trip.
        `StatementError` or `DatabaseUnavailable` stops at the first key that cannot be
        stored: the rest wait for the next turn."""
        loop = asyncio.get_running_loop()
        try:
            for key in self.guard.unstored():
                trip = self.guard.trips[key]
                reason = trip.reason(key)
                inserted = await self.store.pause_insert(key[0], key[1], reason, self.actor)
                self.guard.stored(key, loop.time())
                self._log.warning(
                    "relay.poison_storm_paused", queue=key[0], type=key[1], new=inserted
                )
        finally:
            self.metrics.storm_local_holds.set(len(self.guard.unstored()))

    async def _pause(self, tripped: Sequence[Key]) -> None:
        """Log and count each trip, and try to store their pauses at once, so that every
        replica stops claiming them; until a pause is stored this process holds that key
        itself (`held`)."""
        self.metrics.storm_trips.inc(len(tripped))
        for key in tripped:
            trip = self.guard.trips[key]
            self._log.error(
                "relay.poison_storm",
                queue=key[0],
                type=key[1],
                rejected=trip.rejected,
                settled=trip.settled,
            )
        try:
            stored = await self.housekeeping.run(Chore.STORM_PAUSE, self.store_pauses)
        except DatabaseUnavailable as exc:
            self.metrics.database_errors.inc()
            error, stored = str(exc), False
        else:
            failing = self.housekeeping.failing.get(Chore.STORM_PAUSE)
            error = "" if failing is None else failing.error
        if not stored:
            # The storm_pause chore tries again on its own schedule; meanwhile the rows of
            # these keys are not sent, and no sink rejection of them is dead-lettered.
            for queue, job_type in self.guard.unstored():
                self._log.error(
                    "relay.poison_storm_held_locally", queue=queue, type=job_type, error=error
                )
