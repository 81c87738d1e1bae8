"""Run the OJS emulator and `relayd run` as child processes, as an operator would (used by
`relayd demo` and the benchmarks)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

_READY_TIMEOUT_S = 30.0
# `relayd` as this interpreter runs it.
RELAYD = (sys.executable, "-m", "relayd")
_STOP_TIMEOUT_S = 20.0


@asynccontextmanager
async def emulator_process(base: Path) -> AsyncIterator[str]:
    """`relayd emulator` on a free loopback port, logging to base/emulator.log; yields its URL."""
    port = free_port()
    log = (base / "emulator.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relayd",
        "emulator",
        "--listen",
        f"127.0.0.1:{port}",
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await await_http(f"{url}/ojs/v1/health", process)
        yield url
    finally:
        await terminate(process)
        log.close()


@asynccontextmanager
async def relay_process(
    base: Path,
    dsn: str,
    sink_url: str | None,
    metrics_port: int,
    *,
    command: Sequence[str] = RELAYD,
    **settings: str,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`relayd run` configured by environment (plus RELAYD_* `settings`; with no `sink_url`,
    they configure the sink), logging to base/relayd.log; yields once its /healthz answers,
    drains it with SIGTERM on exit. `command`: how `relayd` is run (this interpreter's)."""
    config = base / "relayd.toml"
    config.write_text("")
    env = (
        {k: v for k, v in os.environ.items() if not k.startswith("RELAYD_")}
        | {
            "RELAYD_CONFIG": str(config),
            "RELAYD_DATABASE__DSN": dsn,
            "RELAYD_HTTP__LISTEN": f"127.0.0.1:{metrics_port}",
            "RELAYD_LOG__FORMAT": "json",
        }
        | ({"RELAYD_SINK__URL": sink_url} if sink_url is not None else {})
        | settings
    )
    log = (base / "relayd.log").open("wb")
    process = await asyncio.create_subprocess_exec(*command, "run", env=env, stdout=log, stderr=log)
    try:
        await await_http(f"http://127.0.0.1:{metrics_port}/healthz", process)
        yield process
    finally:
        await terminate(process)
        log.close()


async def await_http(url: str, process: asyncio.subprocess.Process) -> None:
    """Return once `url` answers 200; fail if the process exits first."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(_READY_TIMEOUT_S):
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"a child process exited early (code {process.returncode})")
            try:
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)


async def terminate(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (relayd drains), then SIGKILL if it takes too long."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(_STOP_TIMEOUT_S):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
