"""Waiting out a PostgreSQL outage: the one loop for every place that meets one (the relay
workers, settling, start-up, the housekeeping chores, the LISTEN connection). Each failure is
counted in `relayd_database_errors_total`, logged with the delay, and followed by a jittered
exponential backoff (0.2 s doubling to 10 s); its random source is injected like the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from structlog.typing import FilteringBoundLogger

from relayd.core.errors import DatabaseUnavailable
from relayd.core.retry import Backoff
from relayd.core.wakeup import wait_event
from relayd.telemetry.metrics import RelayMetrics

# The jitter only spreads replicas apart; the cap keeps a returning server found quickly.
BASE_S = 0.2
CAP_S = 10.0

_T = TypeVar("_T")


class DatabaseRetry:
    """The outage policy of one process: its backoff and the counter every failure goes to."""

    def __init__(self, backoff: Backoff, metrics: RelayMetrics) -> None:
        self.backoff = backoff
        self.metrics = metrics

    def outage(
        self,
        *,
        log: FilteringBoundLogger,
        event: str,
        stopping: asyncio.Event | None = None,
        until: float | None = None,
    ) -> Outage:
        """The failures in a row of one loop, logged as `event`; see `Outage`."""
        return Outage(self, log, event, stopping, until)

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
        outage = self.outage(log=log, event=event, stopping=stopping, until=until)
        return await outage.call(operation)

    async def repeat(
        self,
        step: Callable[[], Awaitable[object]],
        *,
        log: FilteringBoundLogger,
        event: str,
        stopping: asyncio.Event,
    ) -> None:
        """Run `step` again and again until `stopping` is set, waiting out each failure for
        want of the database before the next run."""
        await self.outage(log=log, event=event, stopping=stopping).repeat(step)


@dataclass
class Outage:
    """One loop's failures in a row for want of PostgreSQL. Each is counted, logged as
    `event` with its delay and waited out with the policy's backoff, which grows with each
    failure and starts over once PostgreSQL answers; a wait ends early when `stopping` is
    set. Past loop time `until` a failure is counted and raised instead."""

    policy: DatabaseRetry
    log: FilteringBoundLogger
    event: str
    stopping: asyncio.Event | None = None
    until: float | None = None
    failures: int = 0

    def over(self) -> None:
        """PostgreSQL answered: the next failure starts the backoff again. `call` says so
        itself; a step that holds a connection for long says so once it is connected."""
        self.failures = 0

    async def call(self, operation: Callable[[], Awaitable[_T]]) -> _T | None:
        """Run `operation` until it does not fail for want of the database; its answer, or
        None if `stopping` was set first."""
        loop = asyncio.get_running_loop()
        while self.stopping is None or not self.stopping.is_set():
            try:
                answer = await operation()
            except DatabaseUnavailable as exc:
                self.failures += 1
                self.policy.metrics.database_errors.inc()
                if self.until is not None and loop.time() >= self.until:
                    raise
                delay_s = self.policy.backoff.delay_s(self.failures)
                self.log.warning(self.event, error=str(exc), retry_in_s=round(delay_s, 2))
                if self.stopping is None:
                    await asyncio.sleep(delay_s)
                else:
                    await wait_event(self.stopping, delay_s)
                continue
            self.over()
            return answer
        return None

    async def repeat(self, step: Callable[[], Awaitable[object]]) -> None:
        """Run `step` (through `call`) again and again until `stopping` is set."""
        while self.stopping is None or not self.stopping.is_set():
            await self.call(step)
