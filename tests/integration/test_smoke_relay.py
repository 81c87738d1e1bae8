"""A first end-to-end check: rows in, jobs on the sink."""

from __future__ import annotations

from typing import Any

import asyncpg

from relayd.testing.emulator import RunningEmulator
from tests.conftest import Database
from tests.integration.relayhelp import drained, eventually, produce, relay_settings, running


async def test_rows_reach_the_sink(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """Committed rows are published once each and marked published."""
    ids = await produce(conn, 500)
    async with running(relay_settings(database.dsn, emulator.url)):
        await eventually(lambda: drained(conn))
    ledger = emulator.emulator.ledger()
    assert set(ledger) == set(ids)
    assert all(entry.created == 1 for entry in ledger.values())
    published: Any = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NOT NULL"
    )
    assert published == 500
