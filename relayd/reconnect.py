"""Waiting out a PostgreSQL outage: one policy for every place that meets one (the relay
loop, settling, start-up, the LISTEN connection). Each failure is counted in
`relayd_database_errors_total`, logged with the delay, and followed by a jittered
exponential backoff (0.2 s doubling to 10 s); its random source is injected like the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from structlog.typing import FilteringBoundLogger

from relayd.errors import DatabaseUnavailable
from relayd.metrics import RelayMetrics
from relayd.retry import Backoff
from relayd.wakeup import wait_event

# The jitter only spreads replicas apart; the cap keeps a returning server found quickly.
BASE_S = 0.2
CAP_S = 10.0

_T = TypeVar("_T")


class DatabaseRetry:
    """Count, log and wait out `DatabaseUnavailable`."""

    def __init__(self, backoff: Backoff, metrics: RelayMetrics) -> None:
        self._backoff = backoff
        self._metrics = metrics

    async def wait(
        self,
        failures: int,
        exc: DatabaseUnavailable,
        *,
        log: FilteringBoundLogger,
        event: str,
        stopping: asyncio.Event | None = None,
    ) -> None:
        """After the `failures`-th failure in a row: count it, log `event`, and sleep the
        backoff (cut short when `stopping` is set)."""
        self._metrics.database_errors.inc()
        delay_s = self._backoff.delay_s(failures)
        log.warning(event, error=str(exc), retry_in_s=round(delay_s, 2))
        if stopping is None:
            await asyncio.sleep(delay_s)
        else:
            await wait_event(stopping, delay_s)

    async def call(
        self,
        operation: Callable[[], Awaitable[_T]],
        *,
        log: FilteringBoundLogger,
        event: str,
        stopping: asyncio.Event | None = None,
        until: float | None = None,
    ) -> _T | None:
        """Run `operation` until it does not fail for want of the database. Returns None if
        `stopping` was set first; re-raises the last failure once loop time `until` passed."""
        loop = asyncio.get_running_loop()
        failures = 0
        while stopping is None or not stopping.is_set():
            try:
                return await operation()
            except DatabaseUnavailable as exc:
                failures += 1
                if until is not None and loop.time() >= until:
                    self._metrics.database_errors.inc()
                    raise
                await self.wait(failures, exc, log=log, event=event, stopping=stopping)
        return None
