"""The NATS scenarios that a negative control (tests/faults/test_mutants.py) runs again
against a broken relay, shared with tests/faults/test_nats_faults.py (no test module imports
another); `on_nats` runs one on a plain Scene, with a nats-server of its own."""

from __future__ import annotations

import functools
import signal
from collections.abc import Awaitable, Callable

from tests.faults.harness import Scene
from tests.faults.nats_stage import NatsStage, nats_stage

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
