"""A relay whose wall clock is an hour off (libfaketime; its monotonic clock left alone):
leases, due times and backoffs all come from the database's clock, so nothing changes. A
relay that took "now" from its own clock would write leases an hour long (or already over),
and its rows would wait an hour after it died, or be taken from it while it worked.
"""

from __future__ import annotations

import json
import signal
from datetime import UTC, datetime

import pytest

from tests.faults.harness import Scene
from tests.tools import library

OVERWRITE = ("--duplicate-mode", "overwrite")
# Debian's libfaketime (package faketime); other layouts put it elsewhere under /usr/lib.
_LIBRARIES = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def _libfaketime() -> str:
    return library("libfaketime", "faketime", _LIBRARIES)


@pytest.mark.parametrize("shift_s", [3600, -3600], ids=["ahead", "behind"])
async def test_a_relay_whose_wall_clock_is_an_hour_off(scene: Scene, shift_s: int) -> None:
    """The shifted relay publishes its first batch and dies (kill -9) right after its
    second claim. A relay on the right clock takes those rows over once their lease (3 s of
    the database's clock) runs out, waited for in real time, not ended in SQL."""
    shifted_env = {
        "LD_PRELOAD": _libfaketime(),
        "FAKETIME": f"{shift_s:+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    await scene.start_sink(*OVERWRITE)
    await scene.produce(60)
    shifted = await scene.relay(
        "shifted",
        failpoints="after_claim=exit@2",
        ready=False,
        RELAYD_RELAY__WORKERS="1",
        **shifted_env,
    )
    assert await shifted.wait() == -signal.SIGKILL
    # Its clock really was off: its log's timestamps are.
    stamp = next(
        json.loads(line)["timestamp"]
        for line in shifted.log().splitlines()
        if line.startswith("{") and '"timestamp"' in line
    )
    skew_s = (datetime.fromisoformat(stamp) - datetime.now(UTC)).total_seconds()
    assert abs(skew_s - shift_s) < 120, f"the relay's clock was {skew_s:+.0f} s off"
    held = await scene.conn.fetchval(
        f"SELECT count(*) FROM {scene.sql_table} "
        "WHERE lease_owner IS NOT NULL AND published_at IS NULL"
    )
    assert held > 0, "the shifted relay held nothing when it died"
    await scene.relay("heir")
    await scene.drained(timeout_s=20)
    assert await scene.dead() == {}
    await scene.check()
