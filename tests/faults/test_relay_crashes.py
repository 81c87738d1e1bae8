"""Relay processes killed, stopped and terminated at every step of the cycle: whatever the
moment, a clean relay finishes the work, no job is created twice on a sink that overwrites a
reused id, and the checker finds nothing lost, unexpected, duplicated or falsely published."""

from __future__ import annotations

import random
import signal

import pytest

from tests.faults import scenarios
from tests.faults.harness import Scene

# A sink that silently overwrites a reused id: a second POST of a published row shows in its
# ledger as an overwrite, which the checker reports as a duplicate.
OVERWRITE = ("--duplicate-mode", "overwrite")


@pytest.mark.parametrize("point", ["after_claim", "before_post", "after_2xx", "before_settle"])
async def test_kill_9_at_a_step_of_the_cycle(scene: Scene, point: str) -> None:
    """The relay dies (SIGKILL) the second time it reaches `point`; its leases are ended in
    SQL; a clean relay publishes the rest, reconciling what may already be on the sink."""
    await scenarios.kill_9_at_a_step(scene, point)


async def test_kill_9_while_settling_during_a_drain(scene: Scene) -> None:
    """SIGTERM arrives while an attempt is in flight; the relay dies as it settles."""
    await scene.start_sink(*OVERWRITE)
    await scene.produce(40)
    doomed = await scene.relay(
        "doomed", failpoints="before_post=delay:0.5@1;during_drain=exit", ready=False
    )
    await doomed.fired("before_post")
    doomed.signal(signal.SIGTERM)
    assert await doomed.wait() == -signal.SIGKILL
    assert "failpoint during_drain: exit" in doomed.log()
    await scene.expire_leases()
    await scene.relay("heir")
    await scene.drained()
    await scene.check()


@pytest.mark.parametrize("point", ["before_post", "after_2xx"])
async def test_sigstop_past_the_lease_then_sigcont(scene: Scene, point: str) -> None:
    """A relay freezes (a stalled VM) at `point` for longer than its lease; another relay
    takes the rows over and publishes them; the first resumes: it must not POST (its claim
    is too old), and its late settle must change nothing (counted stale)."""
    await scenarios.sigstop_past_the_lease(scene, point)


async def test_sigterm_mid_batch_finishes_or_releases(scene: Scene) -> None:
    """SIGTERM while batches are in flight: the relay drains (exit 0), publishing or
    releasing what it holds; a second relay finds the rest due at once."""
    await scene.start_sink(*OVERWRITE)
    await scene.produce(200)
    first = await scene.relay("first", failpoints="before_post=delay:0.3")
    await first.fired("before_post")
    first.signal(signal.SIGTERM)
    assert await first.wait() == 0
    await scene.relay("second")
    await scene.drained()
    await scene.check()


async def test_sigterm_during_a_sink_outage(scene: Scene) -> None:
    """The sink answers 503 to everything; SIGTERM: the relay stops promptly (exit 0),
    dead-letters nothing, and the rows publish once the sink is back."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults({"action": "status", "status": 503, "path_prefix": "/ojs/v1/jobs"})
    await scene.produce(50)
    first = await scene.relay("first")
    await scene.until(f"SELECT count(*) > 0 FROM {scene.sql_table} WHERE last_error IS NOT NULL")
    first.signal(signal.SIGTERM)
    assert await first.wait() == 0
    assert await scene.dead() == {}
    await sink.clear_faults()
    await scene.relay("second")
    await scene.drained()
    await scene.check()


async def test_relays_killed_and_restarted_at_random_under_load(scene: Scene) -> None:
    """Three relays share the outbox while rows keep arriving; six times one of them, chosen
    by a seeded generator, is killed with SIGKILL mid-work and started again."""
    rng = random.Random(11)
    await scene.start_sink(*OVERWRITE)
    relays = {name: await scene.relay(name) for name in ("r0", "r1", "r2")}
    for round_ in range(6):
        before = await scene.published()
        await scene.produce(60)
        victim = rng.choice(sorted(relays))
        # Kill it once some of the new rows went out: mid-work, at a seeded point.
        progress = before + rng.randint(1, 50)
        await scene.until(
            f"SELECT count(*) >= {progress} FROM {scene.sql_table} WHERE published_at IS NOT NULL"
        )
        await relays[victim].kill()
        relays[victim] = await scene.relay(f"{victim}-{round_}")
    await scene.drained()
    for proc in relays.values():
        assert await proc.stop() == 0
    await scene.check()
