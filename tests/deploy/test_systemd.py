"""deploy/systemd/relayd.service and `relayd run` under systemd's notify protocol."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from relayd.settings import CREDENTIALS
from relayd.sinks.registry import kinds
from relayd.testing.emulator import RunningEmulator
from tests.deploy.conftest import DEPLOY
from tests.support import Database, relayd_argv, run_relayd_blocking

UNIT = DEPLOY / "systemd" / "relayd.service"
MAX_EXPOSURE = 2.0
GRACE_S = 1.0
# prctl(2) options: PR_SET_MDWE with PR_MDWE_REFUSE_EXEC_GAIN is the kernel's own form of
# MemoryDenyWriteExecute= (Linux 6.3+); PR_SET_NO_NEW_PRIVS is NoNewPrivileges=.
_PR_SET_MDWE, _PR_MDWE_REFUSE_EXEC_GAIN, _PR_SET_NO_NEW_PRIVS = 65, 1, 38

# Run relayd the way the unit's sandbox would leave it: no writable-and-executable memory,
# no new privileges, files private to the user; exit 77 where the kernel cannot do that.
_HARDENED = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl({_PR_SET_MDWE}, {_PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0:
    sys.exit(77)
if libc.prctl({_PR_SET_MDWE + 1}, 0, 0, 0, 0) != {_PR_MDWE_REFUSE_EXEC_GAIN}:  # PR_GET_MDWE
    sys.exit(1)
if libc.prctl({_PR_SET_NO_NEW_PRIVS}, 1, 0, 0, 0) != 0:
    sys.exit(1)
os.umask(0o077)
argv = {relayd_argv("run")!r}
os.execv(argv[0], argv)
"""


def unit_settings(path: Path = UNIT) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment of a unit file, in order."""
    settings: list[tuple[str, str, str]] = []
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.append((section, key.strip(), value.strip()))
    return settings


def unit_value(key: str) -> str:
    """The last value a [Service] key is given."""
    values = [v for s, k, v in unit_settings() if s == "Service" and k == key]
    assert values, f"{key} is not set in {UNIT.name}"
    return values[-1]


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, value
    return int(match[1]) * (60 if match[2] == "min" else 1)


# --- the unit file ------------------------------------------------------------------------


def test_unit_verifies(systemd_analyze: Path, tmp_path: Path) -> None:
    """`systemd-analyze verify` finds nothing to say about the unit (ExecStart pointed at an
    installed relayd, since /opt/relayd does not exist here)."""
    relayd = Path(sys.executable).with_name("relayd")
    assert relayd.exists(), relayd
    unit = tmp_path / "relayd.service"
    unit.write_text(UNIT.read_text().replace("/opt/relayd/bin/relayd", str(relayd)))
    result = subprocess.run(
        [systemd_analyze, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""


def test_unit_sandbox_exposure_is_at_most_2(systemd_analyze: Path) -> None:
    """`systemd-analyze security --offline=yes` rates the unit's exposure 2.0 or less."""
    result = subprocess.run(
        [systemd_analyze, "security", "--offline=yes", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = re.search(r"Overall exposure level for relayd\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= MAX_EXPOSURE, result.stdout


def test_unit_is_notify_with_watchdog_and_long_enough_stop() -> None:
    """Type=notify with a watchdog; systemd waits out the drain (grace 10 s + settle 10 s)."""
    assert unit_value("Type") == "notify"
    assert _seconds(unit_value("WatchdogSec")) > 0
    assert _seconds(unit_value("TimeoutStopSec")) > 10 + 10
    assert unit_value("KillSignal") == "SIGTERM"


def test_unit_credentials_are_optional_names_not_paths() -> None:
    """Credentials are loaded by name (systemd starts the unit without a missing one): every
    name relayd looks up in $CREDENTIALS_DIRECTORY, for the database and for each kind of
    sink in the registry, and no other."""
    loaded = [
        v for s, k, v in unit_settings() if k in ("LoadCredential", "LoadCredentialEncrypted")
    ]
    read = {name for name, *_keys in CREDENTIALS.values()} | {
        name for settings in kinds().values() for name, *_keys in settings.credentials.values()
    }
    assert sorted(loaded) == sorted(read)
    assert len(loaded) == len(set(loaded))
    # No config path pointing into /run/credentials/<unit name>: a renamed unit must work.
    assert "/run/credentials" not in unit_value("ExecStart")


# --- the notify protocol, with a real `relayd run` -----------------------------------------


@pytest.fixture
def notify_socket() -> Iterator[tuple[Path, socket.socket]]:
    """A datagram socket the test owns, in a short private directory (108-byte limit)."""
    with tempfile.TemporaryDirectory(prefix="relayd-") as directory:
        path = Path(directory) / "notify"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        sock.setblocking(False)
        yield path, sock
        sock.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _run_env(
    base: dict[str, str], database: Database, sink: RunningEmulator, notify: Path, port: int
) -> dict[str, str]:
    return base | {
        "RELAYD_DATABASE__DSN": database.dsn,
        "RELAYD_SINK__URL": sink.url,
        "RELAYD_RELAY__SHUTDOWN_GRACE_S": str(GRACE_S),
        "RELAYD_HTTP__LISTEN": f"127.0.0.1:{port}",
        "RELAYD_LOG__FORMAT": "json",
        "NOTIFY_SOCKET": str(notify),
        "WATCHDOG_USEC": "400000",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


class Messages:
    """The datagrams relayd sent, line by line."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lines: list[str] = []

    async def until(self, line: str, count: int = 1, timeout_s: float = 30.0) -> None:
        """Wait until `line` has arrived `count` times in all."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            while self.lines.count(line) < count:
                datagram = await loop.sock_recv(self.sock, 4096)
                self.lines.extend(datagram.decode().split("\n"))

    def count(self, line: str) -> int:
        return self.lines.count(line)


@pytest.mark.parametrize("hardened", [False, True], ids=["plain", "hardened"])
async def test_run_sends_ready_watchdog_and_stopping(
    hardened: bool,
    database: Database,
    emulator: RunningEmulator,
    cli_env: dict[str, str],
    notify_socket: tuple[Path, socket.socket],
) -> None:
    """1. READY=1 arrives only once /healthz answers; 2. WATCHDOG=1 keeps coming; 3. SIGTERM:
    STOPPING=1, then exit 0. Hardened: under the unit's MemoryDenyWriteExecute= and
    NoNewPrivileges= (as prctl(2) imposes them) and UMask=0077."""
    path, sock = notify_socket
    port = _free_port()
    argv = [sys.executable, "-c", _HARDENED] if hardened else relayd_argv("run")
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=_run_env(cli_env, database, emulator, path, port),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await _notify_and_stop(process, Messages(sock), port)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _notify_and_stop(
    process: asyncio.subprocess.Process, messages: Messages, port: int
) -> None:
    """The steps of test_run_sends_ready_watchdog_and_stopping."""
    ready = asyncio.create_task(messages.until("READY=1"))
    exited = asyncio.create_task(process.wait())
    await asyncio.wait([ready, exited], timeout=40, return_when=asyncio.FIRST_COMPLETED)
    if exited.done() and not ready.done():
        ready.cancel()
        await asyncio.gather(ready, return_exceptions=True)
        if process.returncode == 77:
            pytest.skip(
                "this kernel has no PR_SET_MDWE (Linux 6.3 and later): "
                "MemoryDenyWriteExecute= cannot be imposed here"
            )
        stderr = await process.stderr.read() if process.stderr else b""
        pytest.fail(f"relayd exited {process.returncode} before READY=1: {stderr.decode()[-2000:]}")
    await ready
    # 1. HTTP is up by the time systemd hears READY=1.
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/healthz") as answer,
    ):
        assert answer.status == 200
    assert any(line.startswith("STATUS=running: breaker closed") for line in messages.lines)
    # 2. Every 0.2 s (half of WATCHDOG_USEC), from the event loop.
    await messages.until("WATCHDOG=1", messages.count("WATCHDOG=1") + 3, timeout_s=5)
    # 3.
    process.send_signal(signal.SIGTERM)
    await messages.until("STOPPING=1", timeout_s=10)
    async with asyncio.timeout(GRACE_S + 15):
        _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert messages.lines.index("READY=1") < messages.lines.index("STOPPING=1")


def test_a_configuration_error_exits_2_which_the_unit_does_not_restart(
    cli_env: dict[str, str],
    notify_socket: tuple[Path, socket.socket],
) -> None:
    """A bad setting exits 2 (one line, never READY=1), and the unit's Restart=on-failure
    is stopped from restarting it by RestartPreventExitStatus=2."""
    path, sock = notify_socket
    env = cli_env | {
        "RELAYD_DATABASE__DSN": "postgresql://relayd@127.0.0.1:9/app",
        "RELAYD_SINK__URL": "http://127.0.0.1:9",
        "RELAYD_RELAY__LEASE_S": "5",  # must exceed 2 x sink.timeout_s (20)
        "NOTIFY_SOCKET": str(path),
    }
    result = run_relayd_blocking("run", env=env)
    assert result.returncode == 2
    assert result.stderr == (
        "relayd: config error: relay.lease_s: must be greater than 2 x sink.timeout_s (20)\n"
    )
    sent: list[str] = []
    while True:  # whatever was sent, READY=1 was not
        try:
            sent.extend(sock.recv(4096).decode().split("\n"))
        except BlockingIOError:
            break
    assert "READY=1" not in sent
    assert unit_value("Restart") == "on-failure"
    assert unit_value("RestartPreventExitStatus").split() == ["2"]
