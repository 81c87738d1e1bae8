"""Parked keys on real PostgreSQL: a key the relay parked is listed with its head and its
waiting rows, and each action (retry, skip, release) does what it says in one transaction
with one audit row, as the next ordered claim shows; a dry run changes nothing, a key that
is not parked is refused, and two actions on one key cannot both act. The sampler's gauges
and the status report show parked keys."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import pytest

from relayd.core.rows import ClaimBatch
from relayd.daemon.sampler import sample_backlog
from relayd.operator.keys_actions import (
    NotParked,
    parked_keys,
    release_key,
    retry_key,
    skip_key,
)
from relayd.operator.status import build_report, render_text, report_json
from relayd.store import Store
from relayd.store.keys import SKIPPED_PREFIX
from relayd.store.records import AuditEntry, HeadState, KeyAction
from relayd.telemetry.metrics import RelayMetrics
from tests.support import Database, eventually, insert_keyed, park_key


async def _claim(store: Store) -> ClaimBatch:
    return await store.claim_from(100, uuid.uuid4(), 30.0, None, ordered=True)


async def _row(conn: asyncpg.Connection, event_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT attempts, available_at = 'infinity' AS waiting, last_attempt_at, last_error, "
        "dead_at, dead_reason, redriven_at FROM relayd.outbox WHERE event_id = $1",
        event_id,
    )
    assert row is not None
    return row


async def _parked(conn: asyncpg.Connection) -> list[str]:
    return [r[0] for r in await conn.fetch("SELECT ordering_key FROM relayd.relayd_parked_keys")]


async def _audit(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT action, actor, reason, filters::text AS filters, event_ids::text[] AS ids, "
        "row_count FROM relayd.relayd_audit ORDER BY id"
    )
    return [dict(r) | {"filters": json.loads(r["filters"])} for r in rows]


async def test_a_key_the_relay_parks_is_listed_with_its_head_and_its_waiting_rows(
    conn: asyncpg.Connection, store: Store
) -> None:
    """The relay's own statement parks the key (settle_parked): the list shows it with the
    head's id, attempts and state, the parking reason and error, and the two rows behind."""
    a = await insert_keyed(conn, "order-1", 3, job_type="order.fulfill")
    b = await insert_keyed(conn, "order-2", 1)
    owner = uuid.uuid4()
    first = await store.claim_from(10, owner, 30.0, None, ordered=True)
    assert sorted(r.event_id for r in first.rows) == sorted([a[0], b[0]])
    await store.settle_parked(owner, [a[0]], ["max_attempts"], ["503 upstream down"])

    [parked] = await parked_keys(store)
    assert (parked.key, parked.route, parked.event_id) == ("order-1", "order.fulfill", a[0])
    assert (parked.reason, parked.error) == ("max_attempts", "503 upstream down")
    assert (parked.head_state, parked.attempts, parked.waiting) == (HeadState.PENDING, 1, 2)
    assert not parked.waiting_capped
    assert 0 <= parked.parked_age_s < 60
    assert await parked_keys(store, route="mail.send") == []
    assert [k.key for k in await parked_keys(store, route="order.fulfill")] == ["order-1"]


async def test_the_waiting_rows_are_counted_up_to_a_bound(
    conn: asyncpg.Connection, store: Store
) -> None:
    """Behind a head, the key's rows are counted through the key index up to the bound; past
    it the count says more wait."""
    await park_key(conn, "hot", 8)
    await park_key(conn, "quiet", 2, parked_for="1 hour")
    hot, quiet = await parked_keys(store, bound=5)  # parked longest first
    assert (hot.key, hot.waiting, hot.waiting_capped) == ("hot", 6, True)
    assert (quiet.key, quiet.waiting, quiet.waiting_capped) == ("quiet", 1, False)
    assert [k.key for k in await parked_keys(store, limit=1)] == ["hot"]


async def test_retry_gives_the_head_its_attempts_back_and_the_claim_takes_it(
    conn: asyncpg.Connection, store: Store
) -> None:
    """The park is lifted, the head has 0 attempts, still waits at 'infinity', keeps its
    last_attempt_at (the next attempt reconciles first) and is marked redriven; the next
    claim takes it, and only it of its key; one audit row."""
    ids = await park_key(conn, "order-1", 3, attempts=5)
    before = await _row(conn, ids[0])
    outcome = await retry_key(store, "order-1", actor="alice", reason="inventory-db is back")
    assert (outcome.action, outcome.head_state, outcome.head_state_after) == (
        KeyAction.RETRY,
        HeadState.PENDING,
        HeadState.PENDING,
    )
    assert (outcome.attempts_before, outcome.attempts_after) == (5, 0)
    assert outcome.audit_id is not None
    after = await _row(conn, ids[0])
    assert (after["attempts"], after["waiting"]) == (0, True)
    assert after["last_attempt_at"] == before["last_attempt_at"]
    assert after["redriven_at"] is not None
    assert await _parked(conn) == []

    [head] = (await _claim(store)).rows
    assert (head.event_id, head.attempts, head.claimed_before, head.redriven) == (
        ids[0],
        1,
        True,
        True,
    )
    assert await _audit(conn) == [
        {
            "action": "keys.retry",
            "actor": "alice",
            "reason": "inventory-db is back",
            "filters": {
                "key": "order-1",
                "route": "order.fulfill",
                "parked_reason": "max_attempts",
            },
            "ids": [ids[0]],
            "row_count": 1,
        }
    ]


async def test_skip_dead_letters_the_head_and_the_key_goes_on(
    conn: asyncpg.Connection, store: Store
) -> None:
    """The head is dead-lettered with the parking reason, its last error kept behind the
    operator's mark; the next claim takes the key's second row; one audit row."""
    ids = await park_key(conn, "order-1", 3, reason="sink_rejected", error="400 bad order")
    outcome = await skip_key(store, "order-1", actor="bob", reason="order cancelled by hand")
    assert (outcome.head_state_after, outcome.last_error) == (
        HeadState.DEAD,
        SKIPPED_PREFIX + "400 bad order",
    )
    head = await _row(conn, ids[0])
    assert head["dead_at"] is not None
    assert (head["dead_reason"], head["last_error"]) == (
        "sink_rejected",
        "skipped by an operator: 400 bad order",
    )
    assert [r.event_id for r in (await _claim(store)).rows] == [ids[1]]
    [audit] = await _audit(conn)
    assert (audit["action"], audit["reason"], audit["ids"]) == (
        "keys.skip",
        "order cancelled by hand",
        [ids[0]],
    )
    with pytest.raises(ValueError, match="needs a reason"):
        await skip_key(store, "order-1", actor="bob", reason="")


async def test_release_lifts_the_park_and_the_head_keeps_its_attempts(
    conn: asyncpg.Connection, store: Store
) -> None:
    """Un-parked only: the next claim takes the head with its sixth attempt."""
    ids = await park_key(conn, "order-1", 2, attempts=5)
    outcome = await release_key(store, "order-1", actor="carol")
    assert (outcome.attempts_before, outcome.attempts_after) == (5, 5)
    [head] = (await _claim(store)).rows
    assert (head.event_id, head.attempts, head.redriven) == (ids[0], 6, False)
    [audit] = await _audit(conn)
    assert (audit["action"], audit["reason"]) == ("keys.release", None)


@pytest.mark.parametrize("action", list(KeyAction))
async def test_a_dry_run_says_what_it_would_do_and_changes_nothing(
    conn: asyncpg.Connection, store: Store, action: KeyAction
) -> None:
    ids = await park_key(conn, "order-1", 2, attempts=4)
    before = await _row(conn, ids[0])
    audit = AuditEntry(actor="dave", action=action.value, reason="dry")
    outcome = await store.act_on_key(action, "order-1", audit=audit, dry_run=True)
    assert outcome is not None
    assert (outcome.dry_run, outcome.audit_id, outcome.attempts_before) == (True, None, 4)
    assert outcome.attempts_after == (0 if action is KeyAction.RETRY else 4)
    assert await _row(conn, ids[0]) == before
    assert await _parked(conn) == ["order-1"]
    assert await _audit(conn) == []
    assert (await _claim(store)).rows == []


async def test_a_key_that_is_not_parked_is_refused_and_nothing_is_written(
    conn: asyncpg.Connection, store: Store
) -> None:
    """A key whose rows flow, and a key that does not exist: NotParked, no audit row."""
    [flowing] = await insert_keyed(conn, "flowing")
    for key in ("flowing", "no-such-key"):
        with pytest.raises(NotParked, match=f"^key {key} is not parked in relayd.outbox$"):
            await retry_key(store, key, actor="erin")
    assert await _audit(conn) == []
    assert [r.event_id for r in (await _claim(store)).rows] == [flowing]


async def test_two_actions_on_one_key_cannot_both_act(
    database: Database, conn: asyncpg.Connection, store: Store
) -> None:
    """Another operator lifts the park in an open transaction: this action waits on the
    park's row, and once the other commits it finds nothing to act on."""
    ids = await park_key(conn, "order-1", 2)
    other = await asyncpg.connect(database.dsn)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute("DELETE FROM relayd.relayd_parked_keys WHERE ordering_key = 'order-1'")
        late = asyncio.create_task(skip_key(store, "order-1", actor="frank", reason="late"))

        async def waiting() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
            )

        await eventually(waiting, timeout_s=10)
        assert not late.done()
        await tx.commit()
        with pytest.raises(NotParked):
            await late
    finally:
        await other.close()
    assert (await _row(conn, ids[0]))["dead_at"] is None  # not skipped
    assert await _audit(conn) == []


async def test_a_head_dead_lettered_since_it_parked_is_left_as_it_is(
    conn: asyncpg.Connection, store: Store
) -> None:
    """The row that parked the key was taken out meanwhile (a held row discarded): the
    action un-parks the key only, and says where the head is."""
    ids = await park_key(conn, "order-1", 2, attempts=5)
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now(), dead_reason = 'held_discarded' "
        "WHERE event_id = $1",
        ids[0],
    )
    [listed] = await parked_keys(store)
    assert (listed.head_state, listed.waiting) == (HeadState.DEAD, 1)
    outcome = await retry_key(store, "order-1", actor="gina")
    assert (outcome.head_state, outcome.attempts_after) == (HeadState.DEAD, 5)
    assert (await _row(conn, ids[0]))["attempts"] == 5
    assert [r.event_id for r in (await _claim(store)).rows] == [ids[1]]


async def test_the_sampler_and_the_status_report_show_parked_keys(
    conn: asyncpg.Connection, store: Store
) -> None:
    """relayd_parked_keys per route and the oldest parked age; a route's series goes once
    its last key is un-parked. The status report counts them and lists the oldest."""
    await park_key(conn, "order-1", 2, parked_for="2 hours")
    await park_key(conn, "order-2", 1, parked_for="10 minutes")
    await park_key(conn, "mail-1", 1, job_type="mail.send", reason="sink_rejected")
    metrics = RelayMetrics()
    value = metrics.registry.get_sample_value
    metrics.set_backlog(await sample_backlog(store, lease_s=30.0))
    assert value("relayd_parked_keys", {"route": "order.fulfill"}) == 2
    assert value("relayd_parked_keys", {"route": "mail.send"}) == 1
    oldest = value("relayd_oldest_parked_age_seconds")
    assert oldest is not None
    assert 7200 <= oldest < 7260

    report = await build_report(store, sample_interval_s=5.0, lease_s=30.0, parked=2)
    data = report_json(report)["parked_keys"]
    assert data["count"] == 3
    assert data["by_route"] == [
        {"route": "mail.send", "keys": 1},
        {"route": "order.fulfill", "keys": 2},
    ]
    assert [(p["key"], p["route"], p["reason"]) for p in data["oldest"]] == [
        ("order-1", "order.fulfill", "max_attempts"),
        ("mail-1", "mail.send", "sink_rejected"),
    ]
    text = render_text(report)
    assert "Parked keys: 3 ordered keys whose rows wait for an operator" in text
    assert any(line.split()[:2] == ["order-1", "order.fulfill"] for line in text.splitlines())

    await release_key(store, "mail-1", actor="hank")
    metrics.set_backlog(await sample_backlog(store, lease_s=30.0))
    assert value("relayd_parked_keys", {"route": "mail.send"}) is None
    for key in ("order-1", "order-2"):
        await release_key(store, key, actor="hank")
    metrics.set_backlog(await sample_backlog(store, lease_s=30.0))
    assert value("relayd_parked_keys", {"route": "order.fulfill"}) is None
    assert value("relayd_oldest_parked_age_seconds") == 0
    report = await build_report(store, sample_interval_s=5.0, lease_s=30.0)
    assert "Parked keys: none" in render_text(report)
    assert report_json(report)["parked_keys"] == {
        "count": 0,
        "by_route": [],
        "oldest_age_s": None,
        "oldest": [],
    }
