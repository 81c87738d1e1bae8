"""Helpers for tests that run the relay in-process against the emulator."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg

from relayd.config import Settings
from relayd.daemon import Daemon
from relayd.metrics import RelayMetrics
from relayd.producer import enqueue_many, new_job

# Fast timings so tests finish quickly; every relation the design needs still holds
# (lease > 2 x attempt deadline).
FAST: dict[str, dict[str, Any]] = {
    "relay": {
        "workers": 4,
        "batch_size": 50,
        "lease_s": 10.0,
        "poll_interval_s": 0.5,
        "shutdown_grace_s": 2.0,
    },
    "sink": {"timeout_s": 2.0, "connect_timeout_s": 1.0, "concurrency": 16},
    "retry": {
        "base_s": 0.02,
        "cap_s": 0.2,
        "max_attempts": 5,
        "breaker_threshold": 5,
        "breaker_cooldown_s": 0.05,
    },
    "http": {"enabled": False},
    "cleanup": {"enabled": False},
    "log": {"level": "warning", "format": "json"},
}


def relay_settings(dsn: str, sink_url: str, **sections: dict[str, Any]) -> Settings:
    """Settings for an in-process relay: FAST, overridden section by section."""
    merged: dict[str, dict[str, Any]] = {name: dict(values) for name, values in FAST.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    merged.setdefault("database", {})["dsn"] = dsn
    merged["sink"]["url"] = sink_url
    return Settings(**merged)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(settings: Settings, *, seed: int = 1) -> AsyncIterator[Daemon]:
    """A relay daemon running in this event loop; drained and awaited on exit."""
    daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(seed))
    task = asyncio.create_task(daemon.run(), name="daemon-under-test")
    ready = asyncio.create_task(daemon.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if task.done():
        task.result()  # raise what startup raised
        raise AssertionError("the daemon exited during startup")
    try:
        yield daemon
    finally:
        daemon.stop()
        code = await task
        assert code == 0, f"daemon exit code {code}"


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout_s: float = 30.0) -> None:
    """Await until `check()` holds, re-checking every 20 ms; fail after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        # The state lives in PostgreSQL, which cannot signal this loop: poll under a deadline.
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def produce(
    conn: asyncpg.Connection, count: int, *, job_type: str = "test.echo", **job: Any
) -> list[str]:
    """Commit `count` outbox rows the way an application would; returns their ids."""
    jobs = [new_job(job_type, [{"n": i}], **job) for i in range(count)]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    return [str(j["id"]) for j in jobs]


async def pending(conn: asyncpg.Connection) -> int:
    value: int = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NULL AND dead_at IS NULL"
    )
    return value


async def drained(conn: asyncpg.Connection) -> bool:
    return await pending(conn) == 0


async def run_until_idle(settings: Settings, *, seed: int = 1, timeout_s: float = 60.0) -> Daemon:
    """Run a relay daemon until nothing is pending (every row published or dead-lettered),
    then return it (for its metrics) once it drained and exited 0."""
    daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(seed), until_idle=True)
    async with asyncio.timeout(timeout_s):
        code = await daemon.run()
    assert code == 0, f"daemon exit code {code}"
    return daemon
