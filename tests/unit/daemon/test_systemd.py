"""The sd_notify protocol (relayd/daemon/systemd.py): addresses, the watchdog, datagrams, STATUS."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from relayd.core.retry import BreakerState
from relayd.daemon.systemd import (
    Notifier,
    notify_address,
    notify_loop,
    status_line,
    watchdog_interval,
)


@dataclass
class FakeDaemon:
    """What the status line and the notify loop read of a daemon."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    backlog_status: Callable[[], str | None] | None = None
    breaker_state: BreakerState | None = BreakerState.CLOSED
    in_flight: int = 0


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket bound in the abstract namespace, as `@name` and the socket."""
    name = f"relayd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    yield f"@{name}", sock
    sock.close()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/run/systemd/notify", "/run/systemd/notify"),
        ("@relayd/notify", "\0relayd/notify"),
        ("", None),
        ("@", None),
        ("relative/path", None),
        ("vsock:2:1234", None),
    ],
)
def test_notify_address(value: str, expected: str | None) -> None:
    """A path, or `@name` for an abstract socket; anything else means "not under systemd"."""
    assert notify_address({"NOTIFY_SOCKET": value}) == expected


def test_no_notify_socket_means_no_notifier() -> None:
    """Without $NOTIFY_SOCKET the notifier is disabled and sends nothing."""
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert notifier.send("READY=1") is False


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    """Half of $WATCHDOG_USEC, unless $WATCHDOG_PID names another process."""
    assert watchdog_interval(environ) == expected


def test_datagram_reaches_an_abstract_socket(abstract_socket: tuple[str, socket.socket]) -> None:
    """Assignments travel as one datagram of newline-separated lines."""
    address, sock = abstract_socket
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
    try:
        assert notifier.send("READY=1", "STATUS=running")
        assert sock.recv(4096) == b"READY=1\nSTATUS=running"
    finally:
        notifier.close()


def test_datagram_reaches_a_path_socket(tmp_path: Path) -> None:
    """A socket in the file system works the same way."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": str(path)})
        assert notifier.send("WATCHDOG=1")
        notifier.close()
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_a_missing_socket_is_not_an_error(tmp_path: Path) -> None:
    """Nobody listening: send() says False and raises nothing."""
    notifier = Notifier(str(tmp_path / "gone"))
    assert notifier.send("READY=1") is False
    assert notifier.send("WATCHDOG=1") is False
    notifier.close()


async def test_status_line_follows_the_phases() -> None:
    """Starting, running (breaker, rows in flight, backlog when known), draining."""
    daemon = FakeDaemon(breaker_state=None)
    assert status_line(daemon).startswith("starting:")
    daemon.ready.set()
    daemon.breaker_state = BreakerState.OPEN
    daemon.in_flight = 1
    assert status_line(daemon) == "running: breaker open, 1 row in flight"
    daemon.breaker_state = BreakerState.HALF_OPEN
    daemon.backlog_status = lambda: "120 ready,\noldest 3s"
    assert (
        status_line(daemon)
        == "running: breaker half-open, 1 row in flight, backlog 120 ready, oldest 3s"
    )
    daemon.stopping.set()
    daemon.in_flight = 7
    assert status_line(daemon) == "draining: 7 rows in flight"


async def test_notify_loop_sends_ready_watchdog_and_stopping(
    abstract_socket: tuple[str, socket.socket],
) -> None:
    """READY=1 once ready, WATCHDOG=1 every tick, STOPPING=1 once the drain begins."""
    address, sock = abstract_socket
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
    daemon = FakeDaemon()
    task = asyncio.create_task(notify_loop(daemon, notifier, watchdog_s=0.05))
    seen: list[str] = []

    async def until(line: str) -> None:
        while line not in seen:
            seen.extend((await loop.sock_recv(sock, 4096)).decode().split("\n"))

    try:
        async with asyncio.timeout(10):
            await until("WATCHDOG=1")
            assert "READY=1" not in seen
            daemon.ready.set()
            await until("READY=1")
            daemon.stopping.set()
            await until("STOPPING=1")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        notifier.close()
    assert seen.index("READY=1") < seen.index("STOPPING=1")
    assert "STATUS=running: breaker closed, 0 rows in flight" in seen
    assert "STATUS=draining: 0 rows in flight" in seen
