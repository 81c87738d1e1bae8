"""systemd's service notification protocol (sd_notify(3)), spoken without libsystemd.

Under a `Type=notify` unit systemd passes `$NOTIFY_SOCKET`: a Unix datagram socket, a path or
(`@name`) an abstract one. relayd sends `READY=1` once the daemon is ready (PostgreSQL, the
schema and HTTP are up), `STOPPING=1` when its drain begins, `WATCHDOG=1` from the event loop
every half of `$WATCHDOG_USEC` (a wedged loop stops sending them and systemd restarts relayd),
and `STATUS=` with one line about the breaker, the rows in flight and, when something samples
it, the backlog. Without `$NOTIFY_SOCKET` none of this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from relayd.core.retry import BreakerState
from relayd.core.wakeup import wait_first
from relayd.telemetry.logs import get_logger

# How often STATUS= is refreshed when no watchdog asks for more.
STATUS_INTERVAL_S = 5.0
_BREAKER = {
    BreakerState.CLOSED: "closed",
    BreakerState.HALF_OPEN: "half-open",
    BreakerState.OPEN: "open",
}


def notify_address(environ: Mapping[str, str] | None = None) -> str | None:
    """Where `$NOTIFY_SOCKET` points, as a socket address (None: not under systemd).

    `@name` is an abstract socket (a leading NUL byte); a path must be absolute. Other forms
    (vsock) are not spoken: relayd then behaves as outside systemd.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("NOTIFY_SOCKET", "")
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between two `WATCHDOG=1` (half of `$WATCHDOG_USEC`); None without a watchdog
    or when `$WATCHDOG_PID` names another process."""
    environ = os.environ if environ is None else environ
    pid = environ.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    return int(usec) / 2 / 1_000_000


class Notifier:
    """Sends sd_notify datagrams; a no-op when `address` is None. Never blocks, never raises."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._socket: socket.socket | None = None
        self._log = get_logger("systemd")
        self._warned = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        return cls(notify_address(environ))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send `KEY=value` lines as one datagram; False if not sent."""
        if self.address is None or not assignments:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                )
                self._socket.setblocking(False)
            self._socket.sendto(message, self.address)
        except OSError as exc:
            if not self._warned:  # once: a missing socket would otherwise log every tick
                self._warned = True
                self._log.warning("systemd.notify_failed", error=str(exc))
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class Observed(Protocol):
    """What the status line reads of a daemon."""

    ready: asyncio.Event
    stopping: asyncio.Event
    backlog_status: Callable[[], str | None] | None

    @property
    def breaker_state(self) -> BreakerState | None: ...

    @property
    def in_flight(self) -> int: ...


def status_line(daemon: Observed) -> str:
    """One short line for `STATUS=`: the phase, the breaker, rows in flight, the backlog."""
    rows = daemon.in_flight
    in_flight = f"{rows} row{'s' * (rows != 1)} in flight"
    if daemon.stopping.is_set():
        return f"draining: {in_flight}"
    if not daemon.ready.is_set():
        return "starting: waiting for PostgreSQL, the outbox schema and HTTP"
    state = daemon.breaker_state
    breaker = "breaker " + (_BREAKER[state] if state is not None else "unknown")
    parts = [breaker, in_flight]
    backlog = daemon.backlog_status() if daemon.backlog_status is not None else None
    if backlog:
        parts.append(f"backlog {backlog}")
    return " ".join(f"running: {', '.join(parts)}".split())  # one line, whatever it holds


async def notify_loop(daemon: Observed, notifier: Notifier, watchdog_s: float | None) -> None:
    """Tell systemd about `daemon` until cancelled: READY=1 once ready, STOPPING=1 once the
    drain begins, WATCHDOG=1 every `watchdog_s`, STATUS= whenever the line changes."""
    tick = STATUS_INTERVAL_S if watchdog_s is None else min(watchdog_s, STATUS_INTERVAL_S)
    ready_sent = stopping_sent = False
    last_status: str | None = None
    while True:
        lines: list[str] = []
        if not ready_sent and daemon.ready.is_set():
            ready_sent = True
            lines.append("READY=1")
        if not stopping_sent and daemon.stopping.is_set():
            stopping_sent = True
            lines.append("STOPPING=1")
        if watchdog_s is not None:
            lines.append("WATCHDOG=1")
        status = status_line(daemon)
        if status != last_status:
            last_status = status
            lines.append(f"STATUS={status}")
        notifier.send(*lines)
        events = ((daemon.ready, ready_sent), (daemon.stopping, stopping_sent))
        await wait_first([event for event, sent in events if not sent], tick)


@contextlib.asynccontextmanager
async def notifying(
    daemon: Observed, environ: Mapping[str, str] | None = None
) -> AsyncIterator[Notifier]:
    """Run `notify_loop` for `daemon` while the block runs, if systemd is listening.

    If the loop itself fails, that is logged and the watchdog pings stop: systemd then
    restarts relayd, which is what a lost watchdog is for.
    """
    notifier = Notifier.from_environ(environ)
    if not notifier.enabled:
        yield notifier
        return
    log = get_logger("systemd")

    async def supervised() -> None:
        try:
            await notify_loop(daemon, notifier, watchdog_interval(environ))
        except Exception as exc:
            log.error("systemd.notify_crashed", error=repr(exc), exc_info=exc)

    task = asyncio.create_task(supervised(), name="systemd-notify")
    try:
        yield notifier
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        notifier.close()
