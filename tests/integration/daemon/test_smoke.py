"""A first end-to-end check: rows in, jobs on the sink."""

from __future__ import annotations

from typing import Any

import asyncpg

from relayd.testing.emulator import RunningEmulator
from relayd.testing.emulator.faults import FaultRule
from tests.support import Database, drained, produce, relay_settings, run_until_idle


async def test_rows_reach_the_sink(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """Committed rows are published once each and marked published."""
    ids = await produce(conn, 500)
    await run_until_idle(relay_settings(database.dsn, emulator.url))
    assert await drained(conn)
    ledger = emulator.emulator.ledger()
    assert set(ledger) == set(ids)
    assert all(entry.created == 1 for entry in ledger.values())
    published: Any = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NOT NULL"
    )
    assert published == 500


async def test_run_until_idle_waits_for_rows_in_backoff(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """The run-until-idle mode returns only once nothing is pending: rows waiting out a
    backoff after a 503 (or leased by another worker) keep it running."""
    ids = await produce(conn, 100)
    for event_id in ids[:10]:
        emulator.emulator.add_fault(
            FaultRule(action="status", status=503, method="POST", job_id=event_id, times=2)
        )
    daemon = await run_until_idle(relay_settings(database.dsn, emulator.url, sink={"batch": "off"}))
    assert await drained(conn)
    assert set(emulator.emulator.ledger()) == set(ids)
    retried = daemon.metrics.registry.get_sample_value(
        "relayd_outcomes_total", {"outcome": "retried"}
    )
    assert retried is not None
    assert retried >= 10
