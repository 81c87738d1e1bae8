"""Failpoints are inert when unarmed: a whole drain never reaches one. The same drain with
one armed (to do nothing harmful) reaches it, so the count below can tell the two apart."""

from __future__ import annotations

import asyncpg
import pytest

from relayd import failpoints
from relayd.testing.emulator import RunningEmulator
from tests.support import Database, produce, relay_settings, run_until_idle


@pytest.mark.parametrize("armed", [False, True])
async def test_a_drain_reaches_failpoints_only_when_armed(
    database: Database,
    conn: asyncpg.Connection,
    emulator: RunningEmulator,
    monkeypatch: pytest.MonkeyPatch,
    armed: bool,
) -> None:
    reached: list[str] = []

    async def recording_reach(point: failpoints.Point) -> None:
        reached.append(point)

    monkeypatch.setattr(failpoints, "reach", recording_reach)
    failpoints.arm({failpoints.ENV: "after_claim=delay:0"} if armed else {})
    try:
        await produce(conn, 30)
        await run_until_idle(relay_settings(database.dsn, emulator.url))
    finally:
        failpoints.arm({})
    if armed:
        assert "after_claim" in reached
        assert "before_post" in reached
    else:
        assert reached == []
