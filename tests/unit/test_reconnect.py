"""The one database-outage policy: count, log, back off, retry; stop or give up on time."""

from __future__ import annotations

import asyncio
import random

import pytest
import structlog

from relayd.errors import DatabaseUnavailable
from relayd.metrics import RelayMetrics
from relayd.reconnect import DatabaseRetry
from relayd.retry import Backoff


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
