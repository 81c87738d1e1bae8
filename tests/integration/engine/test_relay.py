"""The relay engine against real PostgreSQL and the OJS emulator over loopback: the claim ->
publish -> settle cycle and docs/contract.md C1-C8."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from relayd.core.outcomes import Published
from relayd.engine.claim import Claim
from relayd.engine.relay import RelayWorker
from relayd.operator.doctor import plan_scans
from relayd.producer import enqueue_many, new_job, uuid7
from relayd.sinks import SendWindow
from relayd.store import Store
from relayd.telemetry.metrics import RelayMetrics
from relayd.testing.emulator import EmulatorConfig, RunningEmulator, start_emulator
from relayd.testing.emulator.faults import FaultRule
from tests.support import (
    Database,
    drained,
    eventually,
    produce,
    relay_settings,
    run_until_idle,
    running,
)

LEASE_AUDIT = """
CREATE TABLE lease_audit (
    seq bigserial PRIMARY KEY,
    event_id uuid NOT NULL,
    old_owner uuid,
    new_owner uuid,
    published boolean NOT NULL
);
CREATE FUNCTION audit_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease_audit (event_id, old_owner, new_owner, published)
    VALUES (NEW.event_id, OLD.lease_owner, NEW.lease_owner,
            OLD.published_at IS NULL AND NEW.published_at IS NOT NULL);
    RETURN NULL;
END $$;
CREATE TRIGGER audit_lease AFTER UPDATE ON relayd.outbox
    FOR EACH ROW EXECUTE FUNCTION audit_lease();
"""


async def _dead(conn: asyncpg.Connection) -> dict[str, str]:
    rows = await conn.fetch(
        "SELECT event_id::text, dead_reason FROM relayd.outbox WHERE dead_at IS NOT NULL"
    )
    return {r["event_id"]: r["dead_reason"] for r in rows}


@pytest.mark.parametrize("batch", ["auto", "off"])
async def test_two_supervisors_share_one_outbox(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, batch: str
) -> None:
    """Two processes x 4 workers, 5,000 rows: each published once, never leased twice at once."""
    await conn.execute(LEASE_AUDIT)
    ids = await produce(conn, 5000)
    settings = relay_settings(database.dsn, emulator.url, sink={"batch": batch})
    # Both run until nothing is pending in the outbox they share: each returns only once every
    # row is published, whichever of them published it.
    async with asyncio.TaskGroup() as both:
        both.create_task(run_until_idle(settings, seed=1, timeout_s=90))
        both.create_task(run_until_idle(settings, seed=2, timeout_s=90))
    assert await drained(conn)
    ledger = emulator.emulator.ledger()
    assert set(ledger) == set(ids)
    assert [i for i, e in ledger.items() if e.created != 1] == []
    published = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NOT NULL"
    )
    assert published == 5000
    # Every lease change goes NULL -> owner (claim) or owner -> NULL (settle): never from one
    # owner straight to another, which would mean two owners at once.
    overlaps = await conn.fetchval(
        "SELECT count(*) FROM lease_audit WHERE old_owner IS NOT NULL AND new_owner IS NOT NULL"
    )
    assert overlaps == 0
    owners = await conn.fetchval(
        "SELECT count(DISTINCT new_owner) FROM lease_audit WHERE new_owner IS NOT NULL"
    )
    assert owners > 2  # many claims, by both processes
    assert await conn.fetchval("SELECT count(*) FROM lease_audit WHERE published") == 5000


def _count(metrics: RelayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_stale_settle_changes_nothing(
    database: Database, conn: asyncpg.Connection, store: Store
) -> None:
    """C3: after the lease expired and another owner claimed, the old token settles nothing."""
    [event_id] = await produce(conn, 1)
    first = uuid.uuid4()
    rows_a = await store.claim(10, first, 30.0)
    assert [r.event_id for r in rows_a] == [event_id]
    # Expire the lease by moving time in SQL, not by sleeping.
    await conn.execute("UPDATE relayd.outbox SET available_at = now() - interval '1 second'")
    second = uuid.uuid4()
    rows_b = await store.claim(10, second, 30.0)
    assert [r.event_id for r in rows_b] == [event_id]
    assert rows_b[0].claimed_before  # the second owner will reconcile with a GET first

    settings = relay_settings(database.dsn, "http://127.0.0.1:9")
    from relayd.daemon.lifecycle import Daemon  # noqa: PLC0415

    daemon = Daemon(settings, metrics=RelayMetrics())
    worker = RelayWorker(daemon.make_context(store), "stale-test")
    now = asyncio.get_running_loop().time()
    claim_a = Claim(
        first,
        rows_a,
        sent_at=now,
        window=SendWindow(now + 10),
        lease_ends=now + 30,
        answered_at=now,
    )
    await worker.settle(claim_a, {event_id: Published("available")}, {})

    row = await conn.fetchrow(
        "SELECT lease_owner, published_at, attempts FROM relayd.outbox WHERE event_id = $1",
        event_id,
    )
    assert row is not None
    assert row["lease_owner"] == second
    assert row["published_at"] is None
    assert row["attempts"] == 2
    assert _count(daemon.metrics, "relayd_outcomes_total", outcome="stale") == 1
    assert _count(daemon.metrics, "relayd_outcomes_total", outcome="published") == 0


@pytest.mark.parametrize("batch", ["auto", "off"])
@pytest.mark.parametrize("mode", ["spec409", "overwrite", "pk500"])
async def test_store_then_drop_is_reconciled_without_a_second_creation(
    database: Database, conn: asyncpg.Connection, mode: str, batch: str
) -> None:
    """C2: the first POST is stored but its answer lost; the next attempt GETs and publishes.

    Whatever a server does with a reused id (409, silent overwrite, retryable 500), every row
    ends published with one creation on the sink and no overwrite.
    """
    ids = await produce(conn, 40)
    async with await start_emulator(EmulatorConfig(duplicate_mode=mode)) as sink:  # type: ignore[arg-type]
        for event_id in ids:
            sink.emulator.add_fault(
                FaultRule(
                    action="store_then_drop",
                    method="POST",
                    path_prefix="/ojs/v1/jobs",
                    job_id=event_id,
                    times=1,
                )
            )
        d = await run_until_idle(relay_settings(database.dsn, sink.url, sink={"batch": batch}))
        assert await drained(conn)
        ledger = sink.emulator.ledger()
    assert set(ledger) == set(ids)
    assert {(e.created, e.overwrites) for e in ledger.values()} == {(1, 0)}
    assert await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NOT NULL"
    ) == len(ids)
    assert _count(d.metrics, "relayd_outcomes_total", outcome="reconciled") == len(ids)


@pytest.mark.parametrize("mode", ["spec409", "pk500"])
async def test_id_collision_is_dead_lettered_as_conflict(
    database: Database, conn: asyncpg.Connection, mode: str
) -> None:
    """C2: a different job already under our id is a conflict, never a publish."""
    event_id = uuid7()
    async with await start_emulator(EmulatorConfig(duplicate_mode=mode)) as sink:  # type: ignore[arg-type]
        import aiohttp  # noqa: PLC0415

        other = {"id": event_id, "type": "other.job", "args": ["not ours"]}
        async with aiohttp.ClientSession() as http:
            response = await http.post(f"{sink.url}/ojs/v1/jobs", json=other)
            assert response.status == 201
        ours = new_job("order.fulfill", [{"order_id": 1}], job_id=event_id)
        good = await produce(conn, 5)
        await enqueue_many(conn, [ours])
        await run_until_idle(relay_settings(database.dsn, sink.url, sink={"batch": "off"}))
        assert await drained(conn)
        stored = sink.emulator.job(event_id)
    assert await _dead(conn) == {event_id: "conflict"}
    assert stored is not None
    assert stored["args"] == ["not ours"]  # the sink's job was never touched
    last_error = await conn.fetchval(
        "SELECT last_error FROM relayd.outbox WHERE event_id = $1", event_id
    )
    assert "type" in last_error
    assert "args" in last_error
    assert await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NOT NULL"
    ) == len(good)


def _poison_jobs() -> dict[str, dict[str, Any]]:
    big = new_job("test.big", ["x" * (2 * 1024 * 1024)])
    return {
        "invalid_envelope": {"id": uuid7(), "type": "test.echo", "args": {"n": 1}},
        "too_large": big,
        # Tags must be strings: relayd does not check their items, the sink answers 400.
        "sink_rejected": new_job("test.echo", [], options={"tags": [1, 2]}),
        "sink_unprocessable": new_job("test.echo", [], options={"retry": {"max_attempts": -1}}),
    }


async def test_poison_rows_are_isolated_with_distinct_reasons(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """C6: args object, 2 MiB, sink 400 and 422 dead-letter at once; neighbours publish."""
    await conn.execute("ALTER TABLE relayd.outbox DISABLE TRIGGER relayd_row_checks")
    poison = _poison_jobs()
    good = [new_job("test.echo", [i]) for i in range(20)]
    jobs = good[:10] + list(poison.values()) + good[10:]
    async with conn.transaction():
        await enqueue_many(conn, jobs)  # one commit: all in the same claim batch
    settings = relay_settings(database.dsn, emulator.url, sink={"batch": "off"})
    daemon = await run_until_idle(settings)
    assert await drained(conn)
    assert await _dead(conn) == {str(job["id"]): reason for reason, job in poison.items()}
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") == 1
    ledger = emulator.emulator.ledger()
    assert set(ledger) >= {str(j["id"]) for j in good}
    assert str(poison["too_large"]["id"]) not in ledger  # never sent
    assert str(poison["invalid_envelope"]["id"]) not in ledger
    assert _count(daemon.metrics, "relayd_dead_lettered_total", reason="too_large") == 1


async def test_poison_rows_in_a_sink_batch_do_not_stall_it(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """C6 in batch mode: a 400 naming an index dead-letters that row, the batch goes on."""
    poison = _poison_jobs()
    del poison["invalid_envelope"]
    good = [new_job("test.echo", [i]) for i in range(30)]
    async with conn.transaction():
        await enqueue_many(conn, good[:15] + list(poison.values()) + good[15:])
    await run_until_idle(relay_settings(database.dsn, emulator.url, sink={"batch": "on"}))
    assert await drained(conn)
    dead = await _dead(conn)
    assert set(dead) == {str(job["id"]) for job in poison.values()}
    assert dead[str(poison["too_large"]["id"])] == "too_large"
    ledger = emulator.emulator.ledger()
    assert {(ledger[str(j["id"])].created) for j in good} == {1}
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") == 1


async def test_sink_outage_longer_than_the_retry_budget_dead_letters_nothing(
    database: Database, conn: asyncpg.Connection
) -> None:
    """C5: connection refused for longer than max_attempts x cap_s: no dead letters, then
    the backlog drains once the sink is back."""
    ids = await produce(conn, 300)
    sink = await start_emulator()
    port = int(sink.url.rsplit(":", 1)[1])
    await sink.stop()  # nothing listens on the port now: connection refused
    retry = {
        "base_s": 0.01,
        "cap_s": 0.1,
        "max_attempts": 3,
        "breaker_threshold": 3,
        "breaker_cooldown_s": 0.05,
    }
    settings = relay_settings(database.dsn, sink.url, retry=retry)
    loop = asyncio.get_running_loop()
    async with running(settings) as daemon:
        started = loop.time()

        async def opened_often() -> bool:
            return _count(daemon.metrics, "relayd_breaker_opened_total") >= 10

        await eventually(opened_often)
        outage_s = loop.time() - started
        assert outage_s > retry["max_attempts"] * retry["cap_s"]
        assert await _dead(conn) == {}
        assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") < 3
        async with await start_emulator(port=port) as back:
            await eventually(lambda: drained(conn))
            ledger = back.emulator.ledger()
    assert await _dead(conn) == {}
    assert set(ledger) == set(ids)
    assert {e.created for e in ledger.values()} == {1}


async def test_notification_wakes_an_idle_worker(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """With a 60 s poll interval, an insert is published at once thanks to LISTEN/NOTIFY."""
    settings = relay_settings(database.dsn, emulator.url, relay={"poll_interval_s": 60.0})
    async with running(settings):
        await eventually(lambda: drained(conn))  # the workers went idle on an empty outbox
        [event_id] = await produce(conn, 1)
        await eventually(lambda: drained(conn), timeout_s=10)
    assert event_id in emulator.emulator.ledger()


async def test_idle_worker_wakes_when_a_backoff_ends(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """A row parked in backoff is taken when it falls due, not at the next poll."""
    [event_id] = await produce(conn, 1)
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = now() + interval '500 milliseconds'"
    )
    settings = relay_settings(database.dsn, emulator.url, relay={"poll_interval_s": 60.0})
    await run_until_idle(settings, timeout_s=10)
    assert await drained(conn)
    assert event_id in emulator.emulator.ledger()


async def test_poll_only_without_listen(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """relay.listen = false (PgBouncer transaction pooling) publishes by polling alone."""
    settings = relay_settings(
        database.dsn, emulator.url, relay={"listen": False, "poll_interval_s": 0.1}
    )
    async with running(settings):
        await eventually(lambda: drained(conn))
        ids = await produce(conn, 10)
        await eventually(lambda: drained(conn))
    assert set(emulator.emulator.ledger()) == set(ids)


async def test_claim_is_an_index_scan_on_a_large_backlog(
    conn: asyncpg.Connection, store: Store
) -> None:
    """The claim reads the partial claim index in order whatever the backlog (C4)."""
    await conn.execute(
        """
        INSERT INTO relayd.outbox (event_id, job, available_at)
        SELECT id, jsonb_build_object('id', id::text, 'type', 't.x', 'args', '[]'::jsonb),
               now() - (n || ' seconds')::interval
        FROM (SELECT relayd.relayd_uuidv7() AS id, n FROM generate_series(1, 50000) n) s
        """
    )
    await conn.execute("UPDATE relayd.outbox SET published_at = now() WHERE random() < 0.5")
    await conn.execute("ANALYZE relayd.outbox")
    from relayd.store import load_queries  # noqa: PLC0415

    queries = load_queries(store.table)
    for scan_from in (None, datetime.now(UTC) - timedelta(hours=1)):
        args = (100, uuid.uuid4(), 30.0, str(store.table), scan_from, True)
        plan = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {queries['claim']}", *args)
        scans = plan_scans(json.loads(plan))
        assert ("Index Scan", "outbox_relayd_claim") in scans
        assert not [scan for scan in scans if scan[0] == "Seq Scan" and scan[1] == "outbox"]
        # The claim a relay runs: the same scan for unordered rows, the keys' heads through
        # their own index.
        for walk_from in (None, "k"):
            plan = await conn.fetchval(
                f"EXPLAIN (FORMAT JSON) {queries['claim_ordered']}", *args, walk_from
            )
            scans = plan_scans(json.loads(plan))
            assert ("Index Scan", "outbox_relayd_claim") in scans
            assert {where for _, where in scans} >= {"outbox_relayd_key_heads"}
            assert not [scan for scan in scans if scan[0] == "Seq Scan" and scan[1] == "outbox"]


async def test_gateway_variant_with_top_level_queue(
    database: Database, conn: asyncpg.Connection
) -> None:
    """Envelopes routed by a top-level queue, on the gateway variant that reads it: a lost
    answer is reconciled by comparing the GET's queue with the top-level one."""
    jobs = [
        {"id": uuid7(), "type": "order.fulfill", "args": [{"order_id": n}], "queue": "gateway-jobs"}
        for n in range(20)
    ]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    async with await start_emulator(EmulatorConfig.gateway_variant()) as sink:
        for job in jobs:
            sink.emulator.add_fault(
                FaultRule(action="store_then_drop", method="POST", job_id=str(job["id"]))
            )
        await run_until_idle(relay_settings(database.dsn, sink.url, sink={"batch": "off"}))
        assert await drained(conn)
        ledger = sink.emulator.ledger()
    assert await _dead(conn) == {}
    assert {(e.created, e.queue) for e in ledger.values()} == {(1, "gateway-jobs")}
