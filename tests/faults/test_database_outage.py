"""PostgreSQL unavailable at start or mid-run: relayd waits and reconnects, never crashes,
and loses nothing (C1)."""

from __future__ import annotations

import asyncio
import random

import asyncpg

from relayd.daemon.lifecycle import Daemon
from relayd.telemetry.metrics import RelayMetrics
from relayd.testing.emulator import RunningEmulator
from tests.faults.checker import assert_clean, check, install_history
from tests.support import Database, TcpProxy, drained, eventually, pending, produce, relay_settings


def _errors(daemon: Daemon) -> float:
    value = daemon.metrics.registry.get_sample_value("relayd_database_errors_total")
    return value or 0.0


async def test_database_down_at_start_then_back(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, proxy: TcpProxy
) -> None:
    """1. PostgreSQL unreachable: the daemon waits, not ready, no crash; 2. it comes back:
    the daemon starts and drains the outbox."""
    await install_history(conn)
    ids = await produce(conn, 100)
    await proxy.cut()
    settings = relay_settings(proxy.dsn_through(database.dsn), emulator.url)
    daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(1))
    task = asyncio.create_task(daemon.run())

    async def retried_twice() -> bool:
        return _errors(daemon) >= 2

    # 1. Connection attempts fail and are retried; the task is alive and not ready.
    await eventually(retried_twice)
    assert not task.done()
    assert not daemon.ready.is_set()
    # 2.
    await proxy.restore()
    async with asyncio.timeout(30):
        await daemon.ready.wait()
    await eventually(lambda: drained(conn))
    daemon.stop()
    assert await task == 0
    assert set(emulator.emulator.ledger()) == set(ids)
    assert_clean(await check(conn, emulator.emulator.ledger_json()))


async def test_database_lost_mid_run_then_back(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, proxy: TcpProxy
) -> None:
    """1. publishing; 2. every connection reset and refused; 3. statements fail, the daemon
    keeps running; 4. back: the rest drains, each job created once, nothing dead."""
    await install_history(conn)
    ids = await produce(conn, 3000)
    settings = relay_settings(
        proxy.dsn_through(database.dsn),
        emulator.url,
        relay={"batch_size": 20},
        sink={"batch": "off"},
    )
    daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(2))
    task = asyncio.create_task(daemon.run())
    async with asyncio.timeout(30):
        await daemon.ready.wait()
        # 1.
        await emulator.emulator.wait_until(lambda e: len(e.ledger()) >= 300)
    # 2.
    await proxy.cut()

    async def failing() -> bool:
        return _errors(daemon) >= 3

    # 3.
    await eventually(failing)
    assert not task.done()
    assert await pending(conn) > 0
    # 4.
    await proxy.restore()
    await eventually(lambda: drained(conn), timeout_s=60)
    daemon.stop()
    assert await task == 0
    ledger = emulator.emulator.ledger()
    assert set(ledger) == set(ids)
    assert {e.created for e in ledger.values()} == {1}
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL") == 0
    assert_clean(await check(conn, emulator.emulator.ledger_json()))
