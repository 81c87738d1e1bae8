"""The backlog sampler and the heartbeat, two housekeeping chores of the daemon
(relayd/engine/chores.py): every `metrics.sample_interval_s`, one bounded statement feeds the
backlog gauges (never a query per row), and this relay's heartbeat row in relayd_instances
says it is alive, which `relayd status` lists, with the chores failing now and why its
breaker is open, if it is. Each rides out PostgreSQL outages and refused statements on its
own; `relayd_backlog_sampled_timestamp_seconds` shows how old the gauges are.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from structlog.typing import FilteringBoundLogger

from relayd.core import __version__
from relayd.core.backlog import BACKLOG_BOUND, Backlog, Heartbeat
from relayd.core.errors import DatabaseUnavailable, StatementError
from relayd.core.retry import BreakerState
from relayd.engine.chores import Housekeeping
from relayd.store import Store
from relayd.telemetry.logs import get_logger
from relayd.telemetry.metrics import RelayMetrics

# A clean stop removes the heartbeat, but never waits long for it: a relay that cannot
# reach PostgreSQL while stopping leaves a row that turns stale, which is the truth.
_FORGET_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """Who this relay is, as its heartbeat row says."""

    instance_id: uuid.UUID = field(default_factory=uuid.uuid4)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    version: str = __version__
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))


async def sample_backlog(store: Store, *, lease_s: float, bound: int = BACKLOG_BOUND) -> Backlog:
    """The sampler's one statement; `lease_s` is relay.lease_s, the longest a lease runs."""
    return Backlog.from_sample(await store.backlog_sample(bound + 1, lease_s), bound)


@dataclass(frozen=True, slots=True)
class Activity:
    """What the heartbeat reports of the relay's activity."""

    breaker: BreakerState
    in_flight: int  # rows claimed and not yet settled
    # Why the breaker is not closed, in the sink's words (None: closed).
    breaker_reason: str | None = None


@dataclass
class Sampler:
    """Samples the backlog into `metrics` (`sample`) and keeps `instance`'s heartbeat
    (`beat`), each a chore the daemon runs every sample interval; `bound` limits each scan
    (tests make it small). While a chore fails, the gauges keep their last values."""

    store: Store
    metrics: RelayMetrics
    lease_s: float  # relay.lease_s: leases are looked for among the rows due that soon
    instance: InstanceInfo
    activity: Callable[[], Activity]
    housekeeping: Housekeeping
    bound: int = BACKLOG_BOUND
    last: Backlog | None = None
    _log: FilteringBoundLogger = field(default_factory=lambda: get_logger("sampler"))

    async def sample(self) -> Backlog:
        backlog = await sample_backlog(self.store, lease_s=self.lease_s, bound=self.bound)
        self.metrics.set_backlog(backlog)
        self.last = backlog
        return backlog

    def summary(self) -> str | None:
        """The last sample in a few words (systemd's STATUS= line); None before the first."""
        if self.last is None:
            return None
        backlog = self.last
        age = backlog.oldest_claimable_age_s or 0.0
        paused = ", paused" if backlog.any_pause else ""
        keys = "1 key" if backlog.parked == 1 else f"{backlog.parked:,} keys"
        parked = f", {keys} parked" if backlog.parked else ""
        return (
            f"{backlog.ready:,} ready, oldest claimable {age:.0f}s, {backlog.dead:,} dead"
            f"{paused}{parked}"
        )

    async def beat(self) -> None:
        activity = self.activity()
        instance = self.instance
        await self.store.heartbeat(
            Heartbeat(
                instance_id=instance.instance_id,
                host=instance.host,
                pid=instance.pid,
                version=instance.version,
                started_at=instance.started_at,
                breaker_state=activity.breaker.name.lower(),
                in_flight=activity.in_flight,
                housekeeping=self.housekeeping.as_json(),
                breaker_reason=activity.breaker_reason,
            )
        )

    async def forget(self) -> None:
        """Remove the heartbeat (a clean stop); if PostgreSQL is away, leave it to turn
        stale."""
        try:
            async with asyncio.timeout(_FORGET_TIMEOUT_S):
                await self.store.heartbeat_delete(self.instance.instance_id)
        except (DatabaseUnavailable, StatementError, TimeoutError) as exc:
            self._log.warning("sampler.heartbeat_left", error=str(exc) or type(exc).__name__)
