"""Housekeeping: the daemon's chores beside publishing, and what happens when one fails.

The chores are retention cleanup, the backlog sampler, the heartbeat and storing a
poison-storm pause. Each runs on its own schedule; none of them publishes, so none may stop
publishing. A chore's statement that PostgreSQL refuses (a foreign key from an application
table to a published row, a trigger that refuses the DELETE, a privilege revoked) is not a
crash: the chore says so once per change of its error (`housekeeping.failed`, then
`housekeeping.recovered`), counts each failed run in `relayd_housekeeping_failures_total`,
raises `relayd_housekeeping_failing`, shows in `/readyz`'s detail and, through the heartbeat,
in `relayd status`, and tries again at its next turn. A lost connection is the
database-outage policy's (relayd/store/outage.py), as everywhere else.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from relayd.core.errors import StatementError
from relayd.core.wakeup import wait_event
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.logs import get_logger
from relayd.telemetry.metrics import RelayMetrics


class Chore(enum.StrEnum):
    """A housekeeping chore: the `chore` label of its metrics and the key of its failure."""

    CLEANUP = "cleanup"  # retention: delete published rows past cleanup.published_retention_s
    SAMPLER = "sampler"  # the backlog gauges
    HEARTBEAT = "heartbeat"  # this relay's row in relayd_instances
    STORM_PAUSE = "storm_pause"  # storing the poison-storm guard's pauses


@dataclass(frozen=True, slots=True)
class ChoreFailure:
    """A chore failing since `since` (wall clock, UTC), `failures` runs in a row."""

    error: str
    since: datetime
    failures: int

    def as_json(self) -> dict[str, Any]:
        return {"error": self.error, "since": self.since.isoformat(), "failures": self.failures}


class Housekeeping:
    """The chores' health, shared by the daemon's tasks, and the loop each chore runs in."""

    def __init__(
        self,
        metrics: RelayMetrics,
        database: DatabaseRetry,
        stopping: asyncio.Event,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._metrics = metrics
        self._database = database
        self._stopping = stopping
        self._clock = clock
        self._log = get_logger("housekeeping")
        self.failing: dict[Chore, ChoreFailure] = {}
        for chore in Chore:
            metrics.housekeeping_failing.labels(chore.value).set(0)

    async def every(
        self, chore: Chore, interval_s: float, step: Callable[[], Awaitable[object]]
    ) -> None:
        """Run `step` now, then `interval_s` after each run ends, until the daemon stops.

        While PostgreSQL is unreachable the chore waits out the outage with the database
        policy's backoff instead; any other failure is relayd's own and propagates (the
        supervisor stops the daemon loudly).
        """

        async def turn() -> None:
            await self.run(chore, step)
            await wait_event(self._stopping, interval_s)

        await self._database.repeat(
            turn,
            log=self._log.bind(chore=chore.value),
            event=f"{chore.value}.database_unavailable",
            stopping=self._stopping,
        )

    async def run(self, chore: Chore, step: Callable[[], Awaitable[object]]) -> bool:
        """Run `step` once and record how it went; False if PostgreSQL refused its statement.
        `DatabaseUnavailable` propagates: a lost connection is not the chore's failure."""
        try:
            await step()
        except StatementError as exc:
            self.failed(chore, str(exc))
            return False
        self.succeeded(chore)
        return True

    def failed(self, chore: Chore, error: str) -> None:
        """One failed run: counted always, logged when the error is new."""
        self._metrics.housekeeping_failures.labels(chore.value).inc()
        self._metrics.housekeeping_failing.labels(chore.value).set(1)
        previous = self.failing.get(chore)
        if previous is not None and previous.error == error:
            self.failing[chore] = ChoreFailure(error, previous.since, previous.failures + 1)
            return
        since = self._clock() if previous is None else previous.since
        failures = 1 if previous is None else previous.failures + 1
        self.failing[chore] = ChoreFailure(error, since, failures)
        self._log.error("housekeeping.failed", chore=chore.value, error=error, failures=failures)

    def succeeded(self, chore: Chore) -> None:
        previous = self.failing.pop(chore, None)
        if previous is not None:
            self._metrics.housekeeping_failing.labels(chore.value).set(0)
            self._log.info("housekeeping.recovered", chore=chore.value, failures=previous.failures)

    def as_json(self) -> dict[str, dict[str, Any]]:
        """The failing chores, for `/readyz`'s detail and the heartbeat (`{}`: none)."""
        return {chore.value: failure.as_json() for chore, failure in sorted(self.failing.items())}
