"""Ordered delivery on NATS with the key in the subject (docs/nats.md#ordered-routes), under
faults: two `relayd run` processes behind proxies, killed with SIGKILL and restarted by
turns, their PubAcks lost and their connections cut with publishes in flight, one frozen
past its lease. Each key's subject holds its events in commit order, each once, each
published expecting the sequence of the one before it."""

from __future__ import annotations

from tests.faults.nats_scenarios import ordered_keys_under_faults
from tests.faults.nats_stage import NatsStage


async def test_each_keys_subject_in_commit_order_once_through_kills_cuts_and_lost_acks(
    stage: NatsStage,
) -> None:
    report, kills = await ordered_keys_under_faults(stage, events=4000, keys=400)
    print(f"{report.delivered} delivered, {report.repeats} repeats, {kills} kills")  # noqa: T201
    assert kills == 6  # turns 0, 3, 4, 7, 8 and 11 of 12
    assert report.clean, report
    assert report.delivered == 4000
    assert report.repeats == 0, "the fence stores each event once"
