"""How idle loops sleep: until notified, a deadline, or stop, never by ticking (`wait_event`,
`wait_first` for the first of several events).

`WorkSignal` wakes the relay workers one at a time. `Wakeup` is a broadcast signal: a waiter
takes a `snapshot()` *before* it looks for work and waits on that snapshot, so a notification
that lands while it was looking is not lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence


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
    return await wait_first((event,), timeout_s)


async def wait_first(events: Sequence[asyncio.Event], timeout_s: float | None) -> bool:
    """Wait until one of `events` is set, at most `timeout_s` seconds (None: forever; no
    event: just the timeout); True if one was set. Whether it returns, times out or is
    cancelled, no waiter outlives the call: each is cancelled and awaited."""
    if any(event.is_set() for event in events):
        return True
    # One event needs no task of its own: the common case (an idle loop and its stop event).
    waiters = [asyncio.ensure_future(event.wait()) for event in events] if len(events) > 1 else []
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                if waiters:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                elif events:
                    await events[0].wait()
                else:
                    await asyncio.get_running_loop().create_future()  # only the timeout ends it
    finally:
        if waiters:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
    return any(event.is_set() for event in events)


class WorkSignal:
    """New rows for a set of workers, woken one at a time.

    Every outbox commit notifies; waking every idle worker for each would send one claim per
    worker per commit, all but one finding nothing (and each then asking when the next row
    is due): under load the database spends its time on empty claims. So `notify()` wakes
    the longest-idle worker alone, or, when every worker is busy, leaves one token that the
    next worker to go idle takes instead of sleeping. Either way a claim starts after the
    notification arrived, so it sees the committed rows. A worker whose claim came back full
    calls `notify()` itself: more rows may wait, and another worker joins in.
    """

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._token = False
        self._closed = False

    def notify(self) -> None:
        """Wake one waiting worker, or keep a token for the next one to wait."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._token = True

    def take(self) -> bool:
        """Take the kept token, if there is one (or the signal is closed): True means claim
        again now, without waiting."""
        if self._closed:
            return True
        token, self._token = self._token, False
        return token

    def close(self) -> None:
        """Wake every waiter, now and from now on (the process is stopping)."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout_s: float | None) -> bool:
        """Wait for a notification (True) or `timeout_s` (False)."""
        if self._closed:
            return True
        if self._token:
            self._token = False
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            pass
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.notify()  # woken, then cancelled: the notification goes to another
            raise
        finally:
            woken = waiter.done() and not waiter.cancelled()
            if not woken:
                # Timed out or cancelled: leave the queue, so that idle workers timing out
                # for days without a notification do not pile up in it.
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        # The timeout may fire just after notify() chose this waiter: it still counts.
        return woken
