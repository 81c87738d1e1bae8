"""The fault suite's switches live outside the product: relayd reads neither
RELAYD_TEST_FAILPOINTS nor RELAYD_TEST_MUTANT (tests/faults/test_test_switches.py runs a real
relay with both set); only the test launcher installs them, and then a drain reaches every
place."""

from __future__ import annotations

import re
from pathlib import Path

import asyncpg
import pytest

from relayd.testing.emulator import RunningEmulator
from tests.faults.switches import failpoints
from tests.faults.switches.launch import install
from tests.faults.switches.patches import Patches
from tests.support import Database, produce, relay_settings, run_until_idle

RELAYD = Path(__file__).resolve().parents[3] / "relayd"
# What arms a switch, named anywhere in a module: the test suite's modules or the variables.
_ARMING = re.compile(
    r"\btests\.faults\b|\bfrom tests\b|\bimport tests\b|RELAYD_TEST_(?:FAILPOINTS|MUTANT)"
)


def test_no_module_of_the_package_knows_a_test_switch() -> None:
    """No module of relayd (its test doubles included) names the switches or imports
    anything of the test suite, which holds them: they ship in no wheel."""
    modules = sorted(RELAYD.rglob("*.py"))
    named = [str(p.relative_to(RELAYD)) for p in modules if _ARMING.search(p.read_text())]
    assert named == []
    assert len(modules) > 80  # the scan did read the package


async def test_the_launcher_installs_failpoints_the_drain_then_reaches(
    database: Database,
    conn: asyncpg.Connection,
    emulator: RunningEmulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Installed as the launcher does, a failpoint armed to do nothing harmful is reached by
    a drain at each place of the cycle; restored, nothing is reached."""
    reached: list[str] = []

    async def recording_reach(point: failpoints.Point) -> None:
        reached.append(point)

    monkeypatch.setattr(failpoints, "reach", recording_reach)
    patches = Patches()
    install({failpoints.ENV: "after_claim=delay:0"}, patches)
    try:
        await produce(conn, 30)
        await run_until_idle(relay_settings(database.dsn, emulator.url))
    finally:
        patches.restore()
        failpoints.arm({})
    assert {"after_claim", "before_post", "after_2xx", "before_settle", "after_settle"} <= set(
        reached
    )
    reached.clear()
    await produce(conn, 10)
    await run_until_idle(relay_settings(database.dsn, emulator.url))
    assert reached == []
