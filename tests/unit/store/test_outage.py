"""The one database-outage loop: count, log, back off, retry; stop or give up on time; the
backoff starts over once PostgreSQL answers."""

from __future__ import annotations

import asyncio
import random

import pytest
import structlog

from relayd.core.errors import DatabaseUnavailable
from relayd.core.retry import Backoff
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.metrics import RelayMetrics


def _retry() -> tuple[DatabaseRetry, RelayMetrics]:
    metrics = RelayMetrics()
    return DatabaseRetry(Backoff(0.001, 0.002, random.Random(3)), metrics), metrics


def _errors(metrics: RelayMetrics) -> float:
    return metrics.registry.get_sample_value("relayd_database_errors_total") or 0.0


class _Flaky:
    """Fails `times` times for want of the database, then answers."""

    def __init__(self, times: int) -> None:
        self.left = times
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise DatabaseUnavailable("ConnectionResetError: Connection reset by peer")
        return "answer"


async def test_call_retries_until_the_database_answers() -> None:
    """Each failure is counted and logged with its delay; the answer comes back."""
    retry, metrics = _retry()
    flaky = _Flaky(3)
    with structlog.testing.capture_logs() as logs:
        answer = await retry.call(flaky, log=structlog.get_logger(), event="x.unavailable")
    assert answer == "answer"
    assert flaky.calls == 4
    assert _errors(metrics) == 3
    assert [entry["event"] for entry in logs] == ["x.unavailable"] * 3
    assert all(0 <= entry["retry_in_s"] <= 0.002 for entry in logs)


async def test_call_returns_none_once_stopping() -> None:
    """A stop ends the wait at once: the caller gets None, not an exception."""
    retry, _metrics = _retry()
    stopping = asyncio.Event()
    stopping.set()
    flaky = _Flaky(1)
    assert await retry.call(flaky, log=structlog.get_logger(), event="e", stopping=stopping) is None
    assert flaky.calls == 0


async def test_call_gives_up_after_until() -> None:
    """Past `until` (loop time) the last failure is raised to the caller, counted."""
    retry, metrics = _retry()
    until = asyncio.get_running_loop().time() - 1
    with pytest.raises(DatabaseUnavailable):
        await retry.call(_Flaky(5), log=structlog.get_logger(), event="e", until=until)
    assert _errors(metrics) == 1


async def test_repeat_runs_until_stopping_and_waits_out_each_failure() -> None:
    """A step that fails twice, answers, fails once more: every failure counted and logged,
    the step run again after each; a stop ends the loop."""
    retry, metrics = _retry()
    stopping = asyncio.Event()
    script = [True, True, False, True, False]

    async def step() -> None:
        if not script:
            stopping.set()
            return
        if script.pop(0):
            raise DatabaseUnavailable("gone")

    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(5):
            await retry.repeat(step, log=structlog.get_logger(), event="x.down", stopping=stopping)
    assert not script
    assert _errors(metrics) == 3
    assert [entry["event"] for entry in logs] == ["x.down"] * 3


async def test_the_backoff_starts_over_once_the_database_answered() -> None:
    """Failures in a row count up (each draws a longer delay) and start over once
    PostgreSQL answered: when a call returns, or when a step that holds a connection says
    `over()` on connecting."""
    retry, _metrics = _retry()
    outage = retry.outage(log=structlog.get_logger(), event="e")
    flaky = _Flaky(2)
    seen: list[int] = []

    async def step() -> str:
        seen.append(outage.failures)
        return await flaky()

    assert await outage.call(step) == "answer"
    assert seen == [0, 1, 2]
    assert outage.failures == 0

    async def connected_then_lost() -> None:
        outage.over()
        raise DatabaseUnavailable("lost")

    outage.failures = 4
    outage.until = asyncio.get_running_loop().time() - 1  # raise the failure, do not wait
    with pytest.raises(DatabaseUnavailable):
        await outage.call(connected_then_lost)
    assert outage.failures == 1
