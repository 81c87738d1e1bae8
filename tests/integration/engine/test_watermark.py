"""C1 with the claim's watermark: a row committed late, behind rows already published, is
never skipped (docs/contract.md#c1, docs/performance.md)."""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg
import pytest

from relayd.engine.watermark import Watermark
from relayd.producer import new_job
from relayd.store import Store
from relayd.testing.emulator import RunningEmulator
from tests.support import (
    DEFAULT_TABLE,
    Database,
    drained,
    dsn_as,
    eventually,
    produce,
    relay_settings,
    running,
)


async def _parked_for_an_hour(conn: asyncpg.Connection) -> str:
    """A row waiting out a one-hour backoff: the pending head, an hour ahead."""
    job = new_job("test.parked", [])
    await conn.execute(
        "INSERT INTO relayd.outbox (event_id, job, available_at) "
        "VALUES ($1, $2, now() + interval '1 hour')",
        job["id"],
        json.dumps(job),
    )
    return str(job["id"])


def _claims(daemon: object) -> float:
    registry = daemon.metrics.registry  # type: ignore[attr-defined]
    return float(registry.get_sample_value("relayd_claims_total") or 0)


async def test_a_transaction_committing_late_is_published(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """1. a producer transaction inserts rows and stays open, and a row waits out a one-hour
    backoff (so the pending head is an hour ahead); 2. other producers' rows are committed
    and published across many claims; 3. the open transaction commits: its rows, now behind
    rows already published, are published without waiting for a full scan (one every hour
    in this test)."""
    settings = relay_settings(
        database.dsn,
        emulator.url,
        relay={"poll_interval_s": 0.05, "full_scan_interval_s": 3600.0},
    )
    late = await asyncpg.connect(database.dsn)
    try:
        async with running(settings) as daemon:
            # 1.
            transaction = late.transaction()
            await transaction.start()
            late_jobs = [new_job("test.late", [n]) for n in range(10)]
            for job in late_jobs:
                await late.execute(
                    "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2)",
                    job["id"],
                    json.dumps(job),
                )
            parked = await _parked_for_an_hour(conn)
            # 2.
            claims_before = _claims(daemon)
            for _ in range(10):
                early = await produce(conn, 20)

                async def published(ids: list[str] = early) -> bool:
                    return set(ids) <= set(emulator.emulator.ledger())

                await eventually(published)
            assert _claims(daemon) >= claims_before + 10
            # 3.
            await transaction.commit()
            late_ids = {str(job["id"]) for job in late_jobs}

            async def late_published() -> bool:
                return late_ids <= set(emulator.emulator.ledger())

            await eventually(late_published, timeout_s=10)
    finally:
        await late.close()
    assert parked not in emulator.emulator.ledger()


async def test_a_row_set_below_the_watermark_by_hand_waits_one_full_scan(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """A row inserted with an explicit available_at an hour ago, after the watermark moved
    on, is claimed by the next full scan (here every 0.5 s)."""
    settings = relay_settings(
        database.dsn,
        emulator.url,
        relay={"poll_interval_s": 0.05, "full_scan_interval_s": 0.5},
    )
    async with running(settings):
        for _ in range(5):
            await produce(conn, 10)
            await eventually(lambda: drained(conn))
        job = new_job("test.backdated", [])
        await conn.execute(
            "INSERT INTO relayd.outbox (event_id, job, available_at) "
            "VALUES ($1, $2, now() - interval '1 hour')",
            job["id"],
            json.dumps(job),
        )
        await eventually(lambda: drained(conn), timeout_s=10)
    assert str(job["id"]) in emulator.emulator.ledger()


async def test_a_transaction_that_writes_late_in_its_life_is_published(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """A producer transaction that began long before it wrote (it read first, so it had no
    transaction id while the watermark moved on) inserts and commits: its rows are due from
    their insert (relayd_available_at()), not from its start, and are published at once."""
    settings = relay_settings(
        database.dsn,
        emulator.url,
        relay={"poll_interval_s": 0.05, "full_scan_interval_s": 3600.0},
    )
    late = await asyncpg.connect(database.dsn)
    try:
        async with running(settings) as daemon:
            transaction = late.transaction()
            await transaction.start()
            await late.fetchval("SELECT count(*) FROM relayd.outbox")  # reads: no xid yet
            await _parked_for_an_hour(conn)
            claims_before = _claims(daemon)
            for _ in range(10):
                early = await produce(conn, 20)

                async def published(ids: list[str] = early) -> bool:
                    return set(ids) <= set(emulator.emulator.ledger())

                await eventually(published)
            assert _claims(daemon) >= claims_before + 10
            job = new_job("test.late", [])
            await late.execute(
                "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2)",
                job["id"],
                json.dumps(job),
            )
            await transaction.commit()

            async def late_published() -> bool:
                return str(job["id"]) in emulator.emulator.ledger()

            await eventually(late_published, timeout_s=10)
    finally:
        await late.close()


async def test_writers_hidden_from_the_role_mean_no_watermark(
    database: Database, conn: asyncpg.Connection, relay_role: str
) -> None:
    """A transaction of another role that has written and not ended: without
    pg_read_all_stats its start is hidden, the claim says so (writers_since None) and the
    watermark falls back to full scans; with the grant the claim sees its start."""
    store = await Store.connect(dsn_as(database.dsn, relay_role), DEFAULT_TABLE, max_size=2)
    writer = await asyncpg.connect(database.dsn)  # the test's superuser: another role
    try:
        transaction = writer.transaction()
        await transaction.start()
        await writer.execute("CREATE TEMP TABLE scratch (n int)")  # takes a transaction id
        started = await writer.fetchval("SELECT now()")
        batch = await store.claim_from(10, uuid.uuid4(), 30.0, None)
        assert batch.writers_since is None
        mark = Watermark(full_scan_every_s=60.0)
        mark.advance(batch)
        mark.advance(batch)
        assert mark.scan_from is None
        await conn.execute(f"GRANT pg_read_all_stats TO {relay_role}")
        batch = await store.claim_from(10, uuid.uuid4(), 30.0, None)
        assert batch.writers_since == started
        await transaction.rollback()
    finally:
        await writer.close()
        await store.close()


# A producer's own code that runs inside its INSERT before the row is written, held at an
# advisory lock the test owns (only in a transaction that set producer.slow): the row's
# available_at is stamped, and the test decides when the INSERT goes on.
_GATE = """
CREATE FUNCTION public.producer_gate() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('producer.slow', true) = 'on' THEN
        PERFORM pg_advisory_xact_lock_shared(1414);
    END IF;
    RETURN true;
END
$$;
CREATE FUNCTION public.producer_gate_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM public.producer_gate();
    RETURN NEW;
END
$$;
"""
_SLOW_BEFORE_WRITING = {
    "before_insert_trigger": "CREATE TRIGGER producer_gate BEFORE INSERT ON relayd.outbox "
    "FOR EACH ROW EXECUTE FUNCTION public.producer_gate_trigger()",
    "check_calling_a_function": "ALTER TABLE relayd.outbox "
    "ADD CONSTRAINT producer_gate CHECK (public.producer_gate())",
    "slow_default": "ALTER TABLE relayd.outbox "
    "ADD COLUMN producer_gate boolean DEFAULT public.producer_gate()",
}


@pytest.mark.parametrize("slow", sorted(_SLOW_BEFORE_WRITING))
async def test_a_row_whose_insert_is_slow_before_writing_is_published_within_a_poll(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, slow: str
) -> None:
    """A producer's INSERT held after its row was stamped and before its first write (a
    BEFORE INSERT trigger, a CHECK calling a function, a slow default on another column)
    while other rows publish across many claims: once it commits, its row is published
    without waiting for a full scan (one every hour in this test)."""
    await conn.execute(_GATE)
    await conn.execute(_SLOW_BEFORE_WRITING[slow])
    settings = relay_settings(
        database.dsn,
        emulator.url,
        # One worker: every claim moves the one watermark a late row could fall below.
        relay={"workers": 1, "poll_interval_s": 0.05, "full_scan_interval_s": 3600.0},
    )
    slow_producer = await asyncpg.connect(database.dsn)
    job = new_job("test.slow", [])

    async def insert_slowly() -> None:
        async with slow_producer.transaction():
            await slow_producer.execute("SET LOCAL producer.slow = 'on'")
            await slow_producer.execute(
                "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2)",
                job["id"],
                json.dumps(job),
            )

    async def held_at_the_gate() -> bool:
        waiting: bool = await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 "
            "AND wait_event_type = 'Lock' AND wait_event = 'advisory')",
            slow_producer.get_server_pid(),
        )
        return waiting

    inserting: asyncio.Task[None] | None = None
    try:
        async with running(settings) as daemon:
            await conn.execute("SELECT pg_advisory_lock(1414)")
            inserting = asyncio.create_task(insert_slowly())
            await eventually(held_at_the_gate)
            claims_before = _claims(daemon)
            for _ in range(5):
                early = await produce(conn, 10)

                async def published(ids: list[str] = early) -> bool:
                    return set(ids) <= set(emulator.emulator.ledger())

                await eventually(published)
            assert _claims(daemon) >= claims_before + 5
            await conn.execute("SELECT pg_advisory_unlock(1414)")
            await inserting

            async def slow_published() -> bool:
                return str(job["id"]) in emulator.emulator.ledger()

            await eventually(slow_published, timeout_s=5)
    finally:
        if inserting is not None:
            inserting.cancel()
            await asyncio.gather(inserting, return_exceptions=True)
        await slow_producer.close()


async def test_the_default_makes_the_inserting_transaction_a_writer_before_its_triggers(
    conn: asyncpg.Connection,
) -> None:
    """available_at's default gives the inserting transaction its id (so it shows as a
    writer in pg_stat_activity) before any BEFORE INSERT trigger runs: what a trigger sees."""
    await conn.execute(
        """
        CREATE FUNCTION public.record_xid() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            NEW.last_error := coalesce(txid_current_if_assigned()::text, 'no id yet');
            RETURN NEW;
        END
        $$;
        CREATE TRIGGER record_xid BEFORE INSERT ON relayd.outbox
            FOR EACH ROW EXECUTE FUNCTION public.record_xid();
        """
    )
    job = new_job("test.xid", [])
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2)", job["id"], json.dumps(job)
        )
        xid = await conn.fetchval("SELECT txid_current()::text")
    seen = await conn.fetchval(
        "SELECT last_error FROM relayd.outbox WHERE event_id = $1", job["id"]
    )
    assert seen == xid
