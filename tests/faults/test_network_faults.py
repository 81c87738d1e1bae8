"""The network between relayd and its two peers misbehaves: a fault proxy in front of the sink
or of PostgreSQL adds latency, swallows everything (blackhole), resets, freezes half-open or
slices the stream into tiny writes; and, where the kernel lets the test make a network
namespace, nftables drops or resets the sink's packets. Every fault heals; the outbox drains,
nothing is dead-lettered, and the checker finds nothing lost, duplicated or falsely published.

Faults that degrade (latency, slicing) must not stop publishing: the outbox drains while they
last. Faults that cut (blackhole, reset, half-open) must stop it, without dead-lettering or
using up attempts; publishing resumes once they heal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from relayd.testing.processes import free_port
from tests.faults.harness import Process, Scene, Sink
from tests.faults.netfaults import (
    FaultProxy,
    Mode,
    NetNs,
    bridge_argv,
    bridge_env,
    netns,
)
from tests.support import relayd_argv
from tests.tools import root, tool

OVERWRITE = ("--duplicate-mode", "overwrite")
ROWS = 120
# How long a cutting fault lasts once it showed: longer than the sink's timeout (1 s), so
# attempts time out, the breaker opens and database statements wait.
OUTAGE_S = 1.5

DEGRADING = (Mode.LATENCY, Mode.SLICING)
CUTTING = (Mode.BLACKHOLE, Mode.RESET, Mode.HALF_OPEN)


@contextlib.asynccontextmanager
async def _proxy(proxy: FaultProxy) -> AsyncIterator[FaultProxy]:
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


async def _published_during(scene: Scene, seconds: float) -> int:
    before = await scene.published()
    await asyncio.sleep(seconds)  # the fault must last a while
    return await scene.published() - before


async def _evidence(scene: Scene, relay: Process, target: str, proxy: FaultProxy) -> None:
    """Wait until the fault has visibly hit the relay's traffic."""
    if target == "sink":
        # A failed attempt is recorded (the database is healthy): timeouts, resets.
        await scene.until(
            f"SELECT count(*) > 0 FROM {scene.sql_table} "
            "WHERE last_error IS NOT NULL AND published_at IS NULL"
        )
        return
    # The database is what fails: the relay's statements fail or hang.
    async with asyncio.timeout(30):
        while not (
            proxy.stats.resets
            or proxy.stats.swallowed_bytes
            or "database_unavailable" in relay.log()
        ):
            if proxy.mode is Mode.HALF_OPEN:
                break  # nothing to see: every statement just waits
            await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    ("target", "mode"),
    [
        *(("database", mode) for mode in (*DEGRADING, *CUTTING)),
        ("sink", Mode.LATENCY),
        ("sink", Mode.SLICING),
        *(("sink", mode) for mode in CUTTING),
    ],
)
async def test_fault_proxy_then_heal(scene: Scene, target: str, mode: Mode) -> None:
    """A fault proxy in front of `target` switches to `mode` mid-run, with rows published
    before, during and after the fault; then it heals."""
    sink = await scene.start_sink(*OVERWRITE)
    proxy = FaultProxy.for_url(sink.url) if target == "sink" else FaultProxy.for_dsn(scene.dsn)
    proxy.latency_s = 0.3 if target == "sink" else 0.05
    async with _proxy(proxy):
        await scene.produce(ROWS)
        if target == "sink":
            relay = await scene.relay("relay", RELAYD_SINK__URL=proxy.url_through(sink.url))
        else:
            relay = await scene.relay("relay", RELAYD_DATABASE__DSN=proxy.dsn_through(scene.dsn))
        await scene.until(
            f"SELECT count(*) >= 20 FROM {scene.sql_table} WHERE published_at IS NOT NULL"
        )
        await proxy.set_mode(mode)
        await scene.produce(ROWS)
        if mode in DEGRADING:
            # Slower, or in pieces, but everything still goes out while the fault lasts.
            await scene.drained()
            assert proxy.stats.delayed_chunks or proxy.stats.sliced_writes
        else:
            await _evidence(scene, relay, target, proxy)
            # Settles of answers that arrived before the cut may still land: then nothing.
            await asyncio.sleep(0.3)
            assert await _published_during(scene, OUTAGE_S) == 0
            assert relay.returncode is None
            await proxy.heal()
            await scene.drained()
        assert await relay.stop() == 0
    assert await scene.dead() == {}
    # A cut costs no row its retry budget: nothing came near max_attempts (10).
    worst = await scene.conn.fetchval(f"SELECT max(attempts) FROM {scene.sql_table}")
    assert worst <= 5, f"a row used {worst} attempts"
    assert "daemon.task_crashed" not in relay.log()
    await scene.check()


# --- nftables in a private network namespace -----------------------------------------------


def require_netns() -> None:
    """Skip (or fail, where tools are required: tests/tools.py) unless a private network
    namespace with nftables can be made here: root, `ip` and `nft`."""
    root("network namespaces")
    tool("ip", "iproute2")
    tool("nft", "nftables")


@pytest.fixture
async def space() -> AsyncIterator[NetNs]:
    require_netns()
    try:
        async with netns() as made:
            yield made
    except RuntimeError as exc:
        if "netns add" in str(exc) or "link set" in str(exc):
            pytest.skip(f"cannot make a network namespace here: {exc}")
        raise


async def _sink_in(space: NetNs, scene: Scene) -> tuple[int, aiohttp.ClientSession]:
    """The emulator inside `space`, and a session that reaches it from here through a bridge
    (a Unix socket served from inside, connecting from 127.0.0.2)."""
    port = free_port()
    proc = await scene.spawn(
        "sink",
        [*space.prefix(), *relayd_argv("emulator", "--listen", f"127.0.0.1:{port}", *OVERWRITE)],
        {},
    )
    socket_path = scene.base / "sink.sock"
    bridge = await scene.spawn(
        "bridge",
        [*space.prefix(), *bridge_argv(socket_path, f"127.0.0.1:{port}", "127.0.0.2")],
        bridge_env(),
    )
    await bridge.logged("bridge ready")
    http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path)))
    url = f"http://127.0.0.1:{port}"
    async with asyncio.timeout(30):
        while True:
            assert proc.returncode is None, proc.log()
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/ojs/v1/health") as answer:
                    if answer.status == 200:
                        break
            await asyncio.sleep(0.05)
    sink = Sink(url=url, proc=proc, http=http)
    scene.sink = sink
    return port, http


def _rule(port: int, verdict: str) -> str:
    """The relay's packets to the sink (from 127.0.0.1; the bridge's come from 127.0.0.2),
    and the sink's to the relay, meet `verdict`."""
    back = (
        ""
        if verdict.startswith("reject")
        else (f"        ip daddr 127.0.0.1 tcp sport {port} {verdict}\n")
    )
    return (
        "table inet relayd_fault {\n"
        "    chain out {\n"
        "        type filter hook output priority 0; policy accept;\n"
        f"        ip saddr 127.0.0.1 tcp dport {port} {verdict}\n"
        f"{back}"
        "    }\n"
        "}\n"
    )


@pytest.mark.parametrize("verdict", ["drop", "reject with tcp reset"])
async def test_nftables_cuts_the_sink_inside_a_network_namespace(
    space: NetNs, scene: Scene, verdict: str
) -> None:
    """relayd and the emulator run inside a namespace of their own; nftables drops (or
    resets) the relay's packets to the sink, then the rule is deleted. Nothing is published
    during the cut, nothing dead-lettered, everything once after it."""
    port, http = await _sink_in(space, scene)
    try:
        # The database is reached over its Unix socket (a file): a namespace does not cut it,
        # but a TCP server (RELAYD_TEST_DSN) would be out of reach, so go through a socket.
        db = FaultProxy.for_dsn(scene.dsn, listen_unix=scene.base / "pg" / ".s.PGSQL.5432")
        (scene.base / "pg").mkdir()
        async with _proxy(db):
            env = scene.relay_env("relay", "127.0.0.1:0") | {
                "RELAYD_DATABASE__DSN": db.dsn_through(scene.dsn),
                "RELAYD_HTTP__ENABLED": "false",
            }
            relay = await scene.spawn("relay", [*space.prefix(), *relayd_argv("run")], env)
            await relay.logged('"daemon.started"')
            await scene.produce(ROWS)
            await scene.until(
                f"SELECT count(*) >= 20 FROM {scene.sql_table} WHERE published_at IS NOT NULL"
            )
            await space.nft(_rule(port, verdict))
            await scene.produce(ROWS)
            await scene.until(
                f"SELECT count(*) > 0 FROM {scene.sql_table} "
                "WHERE last_error IS NOT NULL AND published_at IS NULL"
            )
            await asyncio.sleep(0.3)
            assert await _published_during(scene, OUTAGE_S) == 0
            await space.nft("delete table inet relayd_fault\n")
            await scene.drained()
            assert await relay.stop() == 0
        errors = {
            json.loads(line).get("error", "")
            for line in relay.log().splitlines()
            if '"relay.retry_scheduled"' in line
        }
        # Dropped: no answer, or no connection, within the deadlines; reset: a new connection
        # refused, or a kept-alive one reset under a request.
        expected = ("deadline", "timed out") if verdict == "drop" else ("cannot connect", "reset")
        assert any(word in error for error in errors for word in expected), errors
        assert await scene.dead() == {}
        await scene.check()
    finally:
        await http.close()
