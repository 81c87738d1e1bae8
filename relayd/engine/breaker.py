"""The circuit breaker as the workers of one process share it: async permits, the sink's
reports (`SinkHealth`), the health request of a probe that found no row, and the log events
and gauge of its state changes. The rules themselves are pure, in `relayd/core/retry.py`.

Logged are changes, never attempts: an idle relay that probes again and again with no row
to send, while nothing changes, writes nothing.

While the breaker is not closed it keeps its reason: the sink's failure that opened it last
(the first one, or a failed probe's), in the sink's words (`SinkHealth.sink_failed`). The
`breaker.opened` event carries it as `error`, `/readyz` and the heartbeat (`relayd status`,
`/v1/status`) as the breaker's reason. A reconnect of the sink's client ends an open
breaker's cooldown at once (`sink_reconnected`), and is counted.
"""

from __future__ import annotations

import asyncio

from relayd.core.outcomes import clean_error
from relayd.core.retry import BreakerState, CircuitBreaker, Permit
from relayd.core.wakeup import Wakeup
from relayd.sinks import Sink
from relayd.telemetry.logs import get_logger
from relayd.telemetry.metrics import RelayMetrics


class BreakerGate:
    """The process's circuit breaker as the workers see it: async permits, logs, metrics."""

    def __init__(
        self,
        breaker: CircuitBreaker,
        metrics: RelayMetrics,
        stopping: asyncio.Event,
        *,
        kind: str,
    ) -> None:
        """`kind`: the sink's kind, the label of the reconnects it counts."""
        self._breaker = breaker
        self._metrics = metrics
        self._stopping = stopping
        self._changed = Wakeup()
        self._log = get_logger("breaker")
        self._reason: str | None = None
        self._reconnects = metrics.sink_reconnects.labels(kind)  # 0 until the first
        metrics.set_breaker(breaker.state)

    @property
    def state(self) -> BreakerState:
        return self._breaker.state

    @property
    def reason(self) -> str | None:
        """Why the breaker is not closed: the sink's failure that opened it last, in the
        sink's words; None while it is closed."""
        if self._breaker.state is BreakerState.CLOSED:
            return None
        return self._reason

    async def acquire(self) -> Permit | None:
        """Wait until claiming is allowed; None once the process is stopping."""
        while not self._stopping.is_set():
            snapshot = self._changed.snapshot()
            before = self._breaker.state
            permit = self._breaker.permit()
            if isinstance(permit, Permit):
                if self._breaker.state is not before:  # open -> half-open, once per cooldown
                    self._publish_state("breaker.probing")
                return permit
            await self._changed.wait(snapshot, permit)
        return None

    def end_probe(self) -> None:
        self._breaker.end_probe()
        self._changed.notify()

    def wake_all(self) -> None:
        self._changed.notify()

    async def ask_sink(self, sink: Sink, timeout_s: float) -> None:
        """A half-open probe found no row to send: ask the sink's health request (the manifest,
        with our credentials) instead, so a relay with nothing to send still learns whether
        the sink is back. An answer closes the breaker, unproven; a failure, or no answer
        within `timeout_s`, opens it again with a longer cooldown."""
        if self._breaker.state is not BreakerState.HALF_OPEN or self._stopping.is_set():
            return  # closed already (the next row proves it), or reopened meanwhile
        try:
            async with asyncio.timeout(timeout_s):
                answers, detail = await sink.check()
        except TimeoutError:
            answers, detail = False, f"no answer within sink.timeout_s ({timeout_s:g}s)"
        if answers:
            if self._breaker.record_alive():
                self._publish_state("breaker.closed", proof="health_check")
        elif self._breaker.record_failure():
            self._opened(detail, severe=False)

    # SinkHealth: the sink reports every exchange that tells something here.
    def sink_accepted(self) -> None:
        state = self._breaker.state
        if not self._breaker.record_accepted():
            return
        if state is BreakerState.CLOSED:
            # Closed on a health answer until now: this row proves it; full claims again.
            self._log.info("breaker.confirmed", state="closed")
            self._changed.notify()
        else:
            self._publish_state("breaker.closed", proof="publish")

    def sink_answered(self) -> None:
        self._breaker.record_answered()

    def sink_failed(self, *, severe: bool, reason: str) -> None:
        if self._breaker.record_failure(severe=severe):
            self._opened(reason, severe=severe)

    def sink_reconnected(self) -> None:
        """Counted; an open breaker's cooldown ends now, and a waiting worker probes."""
        self._reconnects.inc()
        if self._breaker.record_reconnected():
            self._log.info("breaker.cooldown_ended", cause="sink_reconnected")
            self._changed.notify()

    def _opened(self, reason: str, *, severe: bool) -> None:
        self._reason = clean_error(reason)
        self._metrics.breaker_opened.inc()
        self._publish_state(
            "breaker.opened",
            openings=self._breaker.openings,
            cooldown_s=round(self._breaker.cooldown_s, 3),
            severe=severe,
            error=self._reason,
        )

    def _publish_state(self, event: str, **fields: object) -> None:
        self._metrics.set_breaker(self._breaker.state)
        # Opening is news an operator must see; probing and closing again are recovery.
        log = self._log.warning if self._breaker.state is BreakerState.OPEN else self._log.info
        log(event, state=self._breaker.state.name.lower(), **fields)
        self._changed.notify()
