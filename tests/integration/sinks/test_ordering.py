"""Ordered delivery on every destination, through the daemon: each key's rows reach the
destination in the order their transactions committed (OJS: the order the jobs were stored;
NATS: the order of the stream; webhooks: the order the verifying receiver stored them), and
two producers of one key, the first holding its transaction open before COMMIT, are
delivered in commit order every time."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from relayd.producer import new_job
from relayd.settings import Settings
from relayd.testing.emulator import EmulatorConfig, start_emulator
from relayd.testing.nats import NatsServer
from relayd.testing.webhook_receiver import receiving
from tests.faults.order_checker import check_order
from tests.support import FAST, Database, drained, eventually, running

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
TYPE = "order.updated"


@dataclass
class Destination:
    """A running destination of one kind: the relay's settings, and what it saw so far (the
    event ids in arrival order)."""

    settings: Settings
    arrivals: Callable[[], Awaitable[list[str]]]


def _settings(dsn: str, sink: dict[str, Any]) -> Settings:
    merged: dict[str, dict[str, Any]] = {name: dict(values) for name, values in FAST.items()}
    merged["database"] = {"dsn": dsn}
    merged["sink"] = {"timeout_s": 2.0, "concurrency": 16} | sink
    return Settings(**merged)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def destination(kind: str, dsn: str, tmp_path: Path) -> AsyncIterator[Destination]:
    if kind == "ojs":
        async with await start_emulator(EmulatorConfig()) as emulator:

            async def jobs() -> list[str]:
                return emulator.emulator.arrivals()

            yield Destination(_settings(dsn, {"url": emulator.url, "ordering": "key"}), jobs)
    elif kind == "nats":
        with NatsServer() as server:
            client = await nats.connect(server.url)
            try:
                await client.jetstream().add_stream(name="EVENTS", subjects=["events.>"])

                async def stream() -> list[str]:
                    info = await client.jetstream().stream_info("EVENTS")
                    ids = []
                    for seq in range(info.state.first_seq, info.state.last_seq + 1):
                        message = await client.jetstream().get_msg("EVENTS", seq)
                        ids.append((message.headers or {})["Nats-Msg-Id"])
                    return ids if info.state.messages else []

                sink = {
                    "kind": "nats",
                    "servers": [server.url],
                    "stream": "EVENTS",
                    "routes": [{"type": TYPE, "subject": "events.orders", "ordering": "key"}],
                }
                yield Destination(_settings(dsn, sink), stream)
            finally:
                await client.close()
    else:
        secret_file = tmp_path / "whsec"
        secret_file.write_text(SECRET + "\n")
        async with receiving([SECRET]) as receiver:

            async def deliveries() -> list[str]:
                return list(receiver.arrivals)

            sink = {
                "kind": "webhook",
                "secret_file": str(secret_file),
                "routes": [{"type": TYPE, "url": receiver.endpoint(), "ordering": "key"}],
            }
            yield Destination(_settings(dsn, sink), deliveries)


def _event(key: str) -> dict[str, Any]:
    return new_job(
        TYPE,
        [{"order": key}],
        meta={META_VERSION: 1, META_OCCURRED_AT: "2024-05-01T12:00:00Z"},
    )


async def _insert(conn: asyncpg.Connection, key: str) -> tuple[str, int]:
    job = _event(key)
    seq: int = await conn.fetchval(
        "INSERT INTO relayd.outbox (event_id, job, ordering_key) VALUES ($1, $2, $3) "
        "RETURNING ordering_seq",
        job["id"],
        json.dumps(job),
        key,
    )
    return str(job["id"]), seq


KINDS = ["ojs", "nats", "webhook"]


@pytest.mark.parametrize("kind", KINDS)
async def test_each_key_arrives_in_commit_order(
    kind: str, database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    keys = [f"order-{i}" for i in range(10)] * 12
    random.Random(5).shuffle(keys)
    rows: dict[str, tuple[str, int]] = {}
    async with destination(kind, database.dsn, tmp_path) as dest, running(dest.settings):
        for key in keys:  # committed while the relay runs, one transaction each
            event_id, seq = await _insert(conn, key)
            rows[event_id] = (key, seq)
        await eventually(lambda: drained(conn))
        report = check_order(await dest.arrivals(), rows)
    assert report.clean, (report.violations, report.lost)
    assert report.delivered == len(keys)


@pytest.mark.parametrize("kind", KINDS)
async def test_two_producers_of_one_key_are_delivered_in_commit_order(
    kind: str, database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """The first producer inserts, then holds its transaction open before COMMIT; the
    second inserts the same key meanwhile and commits as soon as it may. 100 runs: the
    destination sees the first's event, then the second's, every time."""
    second_conn = await asyncpg.connect(database.dsn)
    try:
        async with destination(kind, database.dsn, tmp_path) as dest, running(dest.settings):
            expected: list[str] = []
            for run in range(100):
                key = f"account-{run}"
                first_id = await _two_writers(conn, second_conn, key, expected)
                assert expected[-2] == first_id
            await eventually(lambda: drained(conn))
            arrivals = [i for i in await dest.arrivals() if i in set(expected)]
    finally:
        await second_conn.close()
    # Each pair once, in commit order; the pairs may interleave across keys.
    firsts = {expected[i]: expected[i + 1] for i in range(0, len(expected), 2)}
    position = {event_id: n for n, event_id in enumerate(arrivals)}
    assert len(position) == 200
    assert all(position[a] < position[b] for a, b in firsts.items())


async def _two_writers(
    first: asyncpg.Connection, second: asyncpg.Connection, key: str, committed: list[str]
) -> str:
    """The first writer inserts `key` and waits; the second inserts `key` (it waits on the
    key) and commits; the first commits once the second is seen waiting. Appends the ids
    in commit order to `committed`; returns the first writer's id."""
    a, b = _event(key), _event(key)
    tx = first.transaction()
    await tx.start()
    await first.execute(
        "INSERT INTO relayd.outbox (event_id, job, ordering_key) VALUES ($1, $2, $3)",
        a["id"],
        json.dumps(a),
        key,
    )

    async def write_second() -> None:
        await second.execute(
            "INSERT INTO relayd.outbox (event_id, job, ordering_key) VALUES ($1, $2, $3)",
            b["id"],
            json.dumps(b),
            key,
        )

    writer = asyncio.create_task(write_second())

    async def waiting() -> bool:
        return bool(
            await first.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        )

    await eventually(waiting, timeout_s=10)
    await tx.commit()
    committed.append(str(a["id"]))
    await writer
    committed.append(str(b["id"]))
    return str(a["id"])
