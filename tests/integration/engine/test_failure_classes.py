"""Which failures belong to a row (dead-lettered), to the connection (retried) or to relayd
itself (a loud exit 1): no row, header or parked timestamp may stop the daemon (C6), and a
real bug names the step, the statement and the rows it held."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping, Sequence

import asyncpg
import pytest
import structlog

from relayd.core.envelope import Envelope
from relayd.core.outcomes import Outcome
from relayd.core.rows import ClaimedRow
from relayd.daemon.lifecycle import Daemon
from relayd.producer import enqueue_many, new_job, uuid7
from relayd.sinks import SendWindow
from relayd.sinks.ojs.sink import OjsSink
from relayd.telemetry.metrics import RelayMetrics
from relayd.testing.emulator import RunningEmulator
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


async def _dead(conn: asyncpg.Connection) -> dict[str, tuple[str, str]]:
    rows = await conn.fetch(
        "SELECT event_id::text, dead_reason, last_error FROM relayd.outbox "
        "WHERE dead_at IS NOT NULL"
    )
    return {r["event_id"]: (r["dead_reason"], r["last_error"]) for r in rows}


async def _published(conn: asyncpg.Connection) -> set[str]:
    rows = await conn.fetch(
        "SELECT event_id::text FROM relayd.outbox WHERE published_at IS NOT NULL"
    )
    return {r[0] for r in rows}


async def _insert_raw(conn: asyncpg.Connection, event_id: str, job_text: str) -> None:
    """Insert a stored envelope byte for byte (the producer's JSON, not ours)."""
    await conn.execute(
        "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2::jsonb)", event_id, job_text
    )


def _nested_job(event_id: str, levels: int) -> str:
    return f'{{"id": "{event_id}", "type": "test.deep", "args": {"[" * levels}1{"]" * levels}}}'


@pytest.mark.parametrize("batch", ["on", "off"])
async def test_a_deeply_nested_envelope_is_dead_lettered_alone(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, batch: str
) -> None:
    """C6: a 2 KB row nesting 1,000 levels (valid jsonb) is dead-lettered as invalid_envelope;
    its neighbours in the same claim publish and the daemon keeps running."""
    deep = uuid7()
    neighbours = [new_job("test.echo", [n]) for n in range(30)]
    async with conn.transaction():
        await enqueue_many(conn, neighbours[:15])
        await _insert_raw(conn, deep, _nested_job(deep, 1000))
        await enqueue_many(conn, neighbours[15:])
    async with running(relay_settings(database.dsn, emulator.url, sink={"batch": batch})) as d:
        await eventually(lambda: drained(conn))
        assert not d.stopping.is_set()  # nothing crashed, nothing began a drain
    reason, error = (await _dead(conn))[deep]
    assert reason == "invalid_envelope"
    assert "nested deeper than 256 levels" in error
    assert await _published(conn) == {str(job["id"]) for job in neighbours}
    assert deep not in emulator.emulator.ledger()


async def test_a_deep_envelope_within_the_bound_is_reconciled_after_a_lost_answer(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """C2: a 250-level envelope whose first answer is lost is compared after a GET without
    recursion, and published once."""
    deep = uuid7()
    await _insert_raw(conn, deep, _nested_job(deep, 250))
    emulator.emulator.add_fault(FaultRule(action="store_then_drop", method="POST", job_id=deep))
    async with running(relay_settings(database.dsn, emulator.url, sink={"batch": "off"})) as d:
        await eventually(lambda: drained(conn))
        assert not d.stopping.is_set()
    assert await _published(conn) == {deep}
    assert emulator.emulator.ledger()[deep].created == 1
    value = d.metrics.registry.get_sample_value("relayd_outcomes_total", {"outcome": "reconciled"})
    assert value == 1


async def test_an_integer_longer_than_pythons_limit_is_sent_not_called_invalid(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """A 5,000-digit integer is valid JSON: relayd sends the row and lets the sink judge it,
    instead of dead-lettering it as "not JSON"."""
    big = uuid7()
    await _insert_raw(conn, big, f'{{"id": "{big}", "type": "test.big", "args": [{"7" * 5000}]}}')
    ids = await produce(conn, 5)
    await run_until_idle(relay_settings(database.dsn, emulator.url, sink={"batch": "off"}))
    assert await drained(conn)
    # The emulator, like a server decoding numbers as doubles, refuses it with a 400: the
    # reason is the sink's verdict, and the sink did see the row.
    reason, error = (await _dead(conn))[big]
    assert reason == "sink_rejected"
    assert error.startswith("HTTP 400: invalid_request")
    assert await _published(conn) == set(ids)


@pytest.mark.parametrize("created_at", ["-infinity", "infinity"])
async def test_an_infinite_created_at_does_not_stop_the_outbox(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, created_at: str
) -> None:
    """A row whose created_at is infinite (a table without relayd's check) no longer fails
    every claim: it is dead-lettered and the rows behind it publish."""
    await conn.execute("ALTER TABLE relayd.outbox DISABLE TRIGGER relayd_row_checks")
    bad = uuid7()
    await conn.execute(
        f"INSERT INTO relayd.outbox (event_id, job, created_at) VALUES ($1, $2, '{created_at}')",
        bad,
        json.dumps(new_job("test.echo", [], job_id=bad)),
    )
    ids = await produce(conn, 60)
    async with running(relay_settings(database.dsn, emulator.url)) as d:
        await eventually(lambda: drained(conn))
        assert not d.stopping.is_set()
    assert (await _dead(conn))[bad] == ("invalid_envelope", "created_at is not a finite time")
    assert await _published(conn) == set(ids)


async def test_a_row_parked_at_infinity_leaves_idle_workers_running(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """An operator parks a row with available_at = 'infinity' (and one at '-infinity'): the
    idle workers' next-due query survives it, the parked row waits, the other publishes."""
    parked, early = await produce(conn, 2)
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = 'infinity' WHERE event_id = $1", parked
    )
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = '-infinity' WHERE event_id = $1", early
    )
    settings = relay_settings(database.dsn, emulator.url, relay={"poll_interval_s": 0.05})
    async with running(settings) as d:

        async def idled_many_times() -> bool:
            claims = d.metrics.registry.get_sample_value("relayd_claims_total") or 0
            return claims >= 40  # every worker went idle (and asked for the next due) often

        await eventually(idled_many_times)
        assert not d.stopping.is_set()
    assert await _published(conn) == {early}
    assert await conn.fetchval(
        "SELECT available_at = 'infinity' FROM relayd.outbox WHERE event_id = $1", parked
    )


@pytest.mark.parametrize("header", ["\u00b2", "\u0663", "1e400", "Thu, 99 Foo 2026"])
async def test_a_strange_retry_after_on_a_success_is_ignored(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, header: str
) -> None:
    """A 201 carrying `Retry-After: ²` (or any other non-value) publishes the row."""
    [event_id] = await produce(conn, 1)
    body = json.dumps({"job": {"id": event_id, "state": "available"}})
    emulator.emulator.add_fault(
        FaultRule(
            action="store_then_status",
            method="POST",
            job_id=event_id,
            status=201,
            retry_after=header,
            body=body,
        )
    )
    async with running(relay_settings(database.dsn, emulator.url, sink={"batch": "off"})) as d:
        await eventually(lambda: drained(conn))
        assert not d.stopping.is_set()
    assert await _published(conn) == {event_id}


async def test_a_statement_failing_for_good_stops_the_daemon_loudly(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """relayd's own class: a column dropped under a running relay makes the publish settle
    fail for good; the daemon logs the step, the statement and the rows, drains, exits 1."""
    settings = relay_settings(database.dsn, emulator.url, relay={"workers": 2})
    daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(1))
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(daemon.run())
        async with asyncio.timeout(30):
            await daemon.ready.wait()
        await conn.execute("ALTER TABLE relayd.outbox DROP COLUMN sink_state")
        ids = await produce(conn, 5)
        async with asyncio.timeout(30):
            code = await task
    assert code == 1
    crashes = [entry for entry in logs if entry["event"] == "daemon.task_crashed"]
    assert crashes
    crash = crashes[0]
    assert crash["step"] == "settle"
    assert crash["statement"] == "settle_published"
    assert set(crash["event_ids"]) <= set(ids)
    assert crash["event_ids"]
    assert "UndefinedColumnError" in crash["error"]
    stopped = [entry for entry in logs if entry["event"] == "daemon.stopped"]
    assert stopped[-1]["exit_code"] == 1
    # The sink has the crashed settle's rows; the outbox does not say so: their leases
    # expire, and the next claimer reconciles them with a GET (C2), once the column is back.
    # (The other worker may have claimed some of the rows and released them unsent: the
    # crash stops attempts that had not started.)
    assert set(crash["event_ids"]) <= set(emulator.emulator.ledger())


async def test_a_bug_while_publishing_names_the_row_and_drains_the_rest(
    database: Database,
    conn: asyncpg.Connection,
    emulator: RunningEmulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """relayd's own class in the publish step (a bug injected into relayd's sink code for one
    row): the log names that row, the sibling attempts finish first, the daemon exits 1."""
    ids = await produce(conn, 20)
    cursed = ids[7]
    real_publish = OjsSink.publish

    async def buggy_publish(
        self: OjsSink,
        rows: Sequence[ClaimedRow],
        envelopes: Mapping[str, Envelope],
        *,
        window: SendWindow,
    ) -> dict[str, Outcome]:
        if any(row.event_id == cursed for row in rows):
            raise ZeroDivisionError("a bug")
        return await real_publish(self, rows, envelopes, window=window)

    monkeypatch.setattr(OjsSink, "publish", buggy_publish)
    settings = relay_settings(
        database.dsn, emulator.url, relay={"workers": 1}, sink={"batch": "off"}
    )
    daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(1))
    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(30):
            code = await daemon.run()
    assert code == 1
    [crash] = [entry for entry in logs if entry["event"] == "daemon.task_crashed"]
    assert (crash["step"], crash["event_ids"]) == ("publish", [cursed])
    assert "ZeroDivisionError" in crash["error"]
    # The siblings' attempts ran to their end (each is on the sink once); nothing of this
    # claim was settled, so its leases expire and the next claimer reconciles with a GET.
    ledger = emulator.emulator.ledger()
    assert set(ledger) == set(ids) - {cursed}
    assert {entry.created for entry in ledger.values()} == {1}
