"""The process lifecycle, told as steps: startup -> serve (a TaskGroup) -> drain -> shutdown.

HTTP opens first, before PostgreSQL is reached: a liveness probe sees a process that is
waiting correctly (`/healthz` 200, `/readyz` 503 "database unreachable"), not a dead one.

The only signal code of relayd is here. The first SIGTERM/SIGINT drains (C8): stop claiming,
let in-flight attempts finish within `relay.shutdown_grace_s`, settle them, release what never
started, exit 0. A second signal exits at once; leases then expire on their own. Every task
runs inside the TaskGroup: a crash is logged loudly with what the task held, the others
drain, and the daemon exits 1.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from relayd.config.sections import parse_listen
from relayd.core.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    DatabaseUnavailable,
    ListenError,
    WorkerCrashed,
)
from relayd.core.retry import Backoff, BreakerState, CircuitBreaker
from relayd.core.wakeup import WorkSignal
from relayd.daemon import systemd
from relayd.daemon.cleanup import clean_published
from relayd.daemon.http import Readiness, make_app, start_web
from relayd.daemon.listener import listen_for_inserts
from relayd.daemon.sampler import Activity, InstanceInfo, Sampler
from relayd.engine.breaker import BreakerGate
from relayd.engine.chores import Chore, Housekeeping
from relayd.engine.liveness import NoProof, Proof, acquire, runtime_dir
from relayd.engine.relay import RelayContext, RelayWorker, WorkerSettings
from relayd.engine.storm import StormGuard, StormHold
from relayd.operator.status import build_report, report_json
from relayd.settings import Settings
from relayd.store import Store
from relayd.store import outage as reconnect
from relayd.store.migrations import require_current
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.logs import configure_logging, get_logger
from relayd.telemetry.metrics import RelayMetrics
from relayd.telemetry.tracing import RelayTracing, from_environment

if TYPE_CHECKING:
    from aiohttp import web

# After the grace period, how long settling (and releasing) may still take before we give up
# and leave the remaining leases to expire.
SETTLE_BOUND_S = 10.0
# How many of a crashed worker's rows its log event names (a claim may hold thousands).
_CRASH_IDS_LOGGED = 50


class Daemon:
    """One relayd process. `run()` returns the exit code; `stop()` begins the drain."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: RelayMetrics | None = None,
        rng: random.Random | None = None,
        until_idle: bool = False,
        tracing: RelayTracing | None = None,
    ) -> None:
        """`until_idle`: drain and return once nothing is pending (every row published or
        dead-lettered), instead of waiting for a signal; tests and one-shot runs use it.
        `tracing`: the relay's spans on a provider of the caller's; without it, as the
        standard OTEL_* variables configure them (relayd/telemetry/tracing.py), if at all."""
        self.settings = settings
        self._until_idle = until_idle
        self.metrics = RelayMetrics() if metrics is None else metrics
        self._rng = random.Random() if rng is None else rng  # noqa: S311 - jitter, not crypto
        self._tracing = tracing
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()
        self.workers: list[RelayWorker] = []
        self._wakeup = WorkSignal()
        self._database = DatabaseRetry(
            Backoff(base_s=reconnect.BASE_S, cap_s=reconnect.CAP_S, rng=self._rng), self.metrics
        )
        self.housekeeping = Housekeeping(self.metrics, self._database, self.stopping)
        self._storm: StormHold | None = None
        self._gate: BreakerGate | None = None
        # Set once PostgreSQL answered; until then /readyz and /v1/status say it does not.
        self._store: Store | None = None
        self.instance = InstanceInfo()
        self._hard_stop: asyncio.Timeout | None = None
        self._grace_ends: float | None = None
        self._crashed = False
        # This process's proof of life (relayd/engine/liveness.py), once `run` began.
        self.proof: Proof | NoProof | None = None
        self._log = get_logger("daemon")
        # A one-line backlog summary for systemd's STATUS= line (relayd/daemon/systemd.py), set by
        # whatever samples the backlog; None: not known.
        self.backlog_status: Callable[[], str | None] | None = None

    @property
    def breaker_state(self) -> BreakerState | None:
        """The sink circuit breaker's state; None until start-up has made the breaker."""
        return None if self._gate is None else self._gate.state

    @property
    def in_flight(self) -> int:
        """Rows claimed by this process and not yet settled."""
        return sum(w.in_flight for w in self.workers)

    def stop(self) -> None:
        """Begin the drain; idempotent."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        grace_ends = asyncio.get_running_loop().time() + self.settings.relay.shutdown_grace_s
        self._grace_ends = grace_ends
        self._log.info(
            "daemon.draining",
            grace_s=self.settings.relay.shutdown_grace_s,
            in_flight=sum(w.in_flight for w in self.workers),
        )
        for worker in self.workers:
            worker.cut_deadline(grace_ends)
        self._wakeup.close()
        if self._gate is not None:
            self._gate.wake_all()
        if self._hard_stop is not None:
            self._hard_stop.reschedule(self._hard_deadline())

    async def run(self) -> int:
        # Settings `run` cannot do without: fail before waiting for anything (exit 2).
        _ = self.settings.dsn, self.settings.sink.target
        self.settings.sink.require_client()
        stack = AsyncExitStack()
        try:
            # 1. startup: the proof of life, HTTP, PostgreSQL (waiting for it if need be), the
            # schema, a dead predecessor's leases, the sink.
            self.proof = self._prove_alive()
            if isinstance(self.proof, Proof):
                stack.callback(self.proof.release)  # the last thing given up
            if self.settings.http.enabled:
                stack.push_async_callback((await self._start_http()).cleanup)
            store = await self._connect()
            if store is None:
                self._log.info("daemon.stopped", released=0, abandoned=0, exit_code=EXIT_OK)
                return EXIT_OK
            stack.push_async_callback(store.close)
            await require_current(store)
            if not await self._take_back(store):
                return EXIT_OK  # stopped while PostgreSQL was away
            if self._tracing is None:
                self._tracing = from_environment(self.settings.sink.kind)
                if self._tracing is not None:
                    stack.push_async_callback(self._tracing.close)  # flush after the drain
            ctx = self.make_context(store)
            self._store = store
            await ctx.sink.start()
            stack.push_async_callback(ctx.sink.close)
            self.workers = [RelayWorker(ctx, f"w{i}") for i in range(self.settings.relay.workers)]
            # 2. serve until stopped (or a task crashes), 3. drain.
            return await self._serve(ctx)
        finally:
            # 4. shutdown, in reverse order: sink sessions, the pool, HTTP (the first open).
            await stack.aclose()

    def _prove_alive(self) -> Proof | NoProof:
        """Lock a slot of the runtime directory, or say why there is no proof of life (said
        in the log once the database answers: a start that fails before prints its one
        line alone)."""
        return acquire(runtime_dir(self.settings.relay.runtime_dir, os.environ))

    async def _take_back(self, store: Store) -> bool:
        """Make due now the leases a dead process of this slot left (its claims may have
        been sent: each is reconciled before it is sent again); False if stopped first."""
        proof = self.proof
        if isinstance(proof, NoProof):
            self._log.info("daemon.no_proof_of_life", reason=proof.reason)
        if not isinstance(proof, Proof):
            return True
        self._log.info("daemon.proof_of_life", lock=str(proof.path), slot=proof.slot)
        taken = await self._database.call(
            functools.partial(store.take_back, *proof.leases),
            log=self._log,
            event="daemon.database_unavailable",
            stopping=self.stopping,
        )
        if taken is None:
            return False
        if taken:
            self._log.warning("daemon.leases_taken_back", rows=taken, slot=proof.slot)
        return True

    async def _start_http(self) -> web.AppRunner:
        """Serve /metrics, /healthz, /readyz and /v1/status; `ListenError` (exit 1, one
        line) if the address cannot be bound."""
        listen = self.settings.http.listen
        host, port = parse_listen(listen)
        app = make_app(self.metrics, self._readiness, self._status)
        try:
            return await start_web(app, host, port)
        except OSError as exc:
            # asyncio's message repeats the address; the errno's own text says it all.
            reason = os.strerror(exc.errno).lower() if exc.errno else type(exc).__name__
            raise ListenError("http.listen", listen, reason) from None

    async def _serve(self, ctx: RelayContext) -> int:
        settings = self.settings
        sampler = Sampler(
            store=ctx.store,
            metrics=self.metrics,
            lease_s=settings.relay.lease_s,
            instance=self.instance,
            activity=lambda: Activity(
                ctx.gate.state, sum(w.in_flight for w in self.workers), ctx.gate.reason
            ),
            housekeeping=self.housekeeping,
        )
        self.backlog_status = sampler.summary
        self._log.info(
            "daemon.started",
            table=str(ctx.store.table),
            sink=settings.sink.target,
            workers=settings.relay.workers,
            listen=settings.listens,
            http=settings.http.listen if settings.http.enabled else None,
            tracing=ctx.tracing is not None,
        )
        self.ready.set()
        code = EXIT_OK
        try:
            async with asyncio.timeout(self._hard_deadline()) as hard_stop:
                self._hard_stop = hard_stop
                try:
                    async with asyncio.TaskGroup() as tasks:
                        for worker in self.workers:
                            tasks.create_task(
                                self._supervised(worker.run(), f"relay-{worker.name}"),
                                name=f"relay-{worker.name}",
                            )
                        if settings.listens:
                            tasks.create_task(
                                self._supervised(
                                    listen_for_inserts(
                                        ctx.store, self._wakeup, self.stopping, self._database
                                    ),
                                    "wakeup-listener",
                                ),
                                name="wakeup-listener",
                            )
                        for chore, interval_s, step in self._chores(ctx, sampler):
                            tasks.create_task(
                                self._supervised(
                                    self.housekeeping.every(chore, interval_s, step), chore
                                ),
                                name=chore,
                            )
                except* Exception as crashed:  # only if _supervised itself failed
                    self._crashed = True
                    for exc in crashed.exceptions:
                        self._log.error("daemon.crashed", error=repr(exc), exc_info=exc)
        except TimeoutError:
            code = EXIT_FAILURE
            self._log.error("daemon.drain_timeout", bound_s=SETTLE_BOUND_S)
        if self._crashed:
            code = EXIT_FAILURE
        if code == EXIT_OK:
            # A clean stop: this relay is no longer running. After a crash the heartbeat is
            # left to turn stale, which is what `relayd status` should then show.
            await sampler.forget()
        # 3. drained: say what was left.
        self._log.info(
            "daemon.stopped",
            released=sum(w.released for w in self.workers),
            abandoned=sum(w.in_flight for w in self.workers),
            exit_code=code,
        )
        return code

    def _chores(
        self, ctx: RelayContext, sampler: Sampler
    ) -> list[tuple[Chore, float, Callable[[], Awaitable[object]]]]:
        """The housekeeping chores of this process, each with its period and its step."""
        settings = self.settings
        sample_s = settings.metrics.sample_interval_s
        chores: list[tuple[Chore, float, Callable[[], Awaitable[object]]]] = [
            (Chore.SAMPLER, sample_s, sampler.sample),
            (Chore.HEARTBEAT, sample_s, sampler.beat),
            # Idle unless the storm guard tripped and could not store its pause at once.
            (Chore.STORM_PAUSE, settings.relay.poll_interval_s, ctx.storm.store_pauses),
        ]
        if settings.cleanup.enabled:
            cleanup = settings.cleanup
            chores.append(
                (
                    Chore.CLEANUP,
                    cleanup.interval_s,
                    lambda: clean_published(ctx.store, cleanup, self.stopping),
                )
            )
        return chores

    async def _supervised(self, work: Awaitable[None], task: str) -> None:
        """Run one of the daemon's tasks; if it fails, say so loudly and drain the rest.

        A failure here is relayd's own (rows' and connections' troubles are handled where
        they arise): the process will exit 1 so that systemd restarts it, but the other
        workers first finish and settle what they are sending, so the failure of one costs
        the others nothing.
        """
        try:
            await work
        except Exception as exc:
            self._crashed = True
            fields: dict[str, object] = {"task": task, "error": str(exc)}
            if isinstance(exc, WorkerCrashed):
                cause = exc.__cause__
                fields |= {
                    "step": exc.step,
                    "statement": exc.statement,
                    "rows": len(exc.event_ids),
                    "event_ids": exc.event_ids[:_CRASH_IDS_LOGGED],
                    "error": repr(cause) if cause is not None else str(exc),
                }
            self._log.error("daemon.task_crashed", **fields, exc_info=exc)
            self.stop()

    def _hard_deadline(self) -> float | None:
        """Loop time by which the drain must be over (None until stop() is called)."""
        if self._grace_ends is None:
            return None
        return self._grace_ends + SETTLE_BOUND_S

    async def _connect(self) -> Store | None:
        """Open the pool, retrying with backoff while PostgreSQL is unreachable; None if
        the daemon was stopped first."""
        database = self.settings.database
        return await self._database.call(
            functools.partial(
                Store.connect,
                self.settings.dsn,
                self.settings.outbox.outbox_table,
                max_size=database.pool_max_size or self.settings.relay.workers + 2,
                connect_timeout_s=database.connect_timeout_s,
                statement_timeout_s=database.statement_timeout_s,
                daemon=True,
            ),
            log=self._log,
            event="daemon.database_unavailable",
            stopping=self.stopping,
        )

    def make_context(self, store: Store) -> RelayContext:
        """The shared state of this process's workers (the breaker, the sink, the slots)."""
        retry = self.settings.retry
        breaker = CircuitBreaker(
            threshold=retry.breaker_threshold,
            cooldown_s=retry.breaker_cooldown_s,
            cap_s=retry.cap_s,
            rng=self._rng,
        )
        self._gate = BreakerGate(breaker, self.metrics, self.stopping, kind=self.settings.sink.kind)
        self._storm = StormHold(
            guard=StormGuard(
                threshold=self.settings.relay.storm_threshold,
                window=self.settings.relay.storm_window,
            ),
            store=store,
            metrics=self.metrics,
            housekeeping=self.housekeeping,
            actor=f"relayd@{socket.gethostname()}",
            retry_after_s=retry.cap_s,
        )
        sink = self.settings.sink
        return RelayContext(
            settings=worker_settings(self.settings),
            store=store,
            sink=sink.build(self._gate, observe=self.metrics.sink_requests_of(sink.kind)),
            gate=self._gate,
            wakeup=self._wakeup,
            stopping=self.stopping,
            metrics=self.metrics,
            backoff=Backoff(base_s=retry.base_s, cap_s=retry.cap_s, rng=self._rng),
            database=self._database,
            storm=self._storm,
            slots=asyncio.Semaphore(self.settings.sink.concurrency),
            on_idle=self.stop if self._until_idle else None,
            tracing=self._tracing,
            holder=self.proof.holder if isinstance(self.proof, Proof) else None,
            order=sink.order_policy,
        )

    async def _readiness(self) -> Readiness:
        """`/readyz`: why this relay is not ready, if it is not, and its failing chores."""
        detail = {"housekeeping": self.housekeeping.as_json()} if self.housekeeping.failing else {}
        return Readiness(await self._not_ready(), detail)

    async def _not_ready(self) -> str | None:
        store = self._store
        if store is None:
            return "database unreachable"  # still waiting for PostgreSQL at start-up
        if not self.ready.is_set():
            return "starting"
        if self._gate is not None and self._gate.state is BreakerState.OPEN:
            # Why, in the sink's words: what an operator looking at a failing probe needs.
            reason = self._gate.reason
            return "sink circuit breaker open" + (f": {reason}" if reason else "")
        held = [] if self._storm is None else self._storm.guard.unstored()
        if held:
            # The guard's pause could not be stored: this process holds those rows itself,
            # and the other replicas do not know to.
            keys = ", ".join(f"queue {queue} type {job_type}" for queue, job_type in held)
            return f"poison-storm pause not stored; holding {keys} in this process"
        try:
            async with asyncio.timeout(2):
                await store.ping()
        except (DatabaseUnavailable, TimeoutError):
            return "database unreachable"
        return None

    async def _status(self) -> Mapping[str, Any]:
        """`/v1/status`: the report of `relayd status --json`."""
        store = self._store
        if store is None:
            raise DatabaseUnavailable("database unreachable")
        report = await build_report(
            store,
            sample_interval_s=self.settings.metrics.sample_interval_s,
            lease_s=self.settings.relay.lease_s,
        )
        return report_json(report)


async def run_daemon(settings: Settings) -> int:
    """`relayd run`: configure logging, install signal handlers, run until drained."""
    configure_logging(settings.log.level, settings.log.format)
    daemon = Daemon(settings)
    loop = asyncio.get_running_loop()
    # SIGHUP (a closed terminal) drains like SIGTERM rather than killing the process.
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    log = get_logger("daemon")

    def on_signal(signum: int) -> None:
        if daemon.stopping.is_set():
            log.warning("daemon.forced_exit", signal=signal.Signals(signum).name)
            os._exit(EXIT_FAILURE)
        log.info("daemon.signal", signal=signal.Signals(signum).name)
        daemon.stop()

    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        async with systemd.notifying(daemon):  # READY, WATCHDOG, STOPPING, STATUS
            return await daemon.run()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def worker_settings(settings: Settings) -> WorkerSettings:
    """What a relay worker reads of the configuration, and nothing else."""
    relay = settings.relay
    return WorkerSettings(
        batch_size=relay.batch_size,
        lease_s=relay.lease_s,
        poll_interval_s=relay.poll_interval_s,
        full_scan_interval_s=relay.full_scan_interval_s,
        attempt_timeout_s=settings.sink.timeout_s,
        concurrency=settings.sink.concurrency,
        max_envelope_bytes=settings.sink.max_envelope_bytes,
        max_attempts=settings.retry.max_attempts,
    )
