"""Sink edges: bearer auth, 413 splitting, and retention cleanup (C7)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import structlog

from relayd.config.sections import CleanupSettings
from relayd.core.envelope import Envelope
from relayd.core.outcomes import NotStarted
from relayd.daemon.cleanup import clean_published
from relayd.producer import enqueue_many, new_job
from relayd.sinks import SendWindow
from relayd.sinks.ojs.sink import OjsSink
from relayd.store import Store
from relayd.testing.emulator import EmulatorConfig, RunningEmulator, start_emulator
from relayd.testing.emulator.faults import FaultRule
from tests.support import (
    Database,
    SinkHealthRecord,
    claimed,
    drained,
    eventually,
    ojs_settings,
    pending,
    produce,
    relay_settings,
    run_until_idle,
    running,
)

TOKEN = "s3cret-token-value"  # noqa: S105 - a test fixture, not a credential


async def test_bearer_token_comes_from_token_file(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """sink.token_file's token authenticates every request."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    ids = await produce(conn, 30)
    async with await start_emulator(EmulatorConfig(auth_token=TOKEN)) as sink:
        settings = relay_settings(database.dsn, sink.url, sink={"token_file": token_file})
        await run_until_idle(settings)
        assert await drained(conn)
        assert set(sink.emulator.ledger()) == set(ids)


async def test_wrong_token_opens_the_breaker_and_dead_letters_nothing(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """C5: 403 is the sink refusing us, not the row: breaker open, attempts refunded, and the
    token never reaches last_error."""
    token_file = tmp_path / "token"
    token_file.write_text("wrong-" + TOKEN)
    await produce(conn, 30)
    async with await start_emulator(EmulatorConfig(auth_token=TOKEN)) as sink:
        settings = relay_settings(database.dsn, sink.url, sink={"token_file": token_file})
        async with running(settings) as daemon:

            async def opened_repeatedly() -> bool:
                value = daemon.metrics.registry.get_sample_value("relayd_breaker_opened_total")
                return (value or 0) >= 5

            await eventually(opened_repeatedly)
    assert await pending(conn) == 30
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL") == 0
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") <= 1
    errors = await conn.fetch("SELECT last_error FROM relayd.outbox WHERE last_error IS NOT NULL")
    assert errors
    assert all(TOKEN not in row["last_error"] and "403" in row["last_error"] for row in errors)


async def test_batch_over_the_sink_body_bound_is_split(
    database: Database, conn: asyncpg.Connection
) -> None:
    """A 413 on a batch splits it until each part fits; nothing is dead-lettered."""
    jobs = [new_job("test.echo", ["x" * 2000, n]) for n in range(60)]
    # A claim of 50 rows makes a ~100 KB batch: over the sink's 30 KB bound, so only a split
    # publishes them on their first attempt.
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    async with await start_emulator(EmulatorConfig(max_body_bytes=30_000)) as sink:
        settings = relay_settings(database.dsn, sink.url, sink={"batch": "on"})
        await run_until_idle(settings)
        assert await drained(conn)
        ledger = sink.emulator.ledger()
    assert {str(j["id"]) for j in jobs} == set(ledger)
    assert {e.created for e in ledger.values()} == {1}
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") == 1
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL") == 0


async def test_retention_deletes_old_published_rows_only(
    conn: asyncpg.Connection, store: Store
) -> None:
    """C7: published rows past retention go, in batches; recent, pending and dead rows stay."""
    ids = await produce(conn, 25)
    old_published, recent, dead_old, waiting = ids[:12], ids[12:15], ids[15:18], ids[18:]
    await conn.execute(
        "UPDATE relayd.outbox SET published_at = now() - interval '2 days' "
        "WHERE event_id = ANY($1::uuid[])",
        old_published,
    )
    await conn.execute(
        "UPDATE relayd.outbox SET published_at = now() WHERE event_id = ANY($1::uuid[])", recent
    )
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now() - interval '30 days', dead_reason = 'conflict' "
        "WHERE event_id = ANY($1::uuid[])",
        dead_old,
    )
    stopping = asyncio.Event()
    settings = CleanupSettings(published_retention_s=86400, batch_size=5, interval_s=60)
    task = asyncio.create_task(clean_published(store, settings, stopping))

    async def cleaned() -> bool:
        return not await conn.fetchval(
            "SELECT count(*) FROM relayd.outbox WHERE event_id = ANY($1::uuid[])", old_published
        )

    await eventually(cleaned)
    stopping.set()
    await task
    left = {r[0] for r in await conn.fetch("SELECT event_id::text FROM relayd.outbox")}
    assert left == set(recent) | set(dead_old) | set(waiting)


async def test_a_token_echoed_by_the_sink_is_never_stored_or_logged(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """A sink (or a proxy) that echoes the Authorization header in its 401 message: the
    token reaches neither last_error nor any log event, in any of its encodings."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    await produce(conn, 10)
    echo = json.dumps(
        {
            "error": {
                "code": "unauthorized",
                # The header as received, then quoted again the way Go would escape it.
                "message": f"bad credentials: 'Bearer {TOKEN}' ({json.dumps(TOKEN)})",
            }
        }
    )
    async with await start_emulator(EmulatorConfig(auth_token=TOKEN)) as sink:
        sink.emulator.add_fault(
            FaultRule(action="status", method="POST", status=401, body=echo, times=None)
        )
        settings = relay_settings(
            database.dsn, sink.url, sink={"token_file": token_file, "batch": "off"}
        )
        with structlog.testing.capture_logs() as logs:
            async with running(settings):

                async def refused_often() -> bool:
                    refused: int = await conn.fetchval(
                        "SELECT count(*) FROM relayd.outbox WHERE last_error LIKE '%401%'"
                    )
                    return refused >= 3

                await eventually(refused_often)
    errors = [r[0] for r in await conn.fetch("SELECT last_error FROM relayd.outbox")]
    assert any(error and "bad credentials: 'Bearer ***'" in error for error in errors)
    assert all(TOKEN not in (error or "") for error in errors)
    assert logs
    assert all(TOKEN not in repr(entry) for entry in logs)


async def test_a_batch_stored_in_part_is_reconciled_before_anything_is_resent(
    database: Database, conn: asyncpg.Connection
) -> None:
    """A server that stores batch items one by one, then answers 422 naming item 10: the 10
    items before it are found by GET (not sent again: on a sink that overwrites a reused id
    that would create them twice), the named row is dead-lettered, the rest publish."""
    good = [new_job("test.echo", [n]) for n in range(20)]
    poison = new_job("test.echo", [], options={"retry": {"max_attempts": -1}})
    async with conn.transaction():
        await enqueue_many(conn, [*good[:10], poison, *good[10:]])
    config = EmulatorConfig(batch_atomic=False, duplicate_mode="overwrite")
    async with await start_emulator(config) as sink:
        settings = relay_settings(database.dsn, sink.url, sink={"batch": "on"})
        await run_until_idle(settings)
        assert await drained(conn)
        ledger = sink.emulator.ledger()
    assert {(ledger[str(j["id"])].created, ledger[str(j["id"])].overwrites) for j in good} == {
        (1, 0)
    }
    assert (
        await conn.fetchval(
            "SELECT dead_reason FROM relayd.outbox WHERE event_id = $1", poison["id"]
        )
        == "sink_unprocessable"
    )
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL") == 1
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") == 1


async def test_no_post_leaves_after_the_start_by_time(emulator: RunningEmulator) -> None:
    """C4: a POST (single or batch) whose attempt's start-by time has passed is not sent; the
    rows come back NotStarted. A GET, which changes nothing on the sink, still is."""
    settings = ojs_settings(relay_settings("postgresql://unused@127.0.0.1/x", emulator.url))
    sink = OjsSink(settings, SinkHealthRecord())
    await sink.start()
    try:
        rows = [claimed() for _ in range(3)]
        envelopes = {row.event_id: Envelope.parse(row.job, row.event_id) for row in rows}
        past = asyncio.get_running_loop().time() - 0.001
        assert await sink.publish(rows[:1], envelopes, window=SendWindow(past)) == {
            rows[0].event_id: NotStarted()
        }
        outcomes = await sink.publish(rows, envelopes, window=SendWindow(past))
        assert outcomes == {row.event_id: NotStarted() for row in rows}
        again = dataclasses.replace(rows[1], previous_attempt_at=datetime.now(UTC))
        assert await sink.publish([again], envelopes, window=SendWindow(past)) == {
            again.event_id: NotStarted()
        }
    finally:
        await sink.close()
    assert emulator.emulator.ledger()[rows[1].event_id].gets == 1  # the GET went out
    assert all(entry.posts == 0 for entry in emulator.emulator.ledger().values())
