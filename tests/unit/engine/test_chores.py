"""Housekeeping chores: a refused statement is counted every time, logged once per change of
its error, shown while it lasts, and forgotten when the chore works again; a lost connection
is not the chore's failure."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import pytest
import structlog

from relayd.core.errors import DatabaseUnavailable, StatementError
from relayd.core.retry import Backoff
from relayd.engine.chores import Chore, Housekeeping
from relayd.store import outage as reconnect
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.metrics import RelayMetrics

SINCE = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)


def _housekeeping(metrics: RelayMetrics, stopping: asyncio.Event | None = None) -> Housekeeping:
    backoff = Backoff(base_s=reconnect.BASE_S, cap_s=reconnect.CAP_S, rng=random.Random(1))
    return Housekeeping(
        metrics,
        DatabaseRetry(backoff, metrics),
        asyncio.Event() if stopping is None else stopping,
        clock=lambda: SINCE,
    )


def _refused(error: str) -> StatementError:
    return StatementError("delete_published", error)


async def test_a_failure_is_counted_always_and_logged_once_per_change() -> None:
    """Three refusals, two distinct errors: three failures counted, two log events, the
    chore shown failing since the first; a success logs the recovery and clears it."""
    metrics = RelayMetrics()
    housekeeping = _housekeeping(metrics)
    value = metrics.registry.get_sample_value
    errors = ["ForeignKeyViolationError: 23503", "ForeignKeyViolationError: 23503", "P0001"]
    with structlog.testing.capture_logs() as logs:
        for error in errors:

            async def refuse(error: str = error) -> None:
                raise _refused(error)

            assert await housekeeping.run(Chore.CLEANUP, refuse) is False
        assert value("relayd_housekeeping_failures_total", {"chore": "cleanup"}) == 3
        assert value("relayd_housekeeping_failing", {"chore": "cleanup"}) == 1
        assert housekeeping.as_json() == {
            "cleanup": {
                "error": "delete_published: P0001",
                "since": SINCE.isoformat(),
                "failures": 3,
            }
        }

        async def works() -> None:
            pass

        assert await housekeeping.run(Chore.CLEANUP, works) is True
    assert [(log["event"], log.get("failures")) for log in logs] == [
        ("housekeeping.failed", 1),
        ("housekeeping.failed", 3),
        ("housekeeping.recovered", 3),
    ]
    assert value("relayd_housekeeping_failing", {"chore": "cleanup"}) == 0
    assert value("relayd_housekeeping_failing", {"chore": "sampler"}) == 0  # every chore shown
    assert housekeeping.as_json() == {}


async def test_a_lost_connection_is_not_the_chores_failure() -> None:
    """`DatabaseUnavailable` passes through `run` (the database policy waits it out) and
    leaves the chore's health as it was."""
    metrics = RelayMetrics()
    housekeeping = _housekeeping(metrics)

    async def gone() -> None:
        raise DatabaseUnavailable("ConnectionRefusedError")

    with pytest.raises(DatabaseUnavailable):
        await housekeeping.run(Chore.HEARTBEAT, gone)
    assert housekeeping.failing == {}
    assert metrics.registry.get_sample_value(
        "relayd_housekeeping_failures_total", {"chore": "heartbeat"}
    ) in (None, 0)


async def test_every_keeps_its_schedule_through_failures_and_outages() -> None:
    """`every` runs its step again after a refusal and after an outage, and returns once the
    daemon stops; a failure of relayd's own (not a statement, not the connection) escapes."""
    metrics = RelayMetrics()
    stopping = asyncio.Event()
    housekeeping = _housekeeping(metrics, stopping)
    results: list[BaseException | None] = [_refused("x"), DatabaseUnavailable("gone"), None]
    runs = 0

    async def step() -> None:
        nonlocal runs
        runs += 1
        result = results.pop(0) if results else None
        if result is not None:
            raise result
        if not results:
            stopping.set()

    async with asyncio.timeout(10):
        await housekeeping.every(Chore.SAMPLER, 0.001, step)
    assert runs == 3
    assert housekeeping.failing == {}

    async def bug() -> None:
        raise TypeError("relayd's own")

    stopping.clear()
    with pytest.raises(TypeError):
        await housekeeping.every(Chore.SAMPLER, 0.001, bug)
