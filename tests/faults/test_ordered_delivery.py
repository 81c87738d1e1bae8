"""Ordered delivery under faults (docs/ordering.md): two relays, killed with SIGKILL and
restarted by turns, one frozen past its lease, transient refusals on 5 % of the events and
a few permanent ones; every key reaches the sink in commit order, nothing is lost, the keys
whose head was refused for good are parked with their later rows waiting, and the outbox's
history passes the transition checker. The negative control (a claim that takes a key's
newest row) is in tests/faults/test_mutants.py."""

from __future__ import annotations

from tests.faults.harness import Scene
from tests.faults.ordered import ordered_delivery_holds, summary


async def test_each_key_in_commit_order_through_kills_freezes_and_refusals(scene: Scene) -> None:
    run = await ordered_delivery_holds(scene, events=8000, keys=800)
    print(summary(run))  # noqa: T201 - the run's figures, shown with -s
    assert run.kills >= 2, summary(run)
    assert run.report.delivered == len(run.rows) - len(run.waiting), summary(run)
    await scene.check(waiting=run.waiting)
