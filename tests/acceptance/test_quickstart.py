"""The README's quick start per destination, run from the README's own text: each
`<!-- quickstart: KIND -->` block of shell commands runs in bash in a directory of its own
(beside the clone's example configurations), as a new user would paste it; then the README's
SQL commits events, and each arrives at the real server the block started (the OJS emulator,
nats-server, the verifying receiver).

Only what names this machine is changed in the text: the DSN (the test's database), the
ports (free ones), `.venv/bin/` (this interpreter's directory). A line ending in `&` starts
a server: the script waits until its port answers, as a reader waits for its banner."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import asyncpg
import nats
import pytest
from nats.errors import NoServersError
from nats.js.errors import NotFoundError

from relayd.testing.nats import read_stream
from relayd.testing.processes import free_port
from tests.support import Database, relayd_env

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOC_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
_BLOCK = re.compile(r"<!-- quickstart: (\w+) -->\n```(\w+)\n(.*?)```", re.DOTALL)
_DEADLINE_S = 90.0


def quickstart(kind: str) -> str:
    """The README's block for `kind` (`event`: the SQL that commits one event)."""
    blocks: dict[str, str] = {
        name: body for name, _language, body in _BLOCK.findall(README.read_text())
    }
    return blocks[kind]


def _output(path: Path) -> str:
    """What the block printed so far."""
    return path.read_text(errors="replace")


def test_the_readme_has_a_quick_start_per_destination() -> None:
    blocks = {name for name, _language, _body in _BLOCK.findall(README.read_text())}
    assert blocks == {"ojs", "nats", "webhook", "event"}


# A port as the blocks name one: an address on loopback, or nats-server's flag.
_PORT = re.compile(r"127\.0\.0\.1:(\d+)|--port (\d+)")


def _ports(text: str) -> list[int]:
    return [int(a or b) for a, b in _PORT.findall(text)]


def _script(kind: str, dsn: str) -> tuple[str, dict[int, int]]:
    """The block as this machine runs it, and the ports it moved (documented -> free)."""
    text = quickstart(kind).replace(DOC_DSN, "@DSN@")
    text = text.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    ports = {documented: free_port() for documented in _ports(text)}
    for documented, free in ports.items():
        text = re.sub(rf"\b{documented}\b", str(free), text)
    text = text.replace("@DSN@", dsn)
    lines = []
    for line in text.splitlines():
        lines.append(line)
        if line.rstrip().endswith("&"):
            [port] = _ports(line)
            lines.append(
                f"until (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; do sleep 0.05; done"
            )
    return "set -euo pipefail\n" + "\n".join(lines) + "\n", ports


@contextlib.asynccontextmanager
async def _running(
    kind: str, dsn: str, where: Path
) -> AsyncIterator[tuple[asyncio.subprocess.Process, dict[int, int], Path]]:
    """The block running in bash (its last command, `relayd run`, in the foreground) in
    its own process group, stopped with SIGTERM (every server it started with it)."""
    script, ports = _script(kind, dsn)
    for shipped in ("config.example.toml", "examples"):
        (where / shipped).symlink_to(ROOT / shipped)
    out = where / "stdout"
    env = relayd_env({"RELAYD_HTTP__LISTEN": f"127.0.0.1:{free_port()}"})
    with out.open("wb") as sink:
        shell = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script,
            cwd=where,
            env=env,
            stdout=sink,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield shell, ports, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGTERM)
        async with asyncio.timeout(30):
            await shell.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)


async def _commit_events(conn: asyncpg.Connection, count: int) -> list[str]:
    """The README's SQL, `count` times, each its own transaction: the ids it made (the
    test's outbox held none before)."""
    for _ in range(count):
        await conn.execute(quickstart("event"))
    rows = await conn.fetch("SELECT event_id::text FROM relayd.outbox")
    assert len(rows) == count
    return [row["event_id"] for row in rows]


@pytest.mark.parametrize("kind", ["ojs", "nats", "webhook"])
async def test_the_readme_quick_start_reaches_a_real_server(
    kind: str, database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    async with _running(kind, database.dsn, tmp_path) as (shell, ports, out):
        # The test's outbox is migrated already (the block's `relayd migrate` finds it up
        # to date): commit as the README says, whether the relay is up yet or not.
        ids = await _commit_events(conn, 3)
        async with asyncio.timeout(_DEADLINE_S):
            while not await _arrived(kind, ids, ports, out):
                assert shell.returncode is None, _output(out)
                await asyncio.sleep(0.1)
    published = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NOT NULL"
    )
    assert published == len(ids), _output(out)


async def _arrived(kind: str, ids: list[str], ports: dict[int, int], out: Path) -> bool:
    """Whether every id is at the server the block started, read from the server itself (not
    yet, while the block has not started it)."""
    if kind == "ojs":
        return await _at_the_ojs_server(ids, ports[8080])
    if kind == "nats":
        return await _in_the_stream(ids, ports[4222])
    verified = re.findall(r'"verified": "([0-9a-f-]+)"', _output(out))
    return set(ids) <= set(verified)


async def _at_the_ojs_server(ids: list[str], port: int) -> bool:
    try:
        async with aiohttp.ClientSession() as session:
            for event_id in ids:
                url = f"http://127.0.0.1:{port}/ojs/v1/jobs/{event_id}"
                async with session.get(url) as answer:
                    if answer.status != 200:
                        return False
    except aiohttp.ClientConnectionError:
        return False
    return True


async def _in_the_stream(ids: list[str], port: int) -> bool:
    try:
        client = await nats.connect(
            f"nats://127.0.0.1:{port}", allow_reconnect=False, connect_timeout=1
        )
    except (OSError, NoServersError):
        return False
    try:
        stored = {message.event_id for message in await read_stream(client, "EVENTS")}
    except NotFoundError:  # the stream, before the block adds it
        return False
    finally:
        await client.close()
    return set(ids) <= stored
