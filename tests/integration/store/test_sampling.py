"""The backlog as operators see it, on real PostgreSQL: the sampler's states and ages, pauses,
the bounded counts and their estimates, the heartbeats, and the status report."""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg

from relayd.core.retry import Backoff, BreakerState
from relayd.daemon.sampler import Activity, InstanceInfo, Sampler, sample_backlog
from relayd.engine.chores import Housekeeping
from relayd.operator.status import build_report
from relayd.store import Store
from relayd.store import outage as reconnect
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.metrics import RelayMetrics
from tests.support import park_key, produce, rows_in_every_state

# relay.lease_s: rows_in_every_state's leases end within 30 s.
LEASE_S = 30.0
PAUSE = (
    "INSERT INTO relayd.relayd_pauses (outbox_table, queue, reason, paused_by) "
    "VALUES ('relayd.outbox', $1, 'test', 'pytest')"
)


def _sampler(store: Store, **fields: object) -> Sampler:
    metrics = RelayMetrics()
    backoff = Backoff(base_s=reconnect.BASE_S, cap_s=reconnect.CAP_S, rng=random.Random(1))
    values: dict[str, object] = {
        "store": store,
        "metrics": metrics,
        "lease_s": LEASE_S,
        "instance": InstanceInfo(host="test-host", pid=4242),
        "activity": lambda: Activity(BreakerState.CLOSED, 7),
        "housekeeping": Housekeeping(metrics, DatabaseRetry(backoff, metrics), asyncio.Event()),
    }
    return Sampler(**(values | fields))  # type: ignore[arg-type]


async def test_sampler_tells_the_states_apart(store: Store, conn: asyncpg.Connection) -> None:
    """Ready (an expired lease too), scheduled, leased, dead not discarded; ages from the
    claimable row's available_at and the oldest pending row's created_at."""
    await rows_in_every_state(conn)
    sampler = _sampler(store)
    backlog = await sampler.sample()
    assert backlog.by_state() == {"ready": 5, "scheduled": 3, "leased": 2, "dead": 2}
    assert backlog.paused == 0
    assert backlog.estimated == frozenset()
    assert backlog.oldest_claimable_age_s is not None
    assert 1000 <= backlog.oldest_claimable_age_s < 1060
    assert backlog.oldest_pending_age_s is not None
    assert 5000 <= backlog.oldest_pending_age_s < 5060
    value = sampler.metrics.registry.get_sample_value
    assert value("relayd_outbox_rows", {"state": "scheduled"}) == 3
    assert value("relayd_paused") == 0
    sampled_at = value("relayd_backlog_sampled_timestamp_seconds")
    assert sampled_at is not None
    assert sampled_at > 0


async def test_a_row_in_backoff_is_not_claimable(store: Store, conn: asyncpg.Connection) -> None:
    """Only rows in backoff: the claimable age is none, the pending age still counts them."""
    ids = await produce(conn, 3)
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = now() + interval '1 hour', "
        "created_at = now() - interval '600 s' WHERE event_id = ANY($1::uuid[])",
        ids,
    )
    backlog = await sample_backlog(store, lease_s=LEASE_S)
    assert backlog.by_state() == {"ready": 0, "scheduled": 3, "leased": 0, "dead": 0}
    assert backlog.oldest_claimable_age_s is None
    assert backlog.oldest_pending_age_s is not None
    assert backlog.oldest_pending_age_s >= 600


async def test_rows_of_a_paused_queue_are_not_claimable(
    store: Store, conn: asyncpg.Connection
) -> None:
    """1. `mail` paused: its due rows leave ready, its older rows leave the claimable age,
    and the claim takes exactly the ready rows; 2. '*' paused: nothing is claimable."""
    ids = await rows_in_every_state(conn)
    # 1.
    await conn.execute(PAUSE, "mail")
    backlog = await sample_backlog(store, lease_s=LEASE_S)
    assert (backlog.ready, backlog.paused, backlog.any_pause) == (3, 2, True)
    assert backlog.oldest_claimable_age_s is not None
    assert 100 <= backlog.oldest_claimable_age_s < 160
    claimed = await store.claim(100, uuid.uuid4(), 10.0)
    assert {row.event_id for row in claimed} == set(ids["ready"][:3])
    after = await sample_backlog(store, lease_s=LEASE_S)
    assert (after.ready, after.paused, after.leased) == (0, 2, 5)
    # 2.
    await conn.execute("DELETE FROM relayd.relayd_pauses")
    await conn.execute(PAUSE, "*")
    backlog = await sample_backlog(store, lease_s=LEASE_S)
    assert (backlog.ready, backlog.paused, backlog.any_pause) == (0, 2, True)
    assert backlog.oldest_claimable_age_s is None
    assert await store.claim(100, uuid.uuid4(), 10.0) == []


async def test_above_the_bound_counts_switch_to_the_estimate(
    store: Store, conn: asyncpg.Connection
) -> None:
    """With a bound of 3: under it, exact counts; above it, the claim index's and the
    dead-letter index's reltuples (which ANALYZE sets and later inserts do not change)."""
    ids = await produce(conn, 12)
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now(), dead_reason = 'conflict' "
        "WHERE event_id = ANY($1::uuid[])",
        ids[:5],
    )
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = now() + interval '1 hour' "
        "WHERE event_id = ANY($1::uuid[])",
        ids[5:7],
    )
    exact = await sample_backlog(store, lease_s=LEASE_S, bound=10)
    assert exact.by_state() == {"ready": 5, "scheduled": 2, "leased": 0, "dead": 5}
    assert exact.estimated == frozenset()
    await conn.execute("ANALYZE relayd.outbox")
    # Rows the statistics do not know about yet: the estimate stays as ANALYZE left it.
    more = await produce(conn, 4)
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now(), dead_reason = 'conflict' "
        "WHERE event_id = ANY($1::uuid[])",
        more[:1],
    )
    estimated = await sample_backlog(store, lease_s=LEASE_S, bound=3)
    assert estimated.estimated == {"ready", "dead"}
    # The claim index held 7 pending rows at ANALYZE; 2 of them are scheduled (exact).
    assert estimated.ready == 5
    assert estimated.scheduled == 2
    assert estimated.dead == 5
    # The same rows, counted exactly under a larger bound.
    assert (await sample_backlog(store, lease_s=LEASE_S, bound=10)).by_state()["ready"] == 8


async def test_heartbeat_upserts_prunes_and_is_forgotten(
    store: Store, conn: asyncpg.Connection
) -> None:
    """1. a beat inserts this relay's row, a second refreshes it (its breaker opened between
    them, and the row says why; a third, closed again, clears the reason); 2. a day-old row
    of another relay is pruned; 3. silent for three intervals: stale; 4. forget() removes
    it."""
    activity = [Activity(BreakerState.CLOSED, 7)]
    sampler = _sampler(store, activity=lambda: activity[-1])
    await conn.execute(
        "INSERT INTO relayd.relayd_instances VALUES ('relayd.outbox', $1, 'gone', 1, '0.0.1', "
        "now() - interval '3 days', now() - interval '25 hours', 'closed', 0)",
        uuid.uuid4(),
    )
    report = await build_report(store, sample_interval_s=1.0, lease_s=LEASE_S)
    assert report.instances == []  # older than a day: ignored even before it is pruned
    # 1., 2.
    await sampler.beat()
    refused = "cannot connect to NATS at 127.0.0.1:4222: connection refused"
    activity.append(Activity(BreakerState.OPEN, 0, refused))
    await sampler.beat()
    rows = await conn.fetch("SELECT instance_id, host, pid, in_flight FROM relayd.relayd_instances")
    assert [tuple(r) for r in rows] == [(sampler.instance.instance_id, "test-host", 4242, 0)]
    report = await build_report(store, sample_interval_s=1.0, lease_s=LEASE_S)
    (instance,) = report.instances
    assert instance.instance_id == str(sampler.instance.instance_id)
    assert (instance.breaker_state, instance.breaker_reason) == ("open", refused)
    activity.append(Activity(BreakerState.CLOSED, 7))
    await sampler.beat()
    report = await build_report(store, sample_interval_s=1.0, lease_s=LEASE_S)
    (instance,) = report.instances
    assert (instance.breaker_state, instance.breaker_reason, instance.stale) == (
        "closed",
        None,
        False,
    )
    # 3.
    await conn.execute("UPDATE relayd.relayd_instances SET last_seen = now() - interval '4 s'")
    report = await build_report(store, sample_interval_s=1.0, lease_s=LEASE_S)
    assert [i.stale for i in report.instances] == [True]
    assert report.stale_after_s == 3.0
    # 4.
    await sampler.forget()
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_instances") == 0


async def test_status_report_lists_every_part(store: Store, conn: asyncpg.Connection) -> None:
    """Dead letters by reason (discarded ones left out), the top queues and types over the
    pending rows, and every pause of this outbox with who and why."""
    await rows_in_every_state(conn)
    await conn.execute(PAUSE, "mail")
    await conn.execute(
        "INSERT INTO relayd.relayd_pauses (outbox_table, queue, reason, paused_by) "
        "VALUES ('other.outbox', '*', 'another outbox', 'someone')"
    )
    report = await build_report(store, sample_interval_s=5.0, lease_s=LEASE_S)
    assert report.outbox == "relayd.outbox"
    assert [(c.name, c.rows) for c in report.dead_by_reason] == [
        ("conflict", 1),
        ("sink_rejected", 1),
    ]
    assert [(c.name, c.rows) for c in report.top_queues] == [("orders", 8), ("mail", 2)]
    assert [(c.name, c.rows) for c in report.top_types] == [("test.echo", 8), ("mail.send", 2)]
    assert report.top_counted == 10
    assert [
        (held.pause.queue, held.pause.type, held.pause.reason, held.pause.paused_by, held.rows)
        for held in report.pauses
    ] == [("mail", "*", "test", "pytest", 2)]
    assert report.backlog.paused == 2


async def test_a_pauses_held_rows_are_the_backlogs_paused_rows(
    store: Store, conn: asyncpg.Connection
) -> None:
    """A pause over rows in every state: its held count is the backlog's paused count (its
    due rows), and the rows in a backoff or leased stay counted as scheduled and leased, so
    that `relayd status` adds up."""
    await rows_in_every_state(conn)
    await conn.execute(PAUSE, "orders")
    report = await build_report(store, sample_interval_s=5.0, lease_s=LEASE_S)
    assert [(held.pause.queue, held.rows) for held in report.pauses] == [("orders", 3)]
    assert report.backlog.paused == 3
    assert report.backlog.by_state() == {"ready": 2, "scheduled": 3, "leased": 2, "dead": 2}


async def test_the_sampler_counts_parked_keys(store: Store, conn: asyncpg.Connection) -> None:
    """Parked keys per route in the gauges, and in the few words of systemd's status line."""
    sampler = _sampler(store)
    await sampler.sample()
    assert sampler.summary() == "0 ready, oldest claimable 0s, 0 dead"
    await park_key(conn, "order-1", 2)
    await sampler.sample()
    assert (
        sampler.metrics.registry.get_sample_value("relayd_parked_keys", {"route": "order.fulfill"})
        == 1
    )
    assert sampler.summary() == "0 ready, oldest claimable 0s, 0 dead, 1 key parked"
