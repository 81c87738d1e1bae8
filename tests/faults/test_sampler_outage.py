"""The backlog sampler rides out a PostgreSQL outage like the other loops: it backs off,
counts the failures, keeps its last gauges, and samples again once the server is back."""

from __future__ import annotations

import asyncio
import random

import asyncpg

from relayd.core.retry import Backoff, BreakerState
from relayd.daemon.sampler import Activity, InstanceInfo, Sampler
from relayd.engine.chores import Chore, Housekeeping
from relayd.store import Store
from relayd.store import outage as reconnect
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.metrics import RelayMetrics
from tests.support import Database, TcpProxy, eventually, produce


async def test_sampler_survives_a_database_outage(
    database: Database, conn: asyncpg.Connection, proxy: TcpProxy
) -> None:
    """1. sampling; 2. PostgreSQL cut: failures counted, the task alive, the timestamp
    frozen; 3. back: new rows are sampled and the timestamp moves on."""
    metrics = RelayMetrics()
    value = metrics.registry.get_sample_value
    store = await Store.connect(proxy.dsn_through(database.dsn), database.table, max_size=2)
    stopping = asyncio.Event()
    retry = DatabaseRetry(
        Backoff(base_s=reconnect.BASE_S, cap_s=reconnect.CAP_S, rng=random.Random(3)), metrics
    )
    housekeeping = Housekeeping(metrics, retry, stopping)
    sampler = Sampler(
        store=store,
        metrics=metrics,
        lease_s=30.0,
        instance=InstanceInfo(),
        activity=lambda: Activity(BreakerState.CLOSED, 0),
        housekeeping=housekeeping,
    )
    task = asyncio.create_task(housekeeping.every(Chore.SAMPLER, 0.1, sampler.sample))
    try:
        await produce(conn, 3)

        async def sampled(rows: int) -> bool:
            return value("relayd_outbox_rows", {"state": "ready"}) == rows

        # 1.
        await eventually(lambda: sampled(3))
        # 2.
        await proxy.cut()

        async def failing() -> bool:
            return (value("relayd_database_errors_total") or 0) >= 2

        await eventually(failing)
        frozen = value("relayd_backlog_sampled_timestamp_seconds")
        await produce(conn, 2)
        assert not task.done()
        assert value("relayd_backlog_sampled_timestamp_seconds") == frozen
        assert value("relayd_outbox_rows", {"state": "ready"}) == 3
        # 3.
        await proxy.restore()
        await eventually(lambda: sampled(5))
        now = value("relayd_backlog_sampled_timestamp_seconds")
        assert frozen is not None
        assert now is not None
        assert now > frozen
    finally:
        stopping.set()
        async with asyncio.timeout(10):
            await task
        await store.close()
