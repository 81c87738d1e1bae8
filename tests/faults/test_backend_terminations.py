"""PostgreSQL terminates relayd's sessions (what a restart or a failover does), again and
again, idle and under load: `relayd run` reconnects every time, never exits, and every row
is published once (C1, C2)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import asyncpg

from relayd.testing.emulator import RunningEmulator
from relayd.testing.processes import free_port, relay_process
from tests.faults.checker import assert_clean, check, install_history
from tests.support import Database, drained, eventually, produce

TERMINATE = """
SELECT count(pg_terminate_backend(pid))
FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'relayd%'
"""


async def _terminate(admin: asyncpg.Connection) -> int:
    killed: int = await admin.fetchval(TERMINATE)
    return killed


async def test_relay_survives_repeated_backend_terminations(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, tmp_path: Path
) -> None:
    """1. idle: every relayd session terminated 5 times; 2. under load: terminated at seeded
    random moments (mid-claim, mid-settle, while listening) 40 times; 3. healed: everything
    drains, each job created once, nothing dead; 4. SIGTERM exits 0 with no crash logged."""
    rng = random.Random(6)
    await install_history(conn)
    admin = await asyncpg.connect(database.dsn)
    settings = {
        "RELAYD_RELAY__WORKERS": "4",
        "RELAYD_RELAY__BATCH_SIZE": "20",
        "RELAYD_RELAY__LEASE_S": "5",
        "RELAYD_RELAY__POLL_INTERVAL_S": "0.2",
        "RELAYD_SINK__TIMEOUT_S": "2",
        "RELAYD_RETRY__BASE_S": "0.05",
        "RELAYD_RETRY__CAP_S": "0.5",
    }
    try:
        async with relay_process(
            tmp_path, database.dsn, emulator.url, free_port(), **settings
        ) as process:
            # 1. Idle: the workers wait on LISTEN and the poll timer.
            for _ in range(5):
                await eventually(lambda: _sessions_up(admin), timeout_s=30)
                assert await _terminate(admin) > 0
                await asyncio.sleep(0.3)
                assert process.returncode is None
            # 2. Under load.
            ids: list[str] = []

            async def producer() -> None:
                for _ in range(60):
                    ids.extend(await produce(conn, 50))
                    await asyncio.sleep(rng.uniform(0.0, 0.05))

            producing = asyncio.create_task(producer())
            killed = 0
            for _ in range(40):
                await asyncio.sleep(rng.uniform(0.01, 0.2))
                killed += await _terminate(admin)
                assert process.returncode is None
            await producing
            assert killed >= 40
            # 3. Healed.
            await eventually(lambda: drained(conn), timeout_s=90)
            assert process.returncode is None
        # 4. relay_process sent SIGTERM on leaving the block.
        assert process.returncode == 0
    finally:
        await admin.close()
    ledger = emulator.emulator.ledger()
    assert set(ledger) == set(ids)
    assert {entry.created for entry in ledger.values()} == {1}
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL") == 0
    events = [
        json.loads(line)["event"]
        for line in (tmp_path / "relayd.log").read_text().split("\n")
        if line.startswith("{")
    ]
    assert "daemon.task_crashed" not in events
    assert "relay.database_unavailable" in events
    assert events[-1] == "daemon.stopped"
    assert_clean(await check(conn, emulator.emulator.ledger_json()))


async def _sessions_up(admin: asyncpg.Connection) -> bool:
    """relayd's pool and its LISTEN session are both connected."""
    names = await admin.fetch(
        "SELECT application_name FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name LIKE 'relayd%'"
    )
    return {"relayd", "relayd-listen"} <= {r[0] for r in names}
