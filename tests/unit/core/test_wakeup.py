"""WorkSignal: a notification wakes one idle worker, or waits as a token for the next one;
stopping wakes them all; a notification is never lost to a timeout or a cancellation.
wait_first: the first of several events or a timeout, leaving no waiter behind."""

from __future__ import annotations

import asyncio

from relayd.core.wakeup import WorkSignal, wait_event, wait_first

DEADLINE_S = 5.0


async def _settle() -> None:
    """Let every ready task run until none has anything left to do now."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_notification_wakes_one_waiter_the_longest_idle() -> None:
    signal = WorkSignal()
    woken: list[str] = []

    async def worker(name: str) -> None:
        if await signal.wait(None):
            woken.append(name)

    async with asyncio.timeout(DEADLINE_S), asyncio.TaskGroup() as tasks:
        for name in ("first", "second", "third"):
            tasks.create_task(worker(name))
            await _settle()  # each is waiting before the next starts
        signal.notify()
        await _settle()
        assert woken == ["first"]
        signal.notify()
        await _settle()
        assert woken == ["first", "second"]
        signal.close()  # lets the third go, and the group end
    assert woken == ["first", "second", "third"]


async def test_a_notification_with_nobody_waiting_is_kept_once() -> None:
    """Every worker busy: the next one to go idle claims again at once, the one after sleeps."""
    signal = WorkSignal()
    signal.notify()
    signal.notify()  # tokens do not add up: one claim sees every committed row
    async with asyncio.timeout(DEADLINE_S):
        assert await signal.wait(10.0) is True
        assert await signal.wait(0.01) is False


async def test_close_wakes_every_waiter_now_and_later() -> None:
    signal = WorkSignal()
    async with asyncio.timeout(DEADLINE_S):
        waiters = [asyncio.create_task(signal.wait(None)) for _ in range(4)]
        await _settle()
        signal.close()
        assert await asyncio.gather(*waiters) == [True] * 4
        assert await signal.wait(None) is True


async def test_a_timed_out_waiter_is_skipped_by_the_next_notification() -> None:
    signal = WorkSignal()
    async with asyncio.timeout(DEADLINE_S):
        assert await signal.wait(0.001) is False
        late = asyncio.create_task(signal.wait(None))
        await _settle()
        signal.notify()
        assert await late is True


async def test_a_notification_racing_the_timeout_still_counts() -> None:
    """notify() picks the waiter whose timeout has already been queued to fire: the waiter
    is cancelled by its timeout after it was chosen, and the notification must survive."""
    signal = WorkSignal()
    async with asyncio.timeout(DEADLINE_S):
        # A zero timeout is queued (call_soon) as the waiter starts waiting; this task runs
        # next, so notify() chooses the waiter before the timeout cancels it.
        waiter = asyncio.create_task(signal.wait(0.0))
        await asyncio.sleep(0)
        signal.notify()
        woken = await waiter
        # Reported as woken, or kept for the next wait: never lost.
        assert woken or await signal.wait(0.0) is True


async def test_a_woken_then_cancelled_waiter_passes_the_notification_on() -> None:
    signal = WorkSignal()
    async with asyncio.timeout(DEADLINE_S):
        doomed = asyncio.create_task(signal.wait(None))
        await _settle()
        signal.notify()  # picks `doomed`, which is cancelled before it runs again
        doomed.cancel()
        (outcome,) = await asyncio.gather(doomed, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError)
        assert await signal.wait(0.0) is True


async def test_waiters_that_time_out_or_are_cancelled_leave_the_queue() -> None:
    """Idle workers time out at every poll interval; with no notification for days, the
    queue of waiters must not grow with every timeout."""
    signal = WorkSignal()
    async with asyncio.timeout(DEADLINE_S):
        for _ in range(100):
            assert await signal.wait(0.0) is False
        cancelled = asyncio.create_task(signal.wait(None))
        await _settle()
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert len(signal._waiters) == 0
        late = asyncio.create_task(signal.wait(None))
        await _settle()
        signal.notify()
        assert await late is True


def _tasks() -> set[asyncio.Task[object]]:
    """The tasks of this loop other than the running one."""
    return asyncio.all_tasks() - {asyncio.current_task()}


async def test_wait_first_returns_on_the_first_event_set() -> None:
    """Two events, the second set while waiting: True at once, and no waiter task left
    behind for the event that was not set."""
    first, second = asyncio.Event(), asyncio.Event()
    before = _tasks()
    async with asyncio.timeout(DEADLINE_S):
        waiting = asyncio.create_task(wait_first((first, second), None))
        await _settle()
        second.set()
        assert await waiting is True
    assert _tasks() == before


async def test_wait_first_times_out_false_and_an_event_already_set_is_true() -> None:
    """No event set within the timeout: False; one set before the call: True at once; no
    event at all: only the timeout."""
    events = (asyncio.Event(), asyncio.Event())
    before = _tasks()
    async with asyncio.timeout(DEADLINE_S):
        assert await wait_first(events, 0.01) is False
        assert await wait_first((), 0.01) is False
        assert await wait_event(events[0], 0.01) is False
        events[1].set()
        assert await wait_first(events, None) is True
        assert await wait_event(events[1], None) is True
    assert _tasks() == before


async def test_a_cancelled_wait_first_leaves_no_waiter() -> None:
    """Cancelling the caller cancels and awaits every waiter it started."""
    events = (asyncio.Event(), asyncio.Event(), asyncio.Event())
    before = _tasks()
    async with asyncio.timeout(DEADLINE_S):
        waiting = asyncio.create_task(wait_first(events, None))
        await _settle()
        assert len(_tasks() - before) == 1 + len(events)  # the caller and its waiters
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled()
    assert _tasks() == before
