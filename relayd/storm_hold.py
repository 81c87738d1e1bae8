"""The poison-storm guard as a relay process uses it: which rows it keeps from the sink,
which rejections it retries instead of dead-lettering, and storing its pauses (and those the
sink asks for: a webhook endpoint that answered 410 Gone).

`relayd/storm.py` decides (pure); this module acts on the decisions: a trip is logged,
counted and paused (`Store.pause`, with its audit row) at once; a pause PostgreSQL refuses
leaves the queue and type held by this process alone until the `storm_pause` housekeeping
chore stores it (relayd/housekeeping.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from relayd.errors import DatabaseUnavailable, StatementError
from relayd.housekeeping import Chore, Housekeeping
from relayd.logs import get_logger
from relayd.metrics import RelayMetrics
from relayd.models import Held, Outcome
from relayd.store import Store
from relayd.storm import Key, StormGuard, settled_by_key


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

    async def observe(self, outcomes: Mapping[str, Outcome], keys: Mapping[str, Key]) -> set[str]:
        """Feed a claim's outcomes to the guard, pause what it trips on, and return the rows
        whose sink rejections are retried, not dead-lettered: those of a queue and type this
        process holds, and, if any other row was rejected, those of a queue and type paused in
        the database now (another replica's guard, or an operator, paused them while this
        claim was in flight: dead-lettering them would exceed the one window each replica
        may spend)."""
        await self._sink_pauses(outcomes)
        settled, rejected_ids = settled_by_key(outcomes, keys)
        tripped = self.guard.record(settled, asyncio.get_running_loop().time())
        if tripped:
            await self._pause(tripped)
        trips = self.guard.trips
        held = {event_id for event_id, key in keys.items() if key in trips} if trips else set()
        rejected = [event_id for event_id in rejected_ids if event_id not in held]
        if not rejected:
            return held
        try:
            pauses = await self.store.pauses()
        except (DatabaseUnavailable, StatementError) as exc:
            # Without the pauses the process's own view decides; the settle that follows
            # meets the same database and handles it.
            self._log.warning("relay.pauses_unknown", error=str(exc))
            return held
        return held | {
            event_id
            for event_id in rejected
            if any(pause.holds(*keys[event_id]) for pause in pauses)
        }

    async def _sink_pauses(self, outcomes: Mapping[str, Outcome]) -> None:
        """Store each pause the sink asked for (a webhook endpoint's 410), once per claim,
        with its audit row; its rows were held, not dead-lettered. A pause PostgreSQL refuses
        is logged: the sink holds its endpoint meanwhile and asks again on its next 410."""
        asked = {
            outcome.pause: outcome.error
            for outcome in outcomes.values()
            if isinstance(outcome, Held) and outcome.pause is not None
        }
        for (queue, job_type), error in asked.items():
            reason = f"the sink asked for it: {error}"
            try:
                inserted = await self.store.pause(queue, job_type, reason, self.actor)
            except (DatabaseUnavailable, StatementError) as exc:
                self._log.error(
                    "relay.sink_pause_failed", queue=queue, type=job_type, error=str(exc)
                )
                continue
            self.metrics.sink_pauses.inc()
            self._log.error(
                "relay.sink_paused", queue=queue, type=job_type, reason=reason, new=inserted
            )

    async def store_pauses(self) -> None:
        """Store the pause of every queue and type the guard holds without one, each with its
        audit row: the `storm_pause` chore's step, and the first try after a trip.
        `StatementError` or `DatabaseUnavailable` stops at the first key that cannot be
        stored: the rest wait for the next turn."""
        loop = asyncio.get_running_loop()
        try:
            for key in self.guard.unstored():
                trip = self.guard.trips[key]
                inserted = await self.store.pause(key[0], key[1], trip.reason(key), self.actor)
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
