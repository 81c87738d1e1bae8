"""The NATS scenarios' stage: the fault suite's `Scene` (a test database with the transition
history, processes logging under tmp_path) with a real nats-server (the dev extra's binary,
its store under tmp_path) in place of the emulator, `relayd run` processes configured for
`[sink] kind = "nats"`, and the checker reading the stream at the end.

A scenario reads as the OJS ones do: add the stream (or not), produce events, start relays
(some armed to fail, some behind a `NatsProxy`), let the fault happen, heal, wait for the
outbox to drain, and `await stage.check()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js.api import StreamConfig

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from relayd.producer import new_job
from relayd.testing.nats import NatsServer
from relayd.testing.processes import free_port
from tests.faults.checker import Report
from tests.faults.harness import FAST, Process, Scene, await_ok, child_env
from tests.faults.nats_proxy import NatsProxy
from tests.faults.ordered import insert_keyed
from tests.faults.stream_checker import Expected, check_stream
from tests.support import relayd_argv, run_relayd

STREAM = "EVENTS"
SOURCE = "/orders-service"
EVENT_TYPE = "order.updated"
SUBJECT = "events.orders"
ROUTES = [{"type": EVENT_TYPE, "subject": SUBJECT}]
# An ordered route whose subject holds the ordering key (a subject per key, each publish
# fenced by the subject's last sequence).
KEYED_SUBJECT = "events.orders.{key}"
KEYED_ROUTES = [{"type": EVENT_TYPE, "subject": KEYED_SUBJECT, "ordering": "key"}]
WHEN = "2024-05-01T12:00:00Z"
MARKER_PREFIX = "relayd.markers"
SWITCHES = ("RELAYD_TEST_FAILPOINTS", "RELAYD_TEST_MUTANT")


@dataclass
class NatsStage:
    """A Scene, a nats-server, a client of it (setup and reading back) and the proxies."""

    scene: Scene
    server: NatsServer
    client: Client
    proxies: list[NatsProxy] = field(default_factory=list)
    # Messages a scenario put in the stream under an event's id: id -> body.
    planted: dict[str, bytes] = field(default_factory=dict)
    # Each relay's HTTP port (/metrics, /healthz), by name.
    http_ports: dict[str, int] = field(default_factory=dict)

    # The relays' route is ordered, its subject holding the key (KEYED_ROUTES).
    keyed: bool = False
    # The stream takes atomic batches and the marker subjects: relayd runs the route in
    # atomic-marker mode where the server supports it (NATS 2.12.1+), window mode elsewhere.
    atomic: bool = False
    # lease_s - sink.timeout_s of the scene's relays (FAST's unless a scenario says
    # otherwise): the latest a message may be stored after its claim.
    send_window_s: float = float(FAST["RELAYD_RELAY__LEASE_S"]) - float(
        FAST["RELAYD_SINK__TIMEOUT_S"]
    )

    async def add_stream(self, *, atomic: bool = False, **config: Any) -> None:
        subjects = ["events.>", f"{MARKER_PREFIX}.*"] if atomic else ["events.>"]
        if atomic:
            config["allow_atomic"] = True
        await self.client.jetstream().add_stream(
            StreamConfig(name=STREAM, subjects=subjects, **config)
        )
        self.atomic = atomic

    async def plant(self, event_id: str, body: bytes) -> None:
        """Store another message under `event_id` (a conflict for relayd to find)."""
        await self.client.jetstream().publish(SUBJECT, body, headers={"Nats-Msg-Id": event_id})
        self.planted[event_id] = body

    async def produce(self, count: int) -> list[str]:
        """Commit `count` events (data {"n": i}) in one transaction; their ids."""
        meta = {META_VERSION: 1, META_OCCURRED_AT: WHEN}
        return await self.scene.produce(count, job_type=EVENT_TYPE, meta=meta)

    async def produce_keyed(
        self, keys: list[str], *, chunk: int = 1000
    ) -> dict[str, tuple[str, int]]:
        """Commit one event per entry of `keys` (its ordering key), `chunk` a transaction;
        each event's (key, number within its key) by id."""
        meta = {META_VERSION: 1, META_OCCURRED_AT: WHEN}
        rows: dict[str, tuple[str, int]] = {}
        for start in range(0, len(keys), chunk):
            part = keys[start : start + chunk]
            jobs = [
                new_job(EVENT_TYPE, [{"key": key, "n": start + i}], meta=meta)
                for i, key in enumerate(part)
            ]
            rows |= await insert_keyed(self.scene.conn, self.scene.sql_table, jobs, part)
        return rows

    async def proxy(self) -> NatsProxy:
        """A started `NatsProxy` in front of the server (closed with the stage)."""
        proxy = NatsProxy.for_url(self.server.url)
        await proxy.start()
        self.proxies.append(proxy)
        return proxy

    async def relay(
        self,
        name: str,
        *,
        through: NatsProxy | None = None,
        failpoints: str | None = None,
        ready: bool = True,
        env: Mapping[str, str] | None = None,
        **settings: str,
    ) -> Process:
        """`relayd run` with the suite's FAST settings and the NATS sink (the server, or the
        proxy `through`), then `env` and `settings` as RELAYD_* variables."""
        port = self.http_ports[name] = free_port()
        variables = self.settings(name, through=through) | {
            "RELAYD_HTTP__LISTEN": f"127.0.0.1:{port}",
        }
        if failpoints:
            variables["RELAYD_TEST_FAILPOINTS"] = failpoints
        if self.scene.mutant:
            variables["RELAYD_TEST_MUTANT"] = self.scene.mutant
        variables |= dict(env or {}) | settings
        switched = any(variables.get(key) for key in SWITCHES)
        proc = await self.scene.spawn(name, relayd_argv("run", switched=switched), variables)
        if ready:
            await await_ok(self.scene.http, f"http://127.0.0.1:{port}/healthz", proc)
        return proc

    def settings(self, name: str, *, through: NatsProxy | None = None) -> dict[str, str]:
        """The suite's FAST settings, this scene's database and outbox, and the NATS sink
        (the server, or the proxy `through`), as RELAYD_* variables; `name` names the
        (empty) configuration file."""
        config = self.scene.base / f"{name}.toml"
        config.write_text("")
        return dict(FAST) | {
            "RELAYD_CONFIG": str(config),
            "RELAYD_DATABASE__DSN": self.scene.dsn,
            "RELAYD_OUTBOX__TABLE": self.scene.table,
            "RELAYD_SINK__KIND": "nats",
            "RELAYD_SINK__SERVERS": (through.url if through else self.server.url),
            "RELAYD_SINK__STREAM": STREAM,
            "RELAYD_SINK__ROUTES": json.dumps(KEYED_ROUTES if self.keyed else ROUTES),
            "RELAYD_SINK__SOURCE": SOURCE,
            "RELAYD_SINK__CONCURRENCY": "16",
        }

    async def operator(self, *args: str) -> str:
        """`relayd ARGS` (an operator's command: `status`, `dlq list`) with the relays'
        settings; its stdout, once it exited 0."""
        code, out, err = await run_relayd(*args, env=child_env(self.settings("operator")))
        assert code == 0, err
        return out

    async def check(self) -> Report:
        """The history checker over the outbox and the stream (tests/faults/
        stream_checker.py); fails the test with every violation."""
        expected = Expected(
            STREAM,
            SOURCE,
            {EVENT_TYPE: KEYED_SUBJECT if self.keyed else SUBJECT},
            self.planted,
            markers=MARKER_PREFIX if self.atomic and self._batches() else None,
            send_window_s=self.send_window_s,
        )
        return await check_stream(self.scene.conn, self.client, expected, table=self.scene.table)

    def _batches(self) -> bool:
        """Whether the server publishes atomic batches (2.12.1 or later)."""
        version = self.client.connected_server_version
        return (version.major, version.minor, version.patch) >= (2, 12, 1)

    async def close(self) -> None:
        for proxy in self.proxies:
            await proxy.close()
        await self.client.close()


@contextlib.asynccontextmanager
async def nats_stage(scene: Scene, base: Path) -> AsyncIterator[NatsStage]:
    """A NatsStage on `scene`, its server's store under `base`; all stopped on exit."""
    server = NatsServer(base / "nats")
    await asyncio.to_thread(server.start)
    try:
        # The reading client reconnects across a server restart on its own.
        client = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        stage = NatsStage(scene=scene, server=server, client=client)
        try:
            yield stage
        finally:
            await scene.close()  # relays first, while the server still answers them
            await stage.close()
    finally:
        await asyncio.to_thread(server.close)
