"""How idle loops sleep: until notified, a deadline, or stop, never by ticking.

`Wakeup` is a broadcast signal. A waiter takes a `snapshot()` *before* it looks for work and
waits on that snapshot, so a notification that lands while it was looking is not lost.
`listen_for_inserts` feeds the outbox trigger's NOTIFY into a Wakeup over a dedicated
connection that reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from relayd.errors import DatabaseUnavailable
from relayd.logs import get_logger
from relayd.store import Store

if TYPE_CHECKING:
    # Only for the annotation: reconnect.py sleeps with this module's wait_event.
    from relayd.reconnect import DatabaseRetry

# How often the LISTEN connection proves it is alive (a silently dead TCP peer never closes).
_LISTEN_PING_S = 30.0


class Wakeup:
    """A broadcast signal; every waiter holding the current snapshot wakes on `notify()`."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def snapshot(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, snapshot: asyncio.Event, timeout_s: float | None) -> bool:
        """Wait until `snapshot` is notified (True) or `timeout_s` passes (False)."""
        return await wait_event(snapshot, timeout_s)


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait for `event` at most `timeout_s` seconds (None: forever); True if it was set."""
    if event.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()


async def listen_for_inserts(
    store: Store, wakeup: Wakeup, stopping: asyncio.Event, database: DatabaseRetry
) -> None:
    """Relay the outbox channel's notifications into `wakeup` until `stopping` is set,
    reconnecting through `database`'s policy when the connection is lost."""
    log = get_logger("wakeup")
    failures = 0
    while not stopping.is_set():
        try:
            async with store.listen(wakeup.notify) as listener:
                log.info("wakeup.listening", channel=store.table.channel)
                failures = 0
                # Rows committed while we were not listening got no notification for us.
                wakeup.notify()
                while not stopping.is_set() and not listener.lost.is_set():
                    await _first_of(listener.lost, stopping, timeout_s=_LISTEN_PING_S)
                    if not stopping.is_set() and not listener.lost.is_set():
                        async with asyncio.timeout(10):
                            await listener.ping()
        except (DatabaseUnavailable, TimeoutError) as exc:
            failures += 1
            lost = (
                exc
                if isinstance(exc, DatabaseUnavailable)
                else DatabaseUnavailable("the LISTEN connection did not answer its ping")
            )
            await database.wait(
                failures, lost, log=log, event="wakeup.listen_failed", stopping=stopping
            )


async def _first_of(*events: asyncio.Event, timeout_s: float) -> None:
    """Return when any event is set or the timeout passes."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
