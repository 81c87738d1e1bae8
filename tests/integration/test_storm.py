"""The poison-storm guard on real PostgreSQL: a sink that rejects every row pauses the
outbox instead of dead-lettering its backlog; after a resume everything publishes once."""

from __future__ import annotations

import asyncpg

from relayd.store import Store
from relayd.testing.emulator import RunningEmulator
from relayd.testing.faults import FaultRule
from tests.support import Database, eventually, produce, relay_settings, run_until_idle, running

WINDOW = 20


async def test_a_sink_rejecting_everything_pauses_instead_of_dead_lettering(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, store: Store
) -> None:
    """1. the sink answers 400 to every job (a change on its side); 2. relayd pauses the
    outbox with reason "poison storm", audited, and dead-letters at most one window's worth;
    3. the sink is fixed and an operator resumes: every row publishes, each created once."""
    ids = await produce(conn, 150)
    emulator.emulator.add_fault(
        FaultRule(action="status", method="POST", path="/ojs/v1/jobs", status=400, times=None)
    )
    settings = relay_settings(
        database.dsn,
        emulator.url,
        relay={"storm_window": WINDOW, "storm_threshold": 0.5},
        sink={"batch": "off"},
    )
    async with running(settings):

        async def paused_and_settled() -> bool:
            reason = await conn.fetchval("SELECT reason FROM relayd.relayd_pauses")
            leased = await conn.fetchval(
                "SELECT count(*) FROM relayd.outbox WHERE lease_owner IS NOT NULL"
            )
            return reason is not None and leased == 0

        # 2.
        await eventually(paused_and_settled)
        pause = await conn.fetchrow("SELECT queue, reason, paused_by FROM relayd.relayd_pauses")
        dead = await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL")
        retried = await conn.fetchval(
            "SELECT count(*) FROM relayd.outbox WHERE last_error LIKE 'poison storm%'"
        )
    assert pause is not None
    assert pause["queue"] == "*"
    assert pause["reason"].startswith("poison storm: the sink rejected ")
    assert pause["paused_by"].startswith("relayd@")
    assert dead <= WINDOW
    assert retried > 0  # rows the guard kept from the dead-letter queue
    audit = await conn.fetchrow("SELECT action, actor, reason FROM relayd.relayd_audit")
    assert audit is not None
    assert (audit["action"], audit["actor"]) == ("pause", pause["paused_by"])
    # 3.
    emulator.emulator.clear_faults()
    await store.resume("*", actor="test-operator")
    await run_until_idle(settings)
    published = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NOT NULL"
    )
    assert published == len(ids) - dead
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
    await store.pause("orders", "maintenance", actor="test")
    due_s = await store.next_due_s()
    assert due_s is not None
    assert 3500 < due_s <= 3600  # the mail row, due in an hour
    await store.pause("*", "maintenance", actor="test")
    assert await store.next_due_s() is None
