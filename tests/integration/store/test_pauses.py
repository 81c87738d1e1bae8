"""Pauses on real PostgreSQL: every running relay obeys `relayd pause` from its next claim,
`relayd resume` restarts them (and wakes idle ones with a NOTIFY), a queue can be paused
alone, an operator's pause writes its audit row with it, and relayd's own pause is written
and audited once however many ask for it."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import asyncpg

from relayd.daemon.lifecycle import Daemon
from relayd.store import Store
from relayd.store.records import QueueUse
from relayd.testing.emulator import RunningEmulator
from tests.support import (
    Database,
    drained,
    dsn_as,
    eventually,
    pending,
    produce,
    relay_settings,
    run_relayd,
    running,
)

POLL_S = 0.5
# Each relay must show this many claims after the rows were committed: more than its
# workers can have had in flight before, so some of them surely saw the rows.
CLAIMS_SEEN = 10


def _sample(daemon: Daemon, name: str) -> float:
    value = daemon.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


async def _claims_advance(*daemons: Daemon) -> None:
    """Wait until every daemon has run CLAIMS_SEEN more claim statements."""
    start = [_sample(d, "relayd_claims_total") for d in daemons]

    async def advanced() -> bool:
        return all(
            _sample(d, "relayd_claims_total") >= s + CLAIMS_SEEN
            for d, s in zip(daemons, start, strict=True)
        )

    await eventually(advanced)


async def test_pause_stops_claims_on_two_running_relays_and_resume_restarts_them(
    database: Database,
    conn: asyncpg.Connection,
    emulator: RunningEmulator,
    cli_env: dict[str, str],
) -> None:
    """`relayd pause` stops claims on two running relays within one poll interval;
    `relayd resume` restarts them; `relayd_paused` shows it on both."""
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}
    settings = relay_settings(
        database.dsn,
        emulator.url,
        relay={"workers": 2, "poll_interval_s": POLL_S},
        metrics={"sample_interval_s": 0.2},
    )

    def paused_gauges_read(value: float) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return _sample(one, "relayd_paused") == _sample(two, "relayd_paused") == value

        return check

    async with running(settings, seed=1) as one, running(settings, seed=2) as two:
        code, out, err = await run_relayd("pause", "--reason", "sink maintenance", env=env)
        assert (code, err) == (0, "")
        assert out.startswith("paused every queue of relayd.outbox")
        await eventually(paused_gauges_read(1.0), timeout_s=10)
        ids = await produce(conn, 20)
        # Both relays keep claiming (at least once a poll interval, and at once on the
        # insert's NOTIFY) and take nothing.
        await _claims_advance(one, two)
        assert _sample(one, "relayd_claimed_rows_total") == 0
        assert _sample(two, "relayd_claimed_rows_total") == 0
        assert await pending(conn) == len(ids)
        assert emulator.emulator.ledger() == {}

        code, out, err = await run_relayd("resume", env=env)
        assert (code, err) == (0, "")
        assert out.startswith("resumed every queue of relayd.outbox")
        await eventually(lambda: drained(conn), timeout_s=10)
        await eventually(paused_gauges_read(0.0), timeout_s=10)
    assert set(emulator.emulator.ledger()) == set(ids)
    assert _sample(one, "relayd_claimed_rows_total") + _sample(
        two, "relayd_claimed_rows_total"
    ) == len(ids)
    audit = await conn.fetch("SELECT action, filters, reason FROM relayd.relayd_audit ORDER BY id")
    assert [tuple(r.values()) for r in audit] == [
        ("pause", '{"type": "*", "queue": "*"}', "sink maintenance"),
        ("resume", '{"type": "*", "queue": "*"}', None),
    ]


async def test_a_paused_queue_waits_while_the_others_publish(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, store: Store
) -> None:
    """With one queue paused, its rows stay pending and the other queues' rows publish;
    resuming the queue publishes its rows."""
    assert await store.pause("slow", "*", "the slow service is down", "test-operator") is True
    slow = await produce(conn, 10, queue="slow")
    fast = await produce(conn, 10, queue="fast")
    settings = relay_settings(
        database.dsn, emulator.url, relay={"workers": 2, "poll_interval_s": POLL_S}
    )
    async with running(settings) as relay:

        async def fast_published() -> bool:
            return set(emulator.emulator.ledger()) == set(fast)

        await eventually(fast_published)
        await _claims_advance(relay)
        assert set(emulator.emulator.ledger()) == set(fast)
        assert await pending(conn) == len(slow)

        lifted = await store.resume("slow", "*", "test-operator")
        assert lifted is not None
        assert lifted.reason == "the slow service is down"
        await eventually(lambda: drained(conn), timeout_s=10)
    assert set(emulator.emulator.ledger()) == set(slow) | set(fast)


async def test_resume_wakes_idle_relays_with_a_notify(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    """`relayd resume` notifies the outbox's channel (the insert trigger's), so relays
    waiting for their next poll claim at once; resuming nothing paused sends nothing."""
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}
    heard: list[str] = []
    await conn.add_listener("relayd.outbox", lambda *args: heard.append(args[2]))
    code, out, _ = await run_relayd("resume", env=env)
    assert (code, out) == (
        0,
        "every queue was not paused: nothing to resume\nnothing is paused now\n",
    )
    code, _, _ = await run_relayd("pause", "--queue", "orders", "--reason", "migration", env=env)
    assert code == 0
    assert heard == []
    code, _, _ = await run_relayd("resume", "--queue", "orders", env=env)
    assert code == 0

    async def notified() -> bool:
        return heard == ["relayd.outbox"]

    await eventually(notified, timeout_s=5)


async def test_store_pause_writes_the_pause_and_its_audit_row_together(
    conn: asyncpg.Connection, store: Store
) -> None:
    """`Store.pause` (the poison-storm guard's): one pause row, its reason updated by a
    second pause; an audit row for each; the claim then leases nothing."""
    await produce(conn, 3)
    assert await store.pause("*", "*", "poison storm: 50 dead letters in 60 s", "relayd guard")
    assert not await store.pause("*", "*", "poison storm: 80 dead letters in 60 s", "relayd guard")
    pauses = await store.pauses()
    assert [(p.queue, p.reason, p.paused_by) for p in pauses] == [
        ("*", "poison storm: 80 dead letters in 60 s", "relayd guard")
    ]
    audit = await conn.fetch("SELECT actor, action, reason FROM relayd.relayd_audit ORDER BY id")
    assert [tuple(r.values()) for r in audit] == [
        ("relayd guard", "pause", "poison storm: 50 dead letters in 60 s"),
        ("relayd guard", "pause", "poison storm: 80 dead letters in 60 s"),
    ]
    assert await store.claim(10, uuid.uuid4(), 30.0) == []
    assert await store.resume("*", "*", "alice") is not None
    assert len(await store.claim(10, uuid.uuid4(), 30.0)) == 3


async def test_relayds_own_pause_is_written_once_and_never_overwrites(
    conn: asyncpg.Connection, store: Store
) -> None:
    """`Store.pause_insert` (the sink's and the poison-storm guard's): the first asker
    pauses, with one audit row; every later asker of the same pause, and one of a pause an
    operator wrote, changes and audits nothing; once lifted, it may pause again."""
    reason = "the sink asked for it: https://r.example/gone answered HTTP 410"
    assert await store.pause_insert("*", "order.lost", reason, "relayd@a") is True
    assert await store.pause_insert("*", "order.lost", reason, "relayd@b") is False
    assert await store.pause_insert("*", "order.lost", "another 410", "relayd@a") is False
    await store.pause("mail", "*", "maintenance", "alice")
    assert await store.pause_insert("mail", "*", "poison storm: ...", "relayd@a") is False
    pauses = {(p.queue, p.type): (p.reason, p.paused_by) for p in await store.pauses()}
    assert pauses == {
        ("*", "order.lost"): (reason, "relayd@a"),
        ("mail", "*"): ("maintenance", "alice"),
    }
    audit = await conn.fetch("SELECT actor, action, reason FROM relayd.relayd_audit ORDER BY id")
    assert [tuple(r.values()) for r in audit] == [
        ("relayd@a", "pause", reason),
        ("alice", "pause", "maintenance"),
    ]
    assert await store.resume("*", "order.lost", "alice") is not None
    assert await store.pause_insert("*", "order.lost", "410 again", "relayd@b") is True


async def test_queue_use_reads_rows_in_any_state_up_to_its_bound(
    database: Database, conn: asyncpg.Connection, store: Store
) -> None:
    """`Store.queue_use` (what `relayd pause --queue` warns from): a dead or published row
    counts as use; an unused queue reports the rows read, at most the bound; a role that may
    not read the outbox gets None (no warning) rather than an error after its pause."""
    mail = await produce(conn, 1, queue="mail")
    await produce(conn, 4, queue="orders")
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now(), dead_reason = 'conflict' WHERE event_id = $1",
        mail[0],
    )
    assert await store.queue_use("mail", 100) == QueueUse(used=True, rows_read=0)
    assert await store.queue_use("ordres", 100) == QueueUse(used=False, rows_read=5)
    assert await store.queue_use("ordres", 3) == QueueUse(used=False, rows_read=3)
    role = f"relayd_pauser_{uuid.uuid4().hex[:8]}"
    await conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        await conn.execute(f"GRANT USAGE ON SCHEMA relayd TO {role}")
        pauser = await Store.connect(dsn_as(database.dsn, role), database.table, max_size=1)
        try:
            assert await pauser.queue_use("orders", 100) is None
        finally:
            await pauser.close()
    finally:
        await conn.execute(f"DROP OWNED BY {role}")
        await conn.execute(f"DROP ROLE {role}")
