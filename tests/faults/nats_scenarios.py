"""The NATS scenarios that a negative control (tests/faults/test_mutants.py) runs again
against a broken relay, shared with tests/faults/test_nats_faults.py (no test module imports
another); `on_nats` runs one on a plain Scene, with a nats-server of its own."""

from __future__ import annotations

import asyncio
import functools
import random
import signal
from collections.abc import Awaitable, Callable

from relayd.testing.nats import read_stream
from tests.faults.harness import Process, Scene
from tests.faults.nats_stage import STREAM, NatsStage, nats_stage
from tests.faults.order_checker import OrderReport, check_order
from tests.faults.ordered import zipf_keys

DRAIN_TIMEOUT_S = 90.0


def on_nats(scenario: Callable[[NatsStage], Awaitable[None]]) -> Callable[[Scene], Awaitable[None]]:
    """`scenario` as a Scene's scenario: it gets a NatsStage on that scene."""

    @functools.wraps(scenario)
    async def run(scene: Scene) -> None:
        async with nats_stage(scene, scene.base) as stage:
            await scenario(stage)

    return run


async def kill_9_at_a_step(stage: NatsStage, point: str, *, atomic: bool = False) -> None:
    """200 events; the relay dies (SIGKILL) the second time it reaches `point`; its leases
    are ended in SQL; another relay publishes the rest; the checker reads the stream.
    `atomic`: the stream takes atomic batches (atomic-marker mode where supported)."""
    await stage.add_stream(atomic=atomic)
    await stage.produce(200)
    doomed = await stage.relay("doomed", failpoints=f"{point}=exit@2", ready=False)
    assert await doomed.wait() == -signal.SIGKILL
    await stage.scene.expire_leases()
    await stage.relay("restarted")
    await stage.scene.drained(DRAIN_TIMEOUT_S)
    await stage.check()


async def same_id_different_body(stage: NatsStage, *, atomic: bool = False) -> None:
    """30 events, one of whose ids already holds another message in the stream; the relay
    must dead-letter that one `conflict` and publish the rest."""
    await stage.add_stream(atomic=atomic)
    ids = await stage.produce(30)
    await stage.plant(ids[7], b'{"someone":"else"}')
    await stage.relay("relay")
    await stage.scene.drained(DRAIN_TIMEOUT_S)
    await stage.check()
    assert await stage.scene.dead() == {ids[7]: "conflict"}


async def ordered_keys_under_faults(
    stage: NatsStage, *, events: int = 3000, keys: int = 300, rounds: int = 12, seed: int = 7
) -> tuple[OrderReport, int]:
    """Ordered delivery with the key in the subject: `events` over `keys` (Zipf sizes),
    committed in `rounds` waves to two relays behind proxies; after each wave one fault, by
    turns: a relay killed with SIGKILL and restarted, its next PubAcks lost, its connection
    cut with publishes in flight; one relay frozen past its lease. Returns the ordering
    checker's report over the stream (in stream order) and the kills. The stream checker
    (each event once, each fenced by the message before it on its subject) runs too."""
    rng = random.Random(seed)
    stage.keyed = True
    await stage.add_stream()
    drawn = zipf_keys(events, keys, seed=seed)
    proxies = {name: await stage.proxy() for name in ("a", "b")}
    runtime = {name: stage.scene.base / f"run-{name}" for name in proxies}
    for directory in runtime.values():
        directory.mkdir()

    async def start(name: str, label: str) -> Process:
        env = {"RELAYD_RELAY__RUNTIME_DIR": str(runtime[name])}
        return await stage.relay(label, through=proxies[name], env=env)

    relays = {name: await start(name, name) for name in proxies}
    rows: dict[str, tuple[str, int]] = {}
    kills = 0
    wave = -(-events // rounds)
    for turn in range(rounds):
        rows |= await stage.produce_keyed(drawn[turn * wave : (turn + 1) * wave])
        await asyncio.sleep(0.2)
        name = sorted(relays)[turn % 2]
        fault = "freeze" if turn == rounds // 2 else ("kill", "acks", "cut", "kill")[turn % 4]
        if fault == "freeze":
            # Frozen past its lease (3 s), then thawed: its late settles are stale.
            relays[name].signal(signal.SIGSTOP)
            await asyncio.sleep(4)
            relays[name].signal(signal.SIGCONT)
        elif fault == "acks":
            proxies[name].drop_acks(3)
        elif fault == "cut":
            proxies[name].cut_after(rng.randint(1, 20))
        else:
            await relays[name].kill()
            kills += 1
            relays[name] = await start(name, f"{name}{kills}")
    await stage.scene.drained(max(DRAIN_TIMEOUT_S, events / 20))
    for relay in relays.values():
        await relay.stop()
    messages = await read_stream(stage.client, STREAM)
    report = check_order([m.event_id for m in messages], rows, dead=set())
    await stage.check()
    return report, kills


async def ordered_keys(stage: NatsStage) -> None:
    """`ordered_keys_under_faults` as a scenario: every key in commit order, nothing lost,
    each event stored once."""
    report, _ = await ordered_keys_under_faults(stage, events=600, keys=60)
    assert report.clean, report
    assert report.repeats == 0, report
