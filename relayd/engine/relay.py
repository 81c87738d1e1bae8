"""The relay worker loop: claim -> publish -> settle (the breaker gate the workers share is
in `breaker.py`).

No SQL text and no wire detail live here: `store/` runs the statements, a sink
(`relayd/sinks/`) speaks its protocol and classifies answers. Each step is its own awaitable
method, so a failpoint or a test can stand between any two.

Invariants (docs/contract.md):
- a claim commits before any request to the sink; each attempt runs under one deadline and ends a
  timeout's worth before the lease does, leaving that long to settle (C4);
- every settle is fenced by the claim's owner token; a zero-row settle is counted as stale,
  never raised (C3);
- sink-wide failures refund the attempt while the breaker is not closed, so an outage of any
  length does not exhaust a row's budget (C5);
- a row that can never succeed is dead-lettered alone, its neighbours keep going (C6).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ParamSpec

from relayd.core.envelope import Envelope, InvalidEnvelope, too_large
from relayd.core.errors import DatabaseUnavailable, StatementError, WorkerCrashed
from relayd.core.outcomes import (
    DeadLetter,
    DeadReason,
    NotStarted,
    Outcome,
    Published,
    RetryLater,
    Settled,
    SinkDown,
    timed_out,
)
from relayd.core.retry import Backoff, BreakerState, Permit
from relayd.core.rows import ClaimedRow
from relayd.core.wakeup import WorkSignal
from relayd.engine.breaker import BreakerGate
from relayd.engine.claim import Claim, owner_token
from relayd.engine.deadline import AttemptDeadlines
from relayd.engine.settle import Plan, Settler
from relayd.engine.storm import Key, StormHold
from relayd.engine.watermark import Watermark
from relayd.sinks import UNORDERED, OrderPolicy, Sink
from relayd.store import Store
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.logs import get_logger
from relayd.telemetry.metrics import RelayMetrics
from relayd.telemetry.tracing import RelayTracing, Sent

# An idle worker never sleeps less than this, even when a row is due "now" but was locked by
# another claimer at the instant we looked. Each claim that comes back empty, with no
# notification of new rows since the last, doubles it, up to the poll interval: rows another
# session keeps locked (an operator's open transaction, a long UPDATE) are retried at the
# poll rate, not spun on. A notification resets it: under a steady load a worker often finds
# the rows it was woken for taken by another, and must not lag behind for it.
_MIN_IDLE_S = 0.01
_P = ParamSpec("_P")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What a worker reads of the configuration, and nothing else."""

    batch_size: int  # relay.batch_size
    lease_s: float  # relay.lease_s
    poll_interval_s: float  # relay.poll_interval_s
    full_scan_interval_s: float  # relay.full_scan_interval_s
    attempt_timeout_s: float  # sink.timeout_s
    concurrency: int  # sink.concurrency
    max_envelope_bytes: int  # sink.max_envelope_bytes
    max_attempts: int  # retry.max_attempts


@dataclass(frozen=True)
class RelayContext:
    """What the workers of one process share."""

    settings: WorkerSettings
    store: Store
    sink: Sink
    gate: BreakerGate
    wakeup: WorkSignal
    stopping: asyncio.Event
    metrics: RelayMetrics
    backoff: Backoff
    database: DatabaseRetry
    storm: StormHold
    slots: asyncio.Semaphore
    # Called when a worker finds nothing to claim and nothing it may claim is pending (not
    # even in backoff or leased; paused rows do not count): the run-until-idle mode stops
    # the daemon there.
    on_idle: Callable[[], None] | None = None
    # Spans for claim, publish and settle (relayd/telemetry/tracing.py); None: none, at no cost.
    tracing: RelayTracing | None = None
    # The first bytes of every owner token: this process's proof of life, if it holds one.
    holder: bytes | None = None
    # How the route of an envelope orders its rows (None: a row whose envelope could not be
    # read); `SinkSettings.order_policy`.
    order: Callable[[Envelope | None], OrderPolicy] = lambda _envelope: UNORDERED


_NO_KEY = (
    'its route is ordered (ordering = "key") and the row has no ordering key: append it '
    "with key=..., or set ordering_key in SQL (docs/ordering.md)"
)


class RelayWorker:
    """One claim -> publish -> settle loop."""

    def __init__(self, ctx: RelayContext, name: str) -> None:
        self._ctx = ctx
        self.name = name
        self._log = get_logger("relay").bind(worker=name)
        self._settings = ctx.settings
        self._settler = Settler(
            store=ctx.store,
            database=ctx.database,
            storm=ctx.storm,
            metrics=ctx.metrics,
            backoff=ctx.backoff,
            max_attempts=ctx.settings.max_attempts,
            log=self._log,
        )
        self._grace_ends = math.inf  # set by the drain: no attempt runs past it
        self._watermark = Watermark(full_scan_every_s=self._settings.full_scan_interval_s)
        self._deadlines: set[AttemptDeadlines] = set()  # one per runner of the claim
        self.in_flight = 0  # rows claimed and not yet settled
        self._empty_claims = 0  # consecutive claims that came back with no row
        self._walk_from: str | None = None  # where the next claim's walk over keys starts
        self.parking: set[str] = set()  # the claim's rows whose key parks if they fail for good
        # When the first pending row the last claim left is due (loop time; None: none), if
        # nothing since made it unknown: `wait_for_work` then sleeps without asking.
        self._due: float | None = None
        self._due_known = False
        # Whether the next claim takes the heads of ordered keys too (`claim_ordered`): while
        # the last claim saw no row of a key pending, the unordered claim does, for less.
        self._ordered = True

    @property
    def released(self) -> int:
        """Rows handed back unstarted (drain, open breaker)."""
        return self._settler.released

    async def run(self) -> None:
        """Loop until the process stops; returns after settling what it holds. A cycle that
        fails for want of PostgreSQL is waited out by the outage policy, then the next
        begins."""

        async def turn() -> None:
            permit = await self._ctx.gate.acquire()
            if permit is None:
                return  # stopping
            if not await self.cycle(permit):
                await self.wait_for_work()

        await self._ctx.database.repeat(
            turn, log=self._log, event="relay.database_unavailable", stopping=self._ctx.stopping
        )

    async def cycle(self, permit: Permit) -> bool:
        """One claim -> publish -> settle; True if more rows may be due now: the claim came
        back full. A claim that came back short took every row due when it ran (bar those
        other claims held), so the worker waits for the next notification or due row
        instead of claiming again at once (an empty claim per cycle under a steady load).

        `DatabaseUnavailable` (the connection's problem) propagates for `run` to retry; any
        other failure is relayd's own and becomes `WorkerCrashed`, naming the step, the
        statement if there was one, and the rows this worker held.
        """
        step, held = "claim", []
        try:
            limit = 1 if permit is Permit.PROBE else self._settings.batch_size
            ordered = self._ordered
            claim = await self.claim(limit)
            # An unordered claim that saw rows of keys pending: claim their heads at once.
            keys_appeared = not ordered and self._ordered
            if not claim.rows:
                self._empty_claims += 1
                if permit is Permit.PROBE:
                    # Nothing to probe with: the sink's health request tells instead.
                    step = "probe"
                    await self._ctx.gate.ask_sink(self._ctx.sink, self._settings.attempt_timeout_s)
                return keys_appeared
            self._empty_claims = 0
            full = len(claim.rows) == limit
            if full:
                self._ctx.wakeup.notify()  # more may be due: another idle worker joins in
            held = [row.event_id for row in claim.rows]
            step = "publish"
            outcomes, keys = await self.publish(claim)
            step = "settle"
            self._due_known = False  # until the settle says it added no due row
            groups = await self.settle(claim, outcomes, keys)
            self._due_known = not groups.retried and not groups.released
            # A key whose head was published or dead-lettered has a new head, which waits at
            # 'infinity' where no due time can wake a worker: claim again at once.
            return (
                full
                or keys_appeared
                or any(done.row.ordering_key is not None for done in groups.published)
                or any(done.row.ordering_key is not None for done in groups.dead)
            )
        except (DatabaseUnavailable, WorkerCrashed):
            raise
        except Exception as exc:
            statement = exc.statement if isinstance(exc, StatementError) else None
            raise WorkerCrashed(step, held, statement) from exc
        finally:
            if permit is Permit.PROBE:
                # Verdict or not (no row, only invalid rows), the probe is over: another
                # worker may probe next, so an idle probe never wedges the gate.
                self._ctx.gate.end_probe()

    def cut_deadline(self, when: float) -> None:
        """Bring in-flight attempts' deadline forward to `when` (loop time): drain grace."""
        self._grace_ends = min(self._grace_ends, when)
        for deadlines in self._deadlines:
            current = deadlines.when()
            if current is not None and current > when:
                deadlines.reschedule(when)

    # --- claim ---------------------------------------------------------------------------

    async def claim(self, limit: int) -> Claim:
        """Lease up to `limit` due rows to a fresh owner token (one autocommitted statement)."""
        owner = owner_token(self._ctx.holder)
        loop = asyncio.get_running_loop()
        sent_at, timer = loop.time(), time.perf_counter()  # the loop's clock may be coarse
        scan_from = self._watermark.for_claim(sent_at)
        batch = await self._ctx.store.claim_from(
            limit,
            owner,
            self._settings.lease_s,
            scan_from,
            walk_from=self._walk_from,
            ordered=self._ordered,
            marks=self._watermark.wants_marks(sent_at),
        )
        self._watermark.advance(batch)
        if self._ordered:  # an unordered claim does not walk: the next walk starts as it would
            self._walk_from = batch.walked_to
        self._ordered = batch.keyed
        # What the claim saw of the rows it left; the settle may add (a retry, a release).
        self._due = None if batch.next_due_s is None else sent_at + batch.next_due_s
        self._due_known = True
        rows = batch.rows
        answered_at = loop.time()
        elapsed_s = time.perf_counter() - timer
        self._ctx.metrics.claims.inc()
        self._ctx.metrics.claim_duration.observe(elapsed_s)
        tracing = self._ctx.tracing
        span = (
            None
            if tracing is None or not rows
            else tracing.claimed(elapsed_s, limit, len(rows), self.name)
        )
        if rows:
            self._ctx.metrics.claimed_rows.inc(len(rows))
            self.in_flight = len(rows)
        return Claim.leased(
            owner,
            rows,
            sent_at=sent_at,
            answered_at=answered_at,
            lease_s=self._settings.lease_s,
            attempt_timeout_s=self._settings.attempt_timeout_s,
            span=span,
        )

    async def wait_for_work(self) -> None:
        """Sleep until a notification, the next due row, the poll interval, or stop.

        The next due row is the last claim's answer when its settle added none (the usual
        case: no statement of its own), else the next-due query's. Either is only a hint:
        whatever it answers (an error, NULL, an infinite or NaN time from a row parked by
        hand), the worker sleeps at most the poll interval. Run until idle, the worker always
        asks: only the query tells that nothing is pending at all.
        """
        if self._ctx.wakeup.take():
            self._empty_claims = 0
            return  # rows were committed while this worker was busy: claim them now
        timeout_s = self._settings.poll_interval_s
        known, self._due_known = self._due_known, False
        if known and self._ctx.on_idle is None:
            due = self._due
            due_s = None if due is None else due - asyncio.get_running_loop().time()
        else:
            due_s = await self._ask_next_due()
            if due_s is None and self._ctx.on_idle is not None:
                self._ctx.on_idle()
                return
        if due_s is not None and not math.isnan(due_s):
            floor_s = _MIN_IDLE_S * 2 ** min(self._empty_claims, 16)
            timeout_s = min(timeout_s, max(due_s, floor_s))
        if await self._ctx.wakeup.wait(timeout_s):
            self._empty_claims = 0  # notified: new rows, not the ones it could not take

    async def _ask_next_due(self) -> float | None:
        """The next-due query's answer; None (sleep the poll interval) if it failed."""
        try:
            return await self._ctx.store.next_due_s(self._watermark.scan_from)
        except (DatabaseUnavailable, StatementError) as exc:
            self._log.warning("relay.next_due_unknown", error=str(exc))
            return None

    # --- publish -------------------------------------------------------------------------

    async def publish(self, claim: Claim) -> tuple[dict[str, Outcome], dict[str, Key]]:
        """Send the claim's rows to the sink concurrently, each attempt under its deadline;
        the outcomes, and the (queue, type) of each row that parsed, for the storm guard.
        The rows of ordered keys whose route parks are noted in `self.parking`."""
        outcomes: dict[str, Outcome] = {}
        envelopes: dict[str, Envelope] = {}
        keys: dict[str, Key] = {}
        storm = self._ctx.storm
        guarding = bool(storm.guard.trips)  # the usual case: no key held, no call per row
        self.parking = parking = set[str]()
        for row in claim.rows:
            envelope = self._read(row, parking)
            if isinstance(envelope, DeadLetter):
                outcomes[row.event_id] = envelope
                continue
            key = keys[row.event_id] = (envelope.queue, envelope.type)
            held = storm.held(key, claim.sent_at) if guarding else None
            if held is None:
                envelopes[row.event_id] = envelope
            else:
                outcomes[row.event_id] = held

        sendable = [row for row in claim.rows if row.event_id in envelopes]
        sink = self._ctx.sink
        capabilities = sink.capabilities
        if len(sendable) > 1 and capabilities.batches:
            requests = await sink.group_requests(sendable, envelopes)
        else:
            requests = [[row] for row in sendable]
        if not capabilities.reconcile_by_id:
            self._resending([row for row in sendable if row.claimed_before])
        timer = time.perf_counter()
        for result in await self._send(claim, requests, envelopes):
            if isinstance(result, BaseException):
                raise result
            outcomes.update(result)
        tracing = self._ctx.tracing
        if claim.span is not None and tracing is not None and requests:
            elapsed_s = time.perf_counter() - timer
            tracing.published(claim.span, elapsed_s, _sent(requests, envelopes, outcomes))
        return outcomes, keys

    def _resending(self, rows: Sequence[ClaimedRow]) -> None:
        """Rows an earlier attempt may have delivered, sent again to a sink that cannot be
        asked what it holds: each may arrive twice, and receivers deduplicate by its id (C2).
        A row whose attempts were all handed back unsent (released, or refused before any
        byte left: `SinkDown.reached` False) is not among them: those settles restore its
        previous attempt time (`Settler.write`)."""
        for row in rows:
            self._log.info("relay.resending", event_id=row.event_id, attempt=row.attempts)

    def _read(self, row: ClaimedRow, parking: set[str]) -> Envelope | DeadLetter:
        """The row's envelope, or why it can never be sent; a row of an ordered key whose
        route parks is added to `parking` either way (its key parks if it fails for good)."""
        failure = self._unpublishable(row)
        envelope = None
        if failure is None:
            try:
                envelope = Envelope.parse(row.job, row.event_id)
            except InvalidEnvelope as exc:
                failure = DeadLetter(DeadReason.INVALID_ENVELOPE, str(exc))
        policy = self._ctx.order(envelope)
        if policy.ordered:
            if row.ordering_key is None:
                failure = failure or DeadLetter(DeadReason.INVALID_ENVELOPE, _NO_KEY)
            elif policy.park:
                parking.add(row.event_id)
        if envelope is None or failure is not None:
            return failure or DeadLetter(DeadReason.INVALID_ENVELOPE, _NO_KEY)
        return envelope

    def _unpublishable(self, row: ClaimedRow) -> DeadLetter | None:
        """The checks that need no parsing: the row's size and its commit time."""
        oversized = too_large(len(row.job), self._settings.max_envelope_bytes)
        if oversized is not None:
            return oversized
        if not math.isfinite(row.age_s):
            # The table's checks refuse such a created_at; a row from before them (or from
            # a table whose checks were dropped) is refused here instead of being published
            # with a lag no metric can hold.
            return DeadLetter(DeadReason.INVALID_ENVELOPE, "created_at is not a finite time")
        return None

    async def _send(
        self,
        claim: Claim,
        requests: Sequence[Sequence[ClaimedRow]],
        envelopes: Mapping[str, Envelope],
    ) -> list[dict[str, Outcome] | BaseException]:
        """Each request's outcomes, or the failure its attempt raised, in request order.

        The requests run on at most sink.concurrency runners, each holding one of the
        process's slots (the bound on requests in flight over all workers) and taking the
        next request as soon as it is free: a task and a slot per runner, not per request.
        Every attempt runs to its end before anything is decided: none is left running
        unsupervised, and none is cut mid-request by a sibling's failure.
        """
        results: list[dict[str, Outcome] | BaseException] = [{} for _ in requests]
        pending = iter(enumerate(requests))
        slots = self._ctx.slots

        async def runner() -> None:
            deadlines = AttemptDeadlines()
            self._deadlines.add(deadlines)
            try:
                async with slots:
                    for index, rows in pending:  # shared: each request is taken once
                        try:
                            results[index] = await self._attempt(claim, rows, envelopes, deadlines)
                        except Exception as exc:
                            results[index] = exc
            finally:
                self._deadlines.discard(deadlines)
                deadlines.close()

        runners = min(self._settings.concurrency, len(requests))
        if runners == 1:
            await runner()  # one request (a probe, a quiet hour): no task to make
            return results
        ended = await asyncio.gather(*(runner() for _ in range(runners)), return_exceptions=True)
        for end in ended:
            if isinstance(end, BaseException):
                raise end
        return results

    async def _attempt(
        self,
        claim: Claim,
        rows: Sequence[ClaimedRow],
        envelopes: Mapping[str, Envelope],
        deadlines: AttemptDeadlines,
    ) -> dict[str, Outcome]:
        """One request's rows (a row, or a batch), in its runner's slot, under one deadline
        (sink.timeout_s from the attempt's own start, or the drain's grace if sooner).

        An attempt that cannot start (stopping, breaker open, or queued for a slot until too
        little of the lease was left) returns NotStarted: the claim is released, not counted.
        Anything else it raises is relayd's own failure, reported with the rows it held.
        """
        loop = asyncio.get_running_loop()
        if (
            self._ctx.stopping.is_set()
            or self._ctx.gate.state is BreakerState.OPEN
            or claim.window.closed()
        ):
            return {row.event_id: NotStarted() for row in rows}
        started, timer = loop.time(), time.perf_counter()
        deadline = min(started + self._settings.attempt_timeout_s, self._grace_ends)
        try:
            with deadlines.until(deadline):
                result = await self._ctx.sink.publish(rows, envelopes, window=claim.window)
        except TimeoutError:
            expired = timed_out(loop.time() - started)
            if not self._ctx.stopping.is_set():  # a drain cut is ours, not the sink's
                self._ctx.gate.sink_failed(severe=False, reason=expired.error)
            result = {row.event_id: expired for row in rows}
        except Exception as exc:
            raise WorkerCrashed("publish", [row.event_id for row in rows]) from exc
        elapsed_s = time.perf_counter() - timer
        durations = self._ctx.metrics.publish_duration_by
        # One observation per attempt and outcome: a batch's rows share its duration.
        for label in {_label(outcome) for outcome in result.values()}:
            durations[label].observe(elapsed_s)
        return result

    # --- settle --------------------------------------------------------------------------

    async def settle(
        self, claim: Claim, outcomes: dict[str, Outcome], keys: Mapping[str, Key]
    ) -> Plan:
        """Record every outcome with fenced UPDATEs, shielded from cancellation; the plan."""
        timer = time.perf_counter()
        try:
            groups = await self._settler.settle(
                claim,
                outcomes,
                keys,
                sink_wide=(
                    self._ctx.gate.state is not BreakerState.CLOSED or self._ctx.stopping.is_set()
                ),
                parking=self.parking,
            )
        finally:
            self.in_flight = 0
        if claim.span is not None and self._ctx.tracing is not None:
            self._ctx.tracing.settled(
                claim.span,
                time.perf_counter() - timer,
                {
                    "published": len(groups.published),
                    "retried": len(groups.retried),
                    "dead": len(groups.dead),
                    "released": len(groups.released),
                },
            )
        return groups


def _label(outcome: Outcome) -> str:
    """The attempt's outcome for `relayd_publish_duration_seconds`: how it will be settled,
    or `sink_down` for a failure of the sink (retried or refunded)."""
    if isinstance(outcome, Published):
        return Settled.RECONCILED if outcome.reconciled else Settled.PUBLISHED
    if isinstance(outcome, DeadLetter):
        return Settled.DEAD
    if isinstance(outcome, NotStarted):
        return Settled.RELEASED
    if isinstance(outcome, RetryLater):
        return Settled.RETRIED
    return "sink_down"


def _sent(
    requests: Sequence[Sequence[ClaimedRow]],
    envelopes: Mapping[str, Envelope],
    outcomes: Mapping[str, Outcome],
) -> Sent:
    """What the publish span records of a claim's requests."""
    rows = [row for request in requests for row in request]
    sent = [outcomes[row.event_id] for row in rows]
    return Sent(
        rows=len(rows),
        requests=len(requests),
        published=sum(isinstance(outcome, Published) for outcome in sent),
        failed=any(isinstance(outcome, SinkDown) for outcome in sent),
        message_id=rows[0].event_id if len(rows) == 1 else None,
        metas=(envelopes[row.event_id].meta for row in rows),
    )
