"""How idle loops sleep: until notified, a deadline, or stop, never by ticking.

`Wakeup` is a broadcast signal. A waiter takes a `snapshot()` *before* it looks for work and
waits on that snapshot, so a notification that lands while it was looking is not lost.
"""

from __future__ import annotations

import asyncio
import contextlib


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
