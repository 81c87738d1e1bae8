"""AttemptDeadlines: each attempt ends at its own deadline as `asyncio.timeout_at` would end
it (TimeoutError), however many attempts came before it under the same runner's timer; the
drain's cut brings the running attempt's deadline forward; a cancellation from outside stays
a cancellation; between attempts, and after `close`, nothing is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from relayd.engine.deadline import AttemptDeadlines

DEADLINE_S = 5.0
SHORT_S = 0.05


async def test_an_attempt_past_its_deadline_ends_in_timeout_error() -> None:
    loop = asyncio.get_running_loop()
    deadlines = AttemptDeadlines()
    try:
        async with asyncio.timeout(DEADLINE_S):
            when = loop.time() + SHORT_S
            with pytest.raises(TimeoutError), deadlines.until(when):
                await asyncio.Event().wait()
            assert loop.time() >= when
            assert deadlines.when() is None
    finally:
        deadlines.close()


async def test_each_attempt_runs_to_its_own_deadline_not_an_earlier_ones() -> None:
    """The timer set for the first attempt's deadline moves on to the running attempt's."""
    loop = asyncio.get_running_loop()
    deadlines = AttemptDeadlines()
    try:
        async with asyncio.timeout(DEADLINE_S):
            with deadlines.until(loop.time() + SHORT_S):
                await asyncio.sleep(0)  # done well before its deadline
            later = loop.time() + 3 * SHORT_S
            with pytest.raises(TimeoutError), deadlines.until(later):
                await asyncio.Event().wait()
            assert loop.time() >= later
            with deadlines.until(loop.time() + DEADLINE_S):  # the one after runs normally
                await asyncio.sleep(0)
    finally:
        deadlines.close()


async def test_between_attempts_and_after_close_nothing_is_cancelled() -> None:
    loop = asyncio.get_running_loop()
    deadlines = AttemptDeadlines()
    async with asyncio.timeout(DEADLINE_S):
        with deadlines.until(loop.time() + SHORT_S):
            pass
        await asyncio.sleep(2 * SHORT_S)  # past that deadline, between attempts
        with deadlines.until(loop.time() + SHORT_S):
            pass
        deadlines.close()
        await asyncio.sleep(2 * SHORT_S)  # past it again, after close
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_cut_brings_the_running_attempts_deadline_forward() -> None:
    loop = asyncio.get_running_loop()
    deadlines = AttemptDeadlines()

    async def cut() -> None:
        await asyncio.sleep(0)
        deadlines.reschedule(loop.time() + SHORT_S)

    try:
        async with asyncio.timeout(DEADLINE_S):
            cutting = asyncio.create_task(cut())
            with pytest.raises(TimeoutError), deadlines.until(loop.time() + 60.0):
                await asyncio.Event().wait()
            await cutting
    finally:
        deadlines.close()


async def test_a_cancellation_from_outside_is_not_a_timeout() -> None:
    started = asyncio.Event()

    async def attempt() -> None:
        deadlines = AttemptDeadlines()
        try:
            with deadlines.until(asyncio.get_running_loop().time() + 60.0):
                started.set()
                await asyncio.Event().wait()
        finally:
            deadlines.close()

    async with asyncio.timeout(DEADLINE_S):
        task = asyncio.create_task(attempt())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_one_attempt_at_a_time() -> None:
    deadlines = AttemptDeadlines()
    try:
        when = asyncio.get_running_loop().time() + 60.0
        with deadlines.until(when), pytest.raises(RuntimeError):
            deadlines.until(when)
    finally:
        deadlines.close()
