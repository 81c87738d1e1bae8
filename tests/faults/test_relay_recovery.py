"""A relay restarted after a crash takes its rows back in seconds, not after a whole lease
(docs/contract.md, C4): killed with SIGKILL holding claims it had sent, and started again at
once on the same runtime directory, it finds its dead predecessor's slot and makes that
process's leases due now; each row is reconciled (or read back) before it is sent again.
A live relay keeps its claims, whatever becomes of its database connection; a relay of
another slot, or another runtime directory (another host), never takes them."""

from __future__ import annotations

import base64
import signal
import time
from pathlib import Path

from relayd.testing.webhook_receiver import receiving
from tests.faults import scenarios
from tests.faults.harness import Process, Scene
from tests.faults.nats_stage import NatsStage
from tests.faults.scenarios import OVERWRITE, leases

# Long: rows due again within RESTART_BOUND_S of the restart were taken back, not let go by
# the end of their lease.
LEASE_S = "30"
RESTART_BOUND_S = 2.0
SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()


def _runtime(scene: Scene, name: str = "run") -> Path:
    directory = scene.base / name
    directory.mkdir()
    return directory


def _on(runtime: Path) -> dict[str, str]:
    return {"RELAYD_RELAY__RUNTIME_DIR": str(runtime), "RELAYD_RELAY__LEASE_S": LEASE_S}


async def _restarted_within_the_bound(scene: Scene, heir: Process, left: dict[str, str]) -> None:
    """Every row the dead relay held is settled within RESTART_BOUND_S of its heir's
    answering, long before the dead relay's lease ends; the heir says what it took back."""
    started = time.monotonic()
    await scene.drained(timeout_s=RESTART_BOUND_S)
    assert time.monotonic() - started < RESTART_BOUND_S
    assert f'"rows": {len(left)}' in heir.log(), heir.log()[-2000:]
    assert '"daemon.leases_taken_back"' in heir.log()


async def test_a_relay_killed_holding_claims_takes_them_back_at_its_restart(
    scene: Scene,
) -> None:
    """OJS, on a sink that overwrites a reused id: 1. the relay dies (SIGKILL) just before
    settling claims it has sent; 2. started again at once on the same runtime directory, it
    takes its predecessor's leases back and every row is published within 2 s of the
    restart, 0 lost and 0 created twice (the checker)."""
    await scene.start_sink(*OVERWRITE)
    runtime = _runtime(scene)
    await scene.produce(80)
    # 1.
    doomed = await scene.relay(
        "doomed", failpoints="before_settle=exit@1", ready=False, env=_on(runtime)
    )
    assert await doomed.wait() == -signal.SIGKILL
    left = await leases(scene)
    assert left
    # 2.
    heir = await scene.relay("heir", env=_on(runtime))
    await _restarted_within_the_bound(scene, heir, left)
    await scene.check()


async def test_a_nats_relay_killed_holding_claims_stores_nothing_twice(
    stage: NatsStage,
) -> None:
    """NATS: the same, and the stream holds each event once (the heir's re-sends are read
    back as the dead relay's stores)."""
    await stage.add_stream()
    runtime = _runtime(stage.scene)
    await stage.produce(80)
    doomed = await stage.relay(
        "doomed", failpoints="before_settle=exit@1", ready=False, env=_on(runtime)
    )
    assert await doomed.wait() == -signal.SIGKILL
    left = await leases(stage.scene)
    assert left
    heir = await stage.relay("heir", env=_on(runtime))
    await _restarted_within_the_bound(stage.scene, heir, left)
    await stage.check()


async def test_a_webhook_relay_killed_holding_claims_delivers_them_again(scene: Scene) -> None:
    """Webhooks: the same; the receiver, verifying every signature, is delivered each row the
    dead relay sent a second time (same webhook-id, for it to deduplicate) and every other
    row once."""
    await scene.start_sink()  # the scene's relays need one; these deliver elsewhere
    runtime = _runtime(scene)
    secret_file = scene.base / "whsec"
    secret_file.write_text(SECRET + "\n")
    ids = await scene.produce(80, meta={"occurred_at": "2024-05-01T12:00:00Z"})
    async with receiving([SECRET]) as receiver:
        webhook = {
            "RELAYD_SINK__KIND": "webhook",
            "RELAYD_SINK__URL": receiver.endpoint(),
            "RELAYD_SINK__SECRET_FILE": str(secret_file),
        } | _on(runtime)
        doomed = await scene.relay(
            "doomed", failpoints="before_settle=exit@1", ready=False, env=webhook
        )
        assert await doomed.wait() == -signal.SIGKILL
        left = await leases(scene)
        assert left
        heir = await scene.relay("heir", env=webhook)
        await _restarted_within_the_bound(scene, heir, left)
    assert sorted(receiver.stored) == sorted(ids)
    assert receiver.refused == []
    assert {i for i, seen in receiver.seen.items() if seen > 1} <= set(left)


async def test_a_live_relay_cut_off_from_the_database_keeps_its_claims(scene: Scene) -> None:
    """The negative control of the tests above: a relay alive but cut from PostgreSQL keeps
    its claims until their lease ends; a relay starting beside it takes none of them early
    (the mutant `lost_connection_is_death`, which does, is caught: tests/faults/
    test_mutants.py)."""
    await scenarios.alive_but_cut_off(scene)


async def test_relays_take_back_only_their_own_slots_leases(scene: Scene) -> None:
    """Two relays on one host, one runtime directory: A (slot 0) holds claims and lives on;
    B (slot 1) dies holding claims. A relay of another runtime directory (another host, as
    far as identities go) takes back none of B's; B restarted takes back B's alone, and A
    settles its own as ever."""
    await scene.start_sink(*OVERWRITE)
    runtime = _runtime(scene)
    one = {"RELAYD_RELAY__WORKERS": "1"}
    first = await scene.produce(20)
    alive = await scene.relay("alive", failpoints="before_settle=delay:12", env=_on(runtime) | one)
    await alive.fired("before_settle")
    held = await leases(scene)
    assert set(held) == set(first)
    await scene.produce(20)
    doomed = await scene.relay(
        "doomed", failpoints="before_settle=exit@1", ready=False, env=_on(runtime) | one
    )
    assert await doomed.wait() == -signal.SIGKILL
    dead = {i: owner for i, owner in (await leases(scene)).items() if i not in held}
    assert len(dead) == 20
    elsewhere = await scene.relay("elsewhere", env=_on(_runtime(scene, "other")) | one)
    await elsewhere.logged('"daemon.started"')
    assert '"daemon.leases_taken_back"' not in elsewhere.log()
    assert await leases(scene) == held | dead  # nothing taken from either
    assert await elsewhere.stop() == 0
    heir = await scene.relay("heir", env=_on(runtime) | one)
    await heir.logged('"daemon.leases_taken_back"')
    assert '"slot": 1' in heir.log()
    assert '"rows": 20' in heir.log()
    still = await leases(scene)
    assert {i: still.get(i) for i in held} == held  # A's claims are still A's
    await scene.drained()
    assert await alive.stop() == 0
    assert '"relay.stale_settle"' not in alive.log()  # A settled its own claims
    await scene.check()
