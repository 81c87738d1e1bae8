"""`--json` is for scripts: every command that takes it prints one JSON document on stdout
and nothing else, for every destination kind, with its server up and with it down; what the
command logs on the way (a sink refusing a connection) goes to stderr."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest
from nats.js.api import StreamConfig

from relayd.settings import to_toml
from relayd.testing.emulator import start_emulator
from relayd.testing.nats import NatsServer
from relayd.testing.processes import free_port
from relayd.testing.webhook_receiver import receiving
from tests.support import Database, park_key, rows_in_every_state, run_relayd

pytestmark = pytest.mark.slow

SECRET = "whsec_" + base64.b64encode(b"j" * 32).decode()
STREAM = "ORDERS"
# The types rows_in_every_state commits, each routed where a kind routes by type.
TYPES = ("test.echo", "mail.send")
# Parked keys, one for each action of `relayd keys`.
KEYS = ("order-1", "order-2", "order-3")


@contextlib.asynccontextmanager
async def _destination(kind: str, *, up: bool, base: Path) -> AsyncIterator[dict[str, Any]]:
    """The `[sink]` of a kind: its server running while the block runs (`up`), or an
    address where nothing listens."""
    quick: dict[str, Any] = {"timeout_s": 2.0, "connect_timeout_s": 1.0}
    nowhere = f"127.0.0.1:{free_port()}"
    if kind == "ojs":
        if not up:
            yield quick | {"kind": kind, "url": f"http://{nowhere}"}
            return
        async with await start_emulator() as emulator:
            yield quick | {"kind": kind, "url": emulator.url}
    elif kind == "nats":
        routes = [{"type": t, "subject": f"orders.{t}"} for t in TYPES]
        sink = quick | {"kind": kind, "stream": STREAM, "routes": routes}
        if not up:
            yield sink | {"servers": [f"nats://{nowhere}"]}
            return
        with NatsServer() as server:
            client = await nats.connect(server.url)
            try:
                await client.jetstream().add_stream(
                    StreamConfig(name=STREAM, subjects=["orders.>"])
                )
            finally:
                await client.close()
            yield sink | {"servers": [server.url]}
    else:
        secret_file = base / "webhook-secret"
        secret_file.write_text(SECRET + "\n")
        sink = quick | {"kind": kind, "secret_file": str(secret_file)}
        if not up:
            yield sink | {"url": f"http://{nowhere}/hooks"}
            return
        async with receiving([SECRET]) as receiver:
            yield sink | {"url": receiver.endpoint()}


def _commands(ids: dict[str, list[str]]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """Every command that takes --json: those that change nothing (run side by side), then
    those that do, in an order that leaves each something to show (a pause holding rows
    while `held` runs)."""
    dead = ids["dead"][0]
    readers = [
        ("check", "--json"),
        ("check", "--role", "operator", "--json"),
        ("config", "show", "--json"),
        ("grants", "--role", "producer", "--json"),
        ("doctor", "--json"),
        ("status", "--json"),
        ("dlq", "list", "--json"),
        ("dlq", "show", dead, "--json"),
        ("dlq", "retry", "--all", "--dry-run", "--json"),
        ("dlq", "discard", "--all", "--dry-run", "--reason", "scripted", "--json"),
        ("keys", "list", "--json"),
        ("keys", "retry", KEYS[0], "--dry-run", "--json"),
    ]
    writers = [
        ("migrate", "--json"),
        ("dlq", "retry", dead, "--reason", "scripted", "--json"),
        ("pause", "--queue", "mail", "--reason", "scripted", "--json"),
        ("held", "list", "--json"),
        ("held", "discard", "--all", "--dry-run", "--reason", "scripted", "--json"),
        ("resume", "--queue", "mail", "--json"),
        ("keys", "retry", KEYS[0], "--reason", "scripted", "--json"),
        ("keys", "skip", KEYS[1], "--reason", "scripted", "--json"),
        ("keys", "release", KEYS[2], "--json"),
    ]
    return readers, writers


async def _only_json(
    command: tuple[str, ...], config: Path, env: dict[str, str], *, up: bool
) -> None:
    """Run one command: its stdout is one JSON document, whatever its exit code (check
    fails with the sink down, doctor may judge a tiny table's plan); check's sink line says
    whether the sink was up, so both cases are what they claim."""
    code, out, err = await run_relayd(*command, "--config", str(config), env=env)
    where = f"relayd {' '.join(command)} (exit {code}):\n{out}{err}"
    try:
        document = json.loads(out)
    except ValueError:
        pytest.fail(f"stdout is not one JSON document: {where}")
    assert "Traceback" not in err, where
    if command[0] == "check":
        [line] = [line for line in document if line["name"] == "sink"]
        assert line["verdict"] == ("ok" if up else "fail"), where
        assert code == (0 if up else 1), where
    else:
        assert code in ((0, 1) if command[0] == "doctor" else (0,)), where


@pytest.mark.parametrize("up", [True, False], ids=["sink-up", "sink-down"])
@pytest.mark.parametrize("kind", ["ojs", "nats", "webhook"])
async def test_every_json_output_is_only_json(
    cli_env: dict[str, str], database: Database, tmp_path: Path, kind: str, up: bool
) -> None:
    """Each command's stdout, run with the kind's configuration, parses whole as JSON."""
    conn = await asyncpg.connect(database.dsn)
    try:
        ids = await rows_in_every_state(conn)
        for key in KEYS:
            await park_key(conn, key, 2, job_type="test.echo")
    finally:
        await conn.close()
    readers, writers = _commands(ids)
    async with _destination(kind, up=up, base=tmp_path) as sink:
        config = tmp_path / "relayd.toml"
        config.write_text(to_toml({"database": {"dsn": database.dsn}, "sink": sink}))
        await asyncio.gather(*(_only_json(c, config, cli_env, up=up) for c in readers))
        for command in writers:
            await _only_json(command, config, cli_env, up=up)
