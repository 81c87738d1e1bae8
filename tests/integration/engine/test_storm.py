"""The poison-storm guard on real PostgreSQL: a sink that rejects the rows of one queue and
type pauses that queue and type alone (its neighbours flow), an operator sees and discards
what it holds, no replica dead-letters a row of a paused key, and a guard that cannot store
its pause holds the key itself instead of dead-lettering it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import asyncpg

from relayd.core.outcomes import Published
from relayd.daemon.lifecycle import Daemon
from relayd.engine.relay import RelayWorker
from relayd.store import Store
from relayd.telemetry.metrics import RelayMetrics
from relayd.testing.emulator import RunningEmulator
from relayd.testing.emulator.faults import FaultRule
from relayd.testing.processes import free_port
from tests.support import (
    Database,
    dsn_as,
    eventually,
    produce,
    relay_settings,
    run_relayd,
    run_until_idle,
    running,
)

WINDOW = 10
# A producer's bad release: the emulator refuses a negative retry budget with its own error
# body naming the field (400 invalid_request), as a real server does.
BAD_RETRY = {"retry": {"max_attempts": -1}}
STORM = {"storm_window": WINDOW, "storm_threshold": 0.5}


async def _bad(conn: asyncpg.Connection, count: int, **job: Any) -> list[str]:
    """Rows of (orders, order.fulfill) unless told otherwise, which the sink rejects."""
    kind = {"job_type": "order.fulfill", "queue": "orders"} | job
    return await produce(conn, count, options=BAD_RETRY, **kind)


def _stored(emulator: RunningEmulator) -> set[str]:
    """The ids the sink holds a job under (its ledger also lists refused requests)."""
    return {event_id for event_id, entry in emulator.emulator.ledger().items() if entry.job}


async def _readyz(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/readyz") as answer:
        body: dict[str, Any] = await answer.json()
        return answer.status, body


def _sample(daemon: Daemon, name: str) -> float:
    value = daemon.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


async def _count(conn: asyncpg.Connection, where: str, *args: object) -> int:
    value: int = await conn.fetchval(f"SELECT count(*) FROM relayd.outbox WHERE {where}", *args)
    return value


async def test_rejections_of_one_queue_and_type_pause_only_them(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, cli_env: dict[str, str]
) -> None:
    """1. the sink rejects every row of (orders, order.fulfill): the guard pauses that queue
    and type alone, audited, with at most one window dead-lettered; 2. the other type of the
    same queue, and another queue, publish meanwhile; 3. `relayd status` shows the pause and
    the rows it holds, `relayd held list` lists them; 4. `relayd held discard --all` takes
    them out, dead-lettered and discarded at once, audited; nothing is pending."""
    # The rejected rows come first in claim order, and one worker claims them first: on a
    # guard that paused everything, every row behind them would wait for an operator.
    bad = await _bad(conn, 60)
    ship = await produce(conn, 100, job_type="order.ship", queue="orders")
    mail = await produce(conn, 100, job_type="mail.send", queue="mail")
    settings = relay_settings(database.dsn, emulator.url, relay=STORM | {"workers": 1})
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}
    async with running(settings) as relay:

        async def neighbours_published() -> bool:
            return set(ship) | set(mail) <= _stored(emulator)

        async def paused_and_settled() -> bool:
            paused = await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses")
            leased = await _count(conn, "lease_owner IS NOT NULL AND published_at IS NULL")
            return paused == 1 and leased == 0

        # 1. and 2.
        await eventually(neighbours_published)
        await eventually(paused_and_settled)
        assert _sample(relay, "relayd_poison_storm_trips_total") == 1
        assert _sample(relay, "relayd_poison_storm_local_holds") == 0
    pause = await conn.fetchrow("SELECT queue, type, reason, paused_by FROM relayd.relayd_pauses")
    assert pause is not None
    assert (pause["queue"], pause["type"]) == ("orders", "order.fulfill")
    assert pause["reason"].startswith("poison storm: the sink rejected ")
    assert pause["reason"].endswith(" rows of queue orders, type order.fulfill")
    assert pause["paused_by"].startswith("relayd@")
    dead = await _count(conn, "dead_at IS NOT NULL")
    assert dead < WINDOW
    held = len(bad) - dead
    assert await _count(conn, "published_at IS NULL AND dead_at IS NULL") == held
    assert not set(bad) & _stored(emulator)

    # 3. (the held rows' backoffs moved past in SQL: each is due, so the pause holds it now)
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = now() - interval '1 second' "
        "WHERE published_at IS NULL AND dead_at IS NULL"
    )
    code, out, err = await run_relayd("status", "--json", env=env)
    assert (code, err) == (0, "")
    status = json.loads(out)
    [shown] = status["pauses"]
    assert (shown["queue"], shown["type"], shown["held_rows"]) == ("orders", "order.fulfill", held)
    assert status["backlog"]["rows"]["paused"] == held
    code, out, err = await run_relayd(
        "held", "list", "--queue", "orders", "--limit", "1000", "--json", env=env
    )
    assert (code, err) == (0, "")
    listed = json.loads(out)["held"]
    assert {row["event_id"] for row in listed} <= set(bad)
    assert len(listed) == held
    assert {row["type"] for row in listed} == {"order.fulfill"}

    # 4.
    code, out, err = await run_relayd(
        "held", "discard", "--all", "--type", "order.fulfill", "--reason", "bad release 1.2",
        env=env,
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert out.startswith(f"discarded {held} held rows in 1 batch; audit #")
    assert await _count(conn, "published_at IS NULL AND dead_at IS NULL") == 0
    assert (
        await _count(
            conn,
            "dead_reason = 'held_discarded' AND discarded_at IS NOT NULL "
            "AND discard_reason = 'bad release 1.2'",
        )
        == held
    )
    audit = await conn.fetchrow(
        "SELECT action, row_count, reason FROM relayd.relayd_audit ORDER BY id DESC LIMIT 1"
    )
    assert audit is not None
    assert tuple(audit.values()) == ("held.discard", held, "bad release 1.2")


async def test_the_storm_bound_holds_per_replica(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """Three replicas on a key the sink rejects: each dead-letters fewer than one window of
    it before its own guard trips (the documented bound: storm_window per replica); the key
    ends paused, its neighbours published."""
    await _bad(conn, 300)
    good = await produce(conn, 60, job_type="order.ship", queue="orders")
    settings = relay_settings(
        database.dsn, emulator.url, relay=STORM | {"workers": 2, "batch_size": 5}
    )
    async with running(settings, seed=1), running(settings, seed=2), running(settings, seed=3):

        async def settled() -> bool:
            paused = await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses")
            leased = await _count(conn, "lease_owner IS NOT NULL AND published_at IS NULL")
            return paused == 1 and leased == 0 and set(good) <= _stored(emulator)

        await eventually(settled)
    assert await _count(conn, "dead_at IS NOT NULL") < 3 * WINDOW


async def test_no_row_of_a_key_paused_meanwhile_is_dead_lettered(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, store: Store
) -> None:
    """A replica whose own guard has not tripped settles rejections of a queue and type that
    another replica paused while its claim was in flight: retried, refunded, not
    dead-lettered. A rejection of a key no pause holds is still dead-lettered (C6)."""
    bad = await _bad(conn, 4)
    lone = await _bad(conn, 1, job_type="mail.send", queue="mail")
    settings = relay_settings(database.dsn, emulator.url, relay=STORM, sink={"batch": "off"})
    daemon = Daemon(settings, metrics=RelayMetrics())
    ctx = daemon.make_context(store)
    await ctx.sink.start()
    try:
        worker = RelayWorker(ctx, "in-flight")
        claim = await worker.claim(10)
        assert {row.event_id for row in claim.rows} == set(bad) | set(lone)
        # Another replica's guard trips and stores its pause meanwhile.
        await store.pause("orders", "order.fulfill", "poison storm: elsewhere", "relayd@other")
        outcomes, keys = await worker.publish(claim)
        assert not any(isinstance(outcome, Published) for outcome in outcomes.values())
        await worker.settle(claim, outcomes, keys)
    finally:
        await ctx.sink.close()
    rows = {
        r["id"]: (r["dead_reason"], r["attempts"], r["last_error"])
        for r in await conn.fetch(
            "SELECT event_id::text AS id, dead_reason, attempts, last_error FROM relayd.outbox"
        )
    }
    for event_id in bad:
        reason, attempts, error = rows[event_id]
        assert (reason, attempts) == (None, 0)
        assert error.startswith("poison storm, not dead-lettered: HTTP 422")
    assert rows[lone[0]][0] == "sink_unprocessable"


async def test_a_guard_that_cannot_store_its_pause_holds_the_key_itself(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, relay_role: str
) -> None:
    """1. the relay's role may not INSERT into relayd_pauses: the guard trips, its pause is
    refused; the relay stops dead-lettering that key on its own (at most one window dead),
    says so (/readyz 503, the local-hold gauge, the storm_pause chore failing) and keeps
    publishing the rest; 2. once the grant is back the chore stores the pause, and the key's
    rows stay pending under it."""
    await conn.execute(f"REVOKE INSERT ON relayd.relayd_pauses FROM {relay_role}")
    bad = await _bad(conn, 200)
    good = await produce(conn, 40, job_type="mail.send", queue="mail")
    listen = f"127.0.0.1:{free_port()}"
    settings = relay_settings(
        dsn_as(database.dsn, relay_role),
        emulator.url,
        relay=STORM | {"poll_interval_s": 0.2},
        http={"enabled": True, "listen": listen},
    )
    async with running(settings) as relay:

        async def held_locally() -> bool:
            return _sample(relay, "relayd_poison_storm_local_holds") == 1

        async def neighbours_published() -> bool:
            return set(good) <= _stored(emulator)

        # 1.
        await eventually(held_locally)
        await eventually(neighbours_published)
        status, body = await _readyz(f"http://{listen}")
        assert status == 503
        assert body["reason"].startswith("poison-storm pause not stored; holding queue orders")
        assert "permission denied" in body["housekeeping"]["storm_pause"]["error"]
        value = relay.metrics.registry.get_sample_value
        assert value("relayd_housekeeping_failing", {"chore": "storm_pause"}) == 1
        assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses") == 0
        dead = await _count(conn, "dead_at IS NOT NULL")
        assert dead < WINDOW
        assert not set(bad) & _stored(emulator)

        # 2. (INSERT: the pause; the audit row takes a number from a sequence)
        await conn.execute(f"GRANT INSERT ON relayd.relayd_pauses TO {relay_role}")
        await conn.execute(f"GRANT USAGE ON SEQUENCE relayd.relayd_audit_id_seq TO {relay_role}")

        async def stored() -> bool:
            return _sample(relay, "relayd_poison_storm_local_holds") == 0

        await eventually(stored)
        assert await _readyz(f"http://{listen}") == (200, {"status": "ready"})
        assert value("relayd_housekeeping_failing", {"chore": "storm_pause"}) == 0
    pause = await conn.fetchrow("SELECT queue, type FROM relayd.relayd_pauses")
    assert pause is not None
    assert tuple(pause.values()) == ("orders", "order.fulfill")
    assert await _count(conn, "dead_at IS NOT NULL") == dead
    assert await _count(conn, "published_at IS NULL AND dead_at IS NULL") == len(bad) - dead


async def test_after_a_resume_the_held_key_publishes_once_the_sink_is_fixed(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, store: Store
) -> None:
    """The sink rejects a key (a fault on its side), the guard pauses it; the sink is fixed
    and an operator resumes: every row of it publishes, each created once."""
    ids = await produce(conn, 80, job_type="order.fulfill", queue="orders")
    emulator.emulator.add_fault(
        FaultRule(action="status", method="POST", path="/ojs/v1/jobs", status=400, times=None)
    )
    settings = relay_settings(database.dsn, emulator.url, relay=STORM, sink={"batch": "off"})
    async with running(settings):

        async def paused() -> bool:
            leased = await _count(conn, "lease_owner IS NOT NULL AND published_at IS NULL")
            return await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses") == 1 and (
                leased == 0
            )

        await eventually(paused)
    dead = await _count(conn, "dead_at IS NOT NULL")
    assert dead < WINDOW
    emulator.emulator.clear_faults()
    assert await store.resume("orders", "order.fulfill", actor="test-operator") is not None
    await run_until_idle(settings)
    assert await _count(conn, "published_at IS NOT NULL") == len(ids) - dead
    ledger = emulator.emulator.ledger()
    assert {ledger[i].created for i in ids if i in ledger and ledger[i].job} == {1}


async def test_next_due_ignores_paused_rows(conn: asyncpg.Connection, store: Store) -> None:
    """An idle worker asks when the next row it may claim is due: paused rows are not, so a
    pause does not make idle workers spin on claims that take nothing."""
    [orders, mail] = await produce(conn, 2)
    await conn.execute(
        "UPDATE relayd.outbox SET job = jsonb_set(job, '{options}', '{\"queue\": \"orders\"}'), "
        "available_at = now() - interval '1 hour' WHERE event_id = $1",
        orders,
    )
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = now() + interval '1 hour' WHERE event_id = $1",
        mail,
    )
    due_s = await store.next_due_s()
    assert due_s is not None
    assert due_s < 0  # the orders row, due an hour ago
    await store.pause("orders", "*", "maintenance", actor="test")
    due_s = await store.next_due_s()
    assert due_s is not None
    assert 3500 < due_s <= 3600  # the mail row, due in an hour
    await store.pause("*", "*", "maintenance", actor="test")
    assert await store.next_due_s() is None


async def test_a_pause_of_one_type_holds_it_in_every_queue_and_no_other(
    conn: asyncpg.Connection, store: Store
) -> None:
    """Pauses by queue, by type, by both, and of everything: the claim skips exactly the rows
    they hold, next_due_s and the sampler's held count agree."""
    rows = {
        ("orders", "a.x"): await produce(conn, 2, job_type="a.x", queue="orders"),
        ("orders", "b.x"): await produce(conn, 2, job_type="b.x", queue="orders"),
        ("mail", "a.x"): await produce(conn, 2, job_type="a.x", queue="mail"),
        ("mail", "b.x"): await produce(conn, 2, job_type="b.x", queue="mail"),
    }
    await conn.execute("UPDATE relayd.outbox SET available_at = now() - interval '1 minute'")

    async def claimable() -> set[tuple[str, str]]:
        """The keys a claim takes now; the claim is undone in SQL afterwards."""
        claimed = await store.claim(100, uuid.uuid4(), 30.0)
        found = {key for key, ids in rows.items() for row in claimed if row.event_id in ids}
        await conn.execute(
            "UPDATE relayd.outbox SET lease_owner = NULL, attempts = 0, "
            "available_at = now() - interval '1 minute', last_attempt_at = NULL"
        )
        return found

    every = set(rows)
    assert await claimable() == every
    await store.pause("*", "a.x", "type a.x everywhere", "test")
    assert await claimable() == every - {("orders", "a.x"), ("mail", "a.x")}
    await store.pause("mail", "b.x", "one queue and type", "test")
    assert await claimable() == {("orders", "b.x")}
    await store.resume("*", "a.x", "test")
    assert await claimable() == every - {("mail", "b.x")}
    await store.pause("orders", "*", "the whole queue", "test")
    assert await claimable() == {("mail", "a.x")}
    await store.pause("*", "*", "everything", "test")
    assert await claimable() == set()
    assert await store.next_due_s() is None
