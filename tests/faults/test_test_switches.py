"""A real `relayd run` started with the fault suite's switches in its environment (a
failpoint that would kill it at its first claim, a mutant that would drop the fence) runs
unchanged: relayd reads neither, only the test launcher does."""

from __future__ import annotations

from relayd.testing.processes import free_port
from tests.faults.harness import Scene, await_ok
from tests.support import relayd_argv


async def test_a_relay_ignores_test_switches_in_its_environment(scene: Scene) -> None:
    """It drains every row, stops cleanly (exit 0) and never says a failpoint fired or a
    mutant was installed; the checker finds nothing wrong."""
    await scene.start_sink()
    ids = await scene.produce(40)
    listen = f"127.0.0.1:{free_port()}"
    env = scene.relay_env(
        "relay",
        listen,
        RELAYD_TEST_FAILPOINTS="after_claim=exit",
        RELAYD_TEST_MUTANT="unfenced_settle",
    )
    relay = await scene.spawn("relay", relayd_argv("run"), env)
    await await_ok(scene.http, f"http://{listen}/healthz", relay)
    await scene.drained()
    assert await scene.published() == len(ids)
    assert await relay.stop() == 0
    assert "failpoint" not in relay.log()
    assert "mutant" not in relay.log()
    await scene.check()
