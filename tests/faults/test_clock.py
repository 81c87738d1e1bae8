"""A relay whose wall clock is an hour off (libfaketime; its monotonic clock left alone):
leases, due times and backoffs all come from the database's clock, so nothing changes. A
relay that took "now" from its own clock would write leases an hour long (or already over),
and its rows would wait an hour after it died, or be taken from it while it worked.
"""

from __future__ import annotations

import pytest

from tests.faults import scenarios
from tests.faults.harness import Scene


@pytest.mark.parametrize("shift_s", [3600, -3600], ids=["ahead", "behind"])
async def test_a_relay_whose_wall_clock_is_an_hour_off(scene: Scene, shift_s: int) -> None:
    """The shifted relay publishes its first batch and dies (kill -9) right after its
    second claim. A relay on the right clock takes those rows over once their lease (3 s of
    the database's clock) runs out, waited for in real time, not ended in SQL."""
    await scenarios.a_wall_clock_off(scene, shift_s)
