"""How a claim ends: each row's attempt outcome turned into the (at most four) fenced UPDATEs
that record it, written shielded from cancellation, and told to the metrics and the log
(docs/contract.md#c3, #c5, #c6).

`plan()` is pure: no I/O, no clock, the backoff's random source injected. It chooses between
publishing, retrying, refunding, dead-lettering and releasing, and gives a `Plan` whose
groups hold rows, each with what its statement writes. A `Settler` runs one: first the
poison-storm guard's say on the sink's rejections (relayd/engine/storm.py), then each group's
fenced statement (retried while PostgreSQL is away, until the lease would have ended anyway,
after which another owner may hold the rows and the fence makes our write a no-op), then one
log event per settled row and the metrics. A row another owner held by then is only counted
(`stale`, C3).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ParamSpec

from structlog.typing import FilteringBoundLogger

from relayd.core.errors import DatabaseUnavailable
from relayd.core.outcomes import (
    DeadLetter,
    DeadReason,
    Held,
    NotStarted,
    Outcome,
    Published,
    Settled,
    SinkDown,
    clean_error,
)
from relayd.core.retry import Backoff
from relayd.core.rows import ClaimedRow
from relayd.engine.claim import Claim
from relayd.engine.storm import SINK_REJECTIONS, Key, StormHold
from relayd.store import Store
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.metrics import RelayMetrics

_P = ParamSpec("_P")


# Made for every settled row and never changed after: values by convention, not frozen (a
# frozen dataclass costs about four times as much to build).
@dataclass(slots=True)
class ToPublish:
    """For `Store.settle_published`: the sink accepted the row."""

    row: ClaimedRow
    answer: Published


@dataclass(slots=True)
class ToRetry:
    """For `Store.settle_retry`: due again after `delay_s`; `refund` gives the attempt back
    when the failure was the sink's, not the row's. `sent` is False when nothing of the
    attempt can have reached the sink (`SinkDown.reached` False): the row's previous attempt
    time is then restored, as a release restores it, so that the next claim does not take
    it for a row an earlier attempt may have delivered (a re-send, a reconciling GET)."""

    row: ClaimedRow
    delay_s: float
    error: str
    refund: bool
    sent: bool = True


@dataclass(slots=True)
class ToDeadLetter:
    """For `Store.settle_dead`: the row can never succeed, or used up its attempts."""

    row: ClaimedRow
    reason: DeadReason
    error: str


@dataclass(slots=True)
class Plan:
    """A claim's rows sorted by the fenced UPDATE that records them (at most five); the
    released rows were never sent, and are due at once for anyone, their attempt and
    previous attempt time restored (`Store.release`). The parked rows are heads of ordered
    keys that would have been dead-lettered, on a route that parks its keys instead
    (`Store.settle_parked`, docs/ordering.md)."""

    published: list[ToPublish] = field(default_factory=list)
    retried: list[ToRetry] = field(default_factory=list)
    dead: list[ToDeadLetter] = field(default_factory=list)
    released: list[ClaimedRow] = field(default_factory=list)
    parked: list[ToDeadLetter] = field(default_factory=list)


def plan(
    rows: Sequence[ClaimedRow],
    outcomes: Mapping[str, Outcome],
    *,
    max_attempts: int,
    backoff: Backoff,
    sink_wide: bool,
    storm_rows: Collection[str] = frozenset(),
    sink_paused: Collection[Key] = frozenset(),
    parking: Collection[str] = frozenset(),
) -> Plan:
    """Group each row by what its outcome asks for.

    `sink_wide` says the sink is failing for every row right now (the breaker is not
    closed) or the daemon is stopping: a `SinkDown` is then refunded, so an outage of any
    length, or our own shutdown, never uses up a row's attempts (C5). `storm_rows` are the
    rows of a queue and type the poison-storm guard holds: the sink's rejections of them are
    retried, refunded, instead of dead-lettered; a row the guard kept from being sent
    (`Held`) is retried refunded too. A row with no outcome was never sent and is released.
    `sink_paused` are the pauses the sink asked for that are in force now: a row held for
    one of them is due again at once, since the pause holds it from here on, and is then
    claimed as soon as an operator lifts the pause, on every replica, instead of after the
    delay that covers a pause that could not be stored. `parking` are the rows of ordered
    keys whose route parks: a dead letter of one of them parks its key instead.
    """
    groups = Plan()
    for row in rows:
        outcome = outcomes.get(row.event_id, NotStarted())
        if isinstance(outcome, Published):
            groups.published.append(ToPublish(row, outcome))
        elif (
            isinstance(outcome, DeadLetter)
            and outcome.reason in SINK_REJECTIONS
            and row.event_id in storm_rows
        ):
            error = clean_error(f"poison storm, not dead-lettered: {outcome.error}")
            groups.retried.append(ToRetry(row, backoff.delay_s(row.attempts), error, refund=True))
        elif isinstance(outcome, Held):
            error = clean_error(outcome.error)
            delay_s = 0.0 if outcome.pause in sink_paused else outcome.retry_after_s
            groups.retried.append(ToRetry(row, delay_s, error, refund=True))
        elif isinstance(outcome, DeadLetter):
            dead = ToDeadLetter(row, outcome.reason, clean_error(outcome.error))
            (groups.parked if row.event_id in parking else groups.dead).append(dead)
        elif isinstance(outcome, NotStarted):
            groups.released.append(row)
        else:
            error = clean_error(outcome.error)
            refund = isinstance(outcome, SinkDown) and refunded(outcome, sink_wide=sink_wide)
            if not refund and row.attempts >= max_attempts:
                dead = ToDeadLetter(row, DeadReason.MAX_ATTEMPTS, error)
                (groups.parked if row.event_id in parking else groups.dead).append(dead)
            else:
                delay_s = backoff.delay_s(row.attempts, outcome.retry_after_s)
                sent = not isinstance(outcome, SinkDown) or outcome.reached
                groups.retried.append(ToRetry(row, delay_s, error, refund=refund, sent=sent))
    return groups


def refunded(outcome: SinkDown, *, sink_wide: bool) -> bool:
    """Whether a sink failure gives the row its attempt back: the request never left, the
    credentials or the URL are wrong (every row fails alike), or the failure is sink-wide."""
    return not outcome.reached or outcome.severe or sink_wide


class Settler:
    """One worker's settles: a claim's outcomes planned, written and told."""

    def __init__(
        self,
        *,
        store: Store,
        database: DatabaseRetry,
        storm: StormHold,
        metrics: RelayMetrics,
        backoff: Backoff,
        max_attempts: int,
        log: FilteringBoundLogger,
    ) -> None:
        self._store = store
        self._database = database
        self._storm = storm
        self._metrics = metrics
        self._backoff = backoff
        self._max_attempts = max_attempts
        self._log = log
        self.released = 0  # rows handed back unstarted (drain, open breaker), in all

    async def settle(
        self,
        claim: Claim,
        outcomes: Mapping[str, Outcome],
        keys: Mapping[str, Key],
        *,
        sink_wide: bool,
        parking: Collection[str] = frozenset(),
    ) -> Plan:
        """Plan the claim's outcomes (the storm guard told first) and write the plan,
        shielded from cancellation; the plan, for the settle's span."""
        storm_rows, sink_paused = await self._storm.observe(outcomes, keys)
        groups = plan(
            claim.rows,
            outcomes,
            max_attempts=self._max_attempts,
            backoff=self._backoff,
            sink_wide=sink_wide,
            storm_rows=storm_rows,
            sink_paused=sink_paused,
            parking=parking,
        )
        await asyncio.shield(self.write(claim, groups))
        return groups

    async def write(self, claim: Claim, groups: Plan) -> None:
        """Run the plan's fenced statements, each committing on its own."""
        store, owner = self._store, claim.owner
        if groups.published:
            rows = groups.published
            updated = await self._fenced(
                claim,
                store.settle_published,
                owner,
                [p.row.event_id for p in rows],
                [p.answer.sink_state for p in rows],
            )
            self._published(rows, updated, since_claim_s=self._since(claim))
        if groups.retried:
            retries = groups.retried
            updated = await self._fenced(
                claim,
                store.settle_retry,
                owner,
                [r.row.event_id for r in retries],
                [r.delay_s for r in retries],
                [r.error for r in retries],
                [int(r.refund) for r in retries],
                [r.sent for r in retries],
                [r.row.previous_attempt_at for r in retries],
            )
            self._retried(retries, updated)
        if groups.dead:
            dead = groups.dead
            updated = await self._fenced(
                claim,
                store.settle_dead,
                owner,
                [d.row.event_id for d in dead],
                [d.reason.value for d in dead],
                [d.error for d in dead],
            )
            self._dead(dead, updated)
        if groups.parked:
            parked = groups.parked
            updated = await self._fenced(
                claim,
                store.settle_parked,
                owner,
                [d.row.event_id for d in parked],
                [d.reason.value for d in parked],
                [d.error for d in parked],
            )
            self._parked(parked, updated)
        if groups.released:
            rows_released = groups.released
            updated = await self._fenced(
                claim,
                store.release,
                owner,
                [row.event_id for row in rows_released],
                [row.previous_attempt_at for row in rows_released],
            )
            self.released += self._released(rows_released, updated)

    @staticmethod
    def _since(claim: Claim) -> float:
        """Seconds since the claim's answer: added to each row's age at the claim, its lag."""
        return asyncio.get_running_loop().time() - claim.answered_at

    async def _fenced(
        self,
        claim: Claim,
        statement: Callable[_P, Awaitable[set[str]]],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> set[str] | None:
        """Run one settle statement, retrying while PostgreSQL is away until the lease would
        have expired anyway; None if abandoned. Returns the ids this owner still held."""
        try:
            return await self._database.call(
                functools.partial(statement, *args, **kwargs),
                log=self._log.bind(statement=statement.__name__),
                event="relay.settle_delayed",
                until=claim.lease_ends,
            )
        except DatabaseUnavailable as exc:
            self._log.error(
                "relay.settle_abandoned",
                statement=statement.__name__,
                rows=len(claim.rows),
                error=str(exc),
            )
            return None

    # --- what each statement did, told: one event per settled row, and the metrics. A
    # statement that did not run (`updated` None: the database was lost) tells nothing.

    def _stale(self, kind: Settled, rows: int, updated: set[str]) -> None:
        """Rows another owner held by the time we settled are only counted (C3)."""
        stale = rows - len(updated)
        if stale:
            self._metrics.settled[Settled.STALE].inc(stale)
            self._log.warning(Settled.STALE.event, kind=kind.value, rows=rows, stale=stale)

    def _published(
        self, rows: Sequence[ToPublish], updated: set[str] | None, *, since_claim_s: float
    ) -> None:
        if updated is None:
            return
        self._stale(Settled.PUBLISHED, len(rows), updated)
        metrics = self._metrics
        lag = metrics.commit_to_publish
        reconciled = 0
        # Asked once per settle: at the usual levels no row's debug line is built at all.
        debug = self._log.is_enabled_for(logging.DEBUG)
        for published in rows:
            row, answer = published.row, published.answer
            if row.event_id not in updated:
                continue
            lag.observe(max(row.age_s + since_claim_s, 0.0))
            reconciled += answer.reconciled
            # A lost answer found again, or a unique policy's choice, is worth an info line.
            noted = answer.reconciled or answer.sink_job_id
            if noted or debug:
                settled = Settled.RECONCILED if answer.reconciled else Settled.PUBLISHED
                (self._log.info if noted else self._log.debug)(
                    settled.event,
                    event_id=row.event_id,
                    attempt=row.attempts,
                    sink_state=answer.sink_state,
                    sink_job_id=answer.sink_job_id,
                )
        metrics.settled[Settled.RECONCILED].inc(reconciled)
        metrics.settled[Settled.PUBLISHED].inc(len(updated) - reconciled)

    def _retried(self, rows: Sequence[ToRetry], updated: set[str] | None) -> None:
        if updated is None:
            return
        self._stale(Settled.RETRIED, len(rows), updated)
        self._metrics.settled[Settled.RETRIED].inc(len(updated))
        for retry in rows:
            if retry.row.event_id in updated:
                self._log.info(
                    Settled.RETRIED.event,
                    event_id=retry.row.event_id,
                    attempt=retry.row.attempts,
                    retry_in_s=round(retry.delay_s, 3),
                    refunded=retry.refund,
                    error=retry.error,
                )

    def _dead(self, rows: Sequence[ToDeadLetter], updated: set[str] | None) -> None:
        if updated is None:
            return
        self._stale(Settled.DEAD, len(rows), updated)
        metrics = self._metrics
        metrics.settled[Settled.DEAD].inc(len(updated))
        for dead in rows:
            if dead.row.event_id in updated:
                metrics.dead_by_reason[dead.reason.value].inc()
                self._log.warning(
                    Settled.DEAD.event,
                    event_id=dead.row.event_id,
                    attempt=dead.row.attempts,
                    reason=dead.reason.value,
                    error=dead.error,
                )

    def _parked(self, rows: Sequence[ToDeadLetter], updated: set[str] | None) -> None:
        if updated is None:
            return
        self._stale(Settled.PARKED, len(rows), updated)
        self._metrics.settled[Settled.PARKED].inc(len(updated))
        for parked in rows:
            if parked.row.event_id in updated:
                self._log.warning(
                    Settled.PARKED.event,
                    event_id=parked.row.event_id,
                    key=parked.row.ordering_key,
                    attempt=parked.row.attempts,
                    reason=parked.reason.value,
                    error=parked.error,
                )

    def _released(self, rows: Sequence[ClaimedRow], updated: set[str] | None) -> int:
        """The rows handed back unstarted (0 if the statement did not run)."""
        if updated is None:
            return 0
        self._stale(Settled.RELEASED, len(rows), updated)
        self._metrics.settled[Settled.RELEASED].inc(len(updated))
        self._log.debug(Settled.RELEASED.event, rows=len(updated))
        return len(updated)
