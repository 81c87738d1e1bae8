"""`relayd run` as a process: SIGTERM drains (C8), a second signal exits at once."""

from __future__ import annotations

import asyncio
import json
import signal

import asyncpg

from relayd.testing.emulator import start_emulator
from relayd.testing.emulator.faults import FaultRule
from tests.support import (
    Database,
    drained,
    eventually,
    pending,
    produce,
    relay_settings,
    running,
    start_relayd,
)

GRACE_S = 5.0


def _env(base: dict[str, str], dsn: str, sink_url: str, **extra: str) -> dict[str, str]:
    return (
        base
        | {
            "RELAYD_DATABASE__DSN": dsn,
            "RELAYD_SINK__URL": sink_url,
            "RELAYD_SINK__BATCH": "off",
            "RELAYD_SINK__CONCURRENCY": "8",
            "RELAYD_RELAY__BATCH_SIZE": "20",
            "RELAYD_RELAY__SHUTDOWN_GRACE_S": str(GRACE_S),
            "RELAYD_HTTP__ENABLED": "false",
            "RELAYD_LOG__FORMAT": "json",
        }
        | extra
    )


async def _start(env: dict[str, str]) -> asyncio.subprocess.Process:
    return await start_relayd("run", env=env)


def _events(stderr: bytes) -> dict[str, dict[str, object]]:
    events: dict[str, dict[str, object]] = {}
    for line in stderr.decode().splitlines():
        record = json.loads(line)
        events[str(record["event"])] = record
    return events


async def test_sigterm_drains_and_another_relay_finishes(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    """C8: 1. publish a while; 2. SIGTERM; 3. exit 0 within the grace period, nothing left
    leased; 4. a second relay publishes the rest, each job created once."""
    ids = await produce(conn, 3000)
    async with await start_emulator() as sink:
        # A slow sink keeps attempts in flight when the signal lands.
        sink.emulator.add_fault(
            FaultRule(
                action="latency", method="POST", path_prefix="/ojs/v1/jobs", delay_ms=50, times=None
            )
        )
        process = await _start(_env(cli_env, database.dsn, sink.url))
        loop = asyncio.get_running_loop()
        try:
            # 1.
            async with asyncio.timeout(60):
                await sink.emulator.wait_until(lambda e: len(e.ledger()) >= 100)
            # 2.
            signalled_at = loop.time()
            process.send_signal(signal.SIGTERM)
            # 3.
            async with asyncio.timeout(GRACE_S + 15):
                _, stderr = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 0, stderr.decode()[-2000:]
        assert loop.time() - signalled_at < GRACE_S + 2
        assert (
            await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE lease_owner IS NOT NULL")
            == 0
        )
        events = _events(stderr)
        assert events["daemon.stopped"]["abandoned"] == 0
        assert events["daemon.stopped"]["exit_code"] == 0
        assert "daemon.draining" in events
        left = await pending(conn)
        assert 0 < left < len(ids)  # it really stopped mid-backlog
        # 4.
        sink.emulator.clear_faults()
        async with running(relay_settings(database.dsn, sink.url)):
            await eventually(lambda: drained(conn))
        ledger = sink.emulator.ledger()
    assert set(ledger) == set(ids)
    assert {e.created for e in ledger.values()} == {1}


async def test_second_signal_exits_at_once(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    """C8: with attempts stuck on a very slow sink, a second SIGTERM exits without waiting
    out the grace period; the leases are simply left to expire."""
    await produce(conn, 50)
    async with await start_emulator() as sink:
        stall = sink.emulator.add_fault(
            FaultRule(
                action="latency",
                method="POST",
                path_prefix="/ojs/v1/jobs",
                delay_ms=60_000,
                times=None,
            )
        )
        env = _env(
            cli_env,
            database.dsn,
            sink.url,
            RELAYD_RELAY__SHUTDOWN_GRACE_S="60",
            RELAYD_SINK__TIMEOUT_S="30",
            RELAYD_RELAY__LEASE_S="90",
        )
        process = await _start(env)

        async def stuck() -> bool:  # eight POSTs have reached the sink and hang there
            return sink.emulator.fault_fired(stall) >= 8

        try:
            await eventually(stuck, timeout_s=60)
            process.send_signal(signal.SIGTERM)
            # Signals of one kind do not queue: send the second once the first was handled.
            assert process.stderr is not None
            seen = b""
            async with asyncio.timeout(10):
                while b"daemon.draining" not in seen:
                    seen += await process.stderr.readline()
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                _, rest = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 1
        assert "daemon.forced_exit" in _events(seen + rest)
        assert (
            await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE lease_owner IS NOT NULL")
            > 0
        )


async def test_sighup_drains_like_sigterm(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    """A closed terminal (SIGHUP) drains and exits 0 instead of killing relayd mid-batch."""
    await produce(conn, 200)
    async with await start_emulator() as sink:
        sink.emulator.add_fault(
            FaultRule(
                action="latency", method="POST", path_prefix="/ojs/v1/jobs", delay_ms=20, times=None
            )
        )
        process = await _start(_env(cli_env, database.dsn, sink.url))
        try:
            async with asyncio.timeout(60):
                await sink.emulator.wait_until(lambda e: len(e.ledger()) >= 20)
            process.send_signal(signal.SIGHUP)
            async with asyncio.timeout(GRACE_S + 15):
                _, stderr = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, stderr.decode()[-2000:]
    events = _events(stderr)
    assert events["daemon.signal"]["signal"] == "SIGHUP"
    assert events["daemon.stopped"]["abandoned"] == 0
    leased = await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE lease_owner IS NOT NULL")
    assert leased == 0
