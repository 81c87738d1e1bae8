"""The NATS sink under faults, on a real nats-server with JetStream, with real `relayd run`
processes: killed mid-claim, PubAcks lost, connections cut with publishes in flight, the
server restarted, the stream missing, and another message already under an event's id.
Every scenario ends with the checker reading the stream back: each committed event in it
exactly once, with its body and headers; the conflict dead-lettered and not published."""

from __future__ import annotations

import asyncio

import pytest

from tests.faults import nats_scenarios
from tests.faults.harness import Process
from tests.faults.nats_stage import NatsStage
from tests.support import TcpProxy

DRAIN_TIMEOUT_S = 90.0


def reconciled(relay: Process) -> int:
    """Rows the relay found already in the stream (re-sent, answered as a duplicate)."""
    return relay.log().count('"relay.reconciled"')


@pytest.mark.parametrize("atomic", [False, True], ids=["window", "atomic_marker"])
@pytest.mark.parametrize("point", ["after_claim", "before_post", "after_2xx", "before_settle"])
async def test_kill_9_mid_claim_then_restart(stage: NatsStage, point: str, atomic: bool) -> None:
    """C1, C2: the relay dies (SIGKILL) the second time it reaches `point` (rows claimed;
    publishing; published, not settled; settling); its leases are ended in SQL; a relay
    started again publishes the rest, and what the dead one stored is reconciled, not
    stored twice."""
    await nats_scenarios.kill_9_at_a_step(stage, point, atomic=atomic)


@pytest.mark.parametrize("atomic", [False, True], ids=["window", "atomic_marker"])
async def test_puback_lost(stage: NatsStage, atomic: bool) -> None:
    """C2: the server stores 10 events but their PubAcks never reach relayd (a proxy drops
    them); each attempt times out (ambiguous), the row is re-sent with the same id, the
    stream answers with a duplicate's PubAck (or, in atomic-marker mode, refuses the batch
    on its marker), and relayd reconciles it: once each."""
    await stage.add_stream(atomic=atomic)
    proxy = await stage.proxy()
    proxy.drop_acks(10)
    await stage.produce(100)
    relay = await stage.relay("relay", through=proxy)
    await proxy.done()
    await stage.scene.drained(DRAIN_TIMEOUT_S)
    await stage.check()
    assert await relay.stop() == 0  # its log is complete
    assert proxy.stats.dropped_acks == 10
    assert reconciled(relay) >= 10


@pytest.mark.parametrize("atomic", [False, True], ids=["window", "atomic_marker"])
async def test_connection_cut_mid_pipeline(stage: NatsStage, atomic: bool) -> None:
    """C1, C2, C4: the connection is reset as the PubAck of the 50th publish comes back
    (dropped), with up to 16 publishes in flight (sink.concurrency); the client reconnects,
    the unanswered rows are re-sent and those the stream holds are reconciled (the 50th at
    least), the rest flow; twice over."""
    await stage.add_stream(atomic=atomic)
    proxy = await stage.proxy()
    proxy.cut_after(50)
    await stage.produce(400)
    relay = await stage.relay("relay", through=proxy)
    await proxy.done()
    proxy.cut_after(100)
    await proxy.done()
    await stage.scene.drained(DRAIN_TIMEOUT_S)
    await stage.check()
    assert await relay.stop() == 0  # its log is complete
    assert proxy.stats.cuts == 2
    assert proxy.stats.accepted >= 3
    assert reconciled(relay) >= 2


@pytest.mark.parametrize("atomic", [False, True], ids=["window", "atomic_marker"])
async def test_server_restart_mid_run(stage: NatsStage, atomic: bool) -> None:
    """C1, C5: 1. nats-server is stopped (its port and store kept) while relayd publishes;
    2. more events are committed while it is down; 3. it starts again and the client
    reconnects. What was in flight is reconciled, what failed meanwhile was refunded (sent
    nothing: no reconnect buffer), nothing is dead-lettered, every event is stored once."""
    await stage.add_stream(atomic=atomic)
    await stage.produce(400)
    relay = await stage.relay("relay", RELAYD_RELAY__WORKERS="1", RELAYD_SINK__CONCURRENCY="4")
    await stage.scene.until(
        f"SELECT count(*) >= 50 FROM {stage.scene.sql_table} WHERE published_at IS NOT NULL"
    )
    # 1.
    await asyncio.to_thread(stage.server.stop)
    await relay.logged('"sink.nats_disconnected"')
    # 2.
    await stage.produce(100)
    # 3.
    await asyncio.to_thread(stage.server.start)
    await relay.logged('"sink.nats_reconnected"')
    await stage.scene.drained(DRAIN_TIMEOUT_S)
    await stage.check()
    assert await stage.scene.dead() == {}


async def test_stream_missing_then_created(stage: NatsStage) -> None:
    """C5: no stream takes the routes' subject: the publishes have no responders, a failure
    of the sink, not of the rows; the breaker opens, nothing is dead-lettered; once the
    stream is created every event is stored once."""
    await stage.produce(50)
    relay = await stage.relay("relay")
    await relay.logged('"breaker.opened"')
    assert await stage.scene.dead() == {}
    assert await stage.scene.published() == 0
    await stage.add_stream()
    await stage.scene.drained(DRAIN_TIMEOUT_S)
    await stage.check()


@pytest.mark.parametrize("atomic", [False, True], ids=["window", "atomic_marker"])
async def test_same_id_different_body_already_in_the_stream(stage: NatsStage, atomic: bool) -> None:
    """C2: the stream already holds another message under one event's id (JetStream's
    dedupe does not compare bytes); relayd reads it back, dead-letters that row `conflict`
    and never marks it published; its neighbours flow; the stream keeps the other message
    alone under that id."""
    await nats_scenarios.same_id_different_body(stage, atomic=atomic)


async def test_a_claim_answered_after_its_lease_publishes_nothing(stage: NatsStage) -> None:
    """C4: 1. relay A's replies from PostgreSQL are delayed 2.5 s, past its 2 s lease; 2. A
    claims 50 events (answered late); 3. relay B takes them over when the lease expires and
    publishes them; 4. A's answer arrives past its start-by time: it must publish nothing
    (its proxy to NATS forwards no publish; the stream's dedupe would hide a late resend)
    and its settle is fenced (counted stale)."""
    await stage.add_stream()
    stage.send_window_s = float(LATE_TIMING["RELAYD_RELAY__LEASE_S"]) - float(
        LATE_TIMING["RELAYD_SINK__TIMEOUT_S"]
    )
    database = TcpProxy.for_dsn(stage.scene.dsn)
    await database.start()
    try:
        to_nats = await stage.proxy()
        late = await stage.relay(
            "late",
            through=to_nats,
            env=LATE_TIMING,
            RELAYD_DATABASE__DSN=database.dsn_through(stage.scene.dsn),
            RELAYD_RELAY__WORKERS="1",
        )
        # 1. Once its pool and its LISTEN session are connected: a connection's start-up
        # through the delay would outlast the connect timeout.
        await late.logged('"daemon.started"')
        await late.logged('"wakeup.listening"')
        database.reply_delay_s = REPLY_DELAY_S
        # 2.
        ids = await stage.produce(50)
        await stage.scene.until(
            f"SELECT count(*) = {len(ids)} FROM {stage.scene.sql_table} "
            "WHERE lease_owner IS NOT NULL"
        )
        # 3.
        await stage.relay("prompt", env=LATE_TIMING)
        await stage.scene.drained(DRAIN_TIMEOUT_S)
        # 4.
        await until_metric(
            stage, stage.http_ports["late"], 'relayd_outcomes_total{outcome="stale"}', len(ids)
        )
        database.reply_delay_s = 0.0
        await stage.check()
        assert to_nats.stats.publishes == 0
    finally:
        await database.close()


LATE_TIMING = {
    "RELAYD_RELAY__LEASE_S": "2",
    "RELAYD_RELAY__BATCH_SIZE": "100",
    "RELAYD_RELAY__POLL_INTERVAL_S": "0.1",
    "RELAYD_SINK__TIMEOUT_S": "0.5",
}
# Longer than the lease: the claim's answer arrives after it expired. (Every statement of
# relay A costs two delayed round trips: its own, and the pool's reset on release.)
REPLY_DELAY_S = 2.5


async def until_metric(stage: NatsStage, port: int, sample: str, at_least: float) -> None:
    """Wait until the relay listening on `port` exports `sample` at `at_least` or more."""
    url = f"http://127.0.0.1:{port}/metrics"
    async with asyncio.timeout(60):
        while True:
            async with stage.scene.http.get(url) as answer:
                text = await answer.text()
            values = [line.split()[-1] for line in text.splitlines() if line.startswith(sample)]
            if values and float(values[0]) >= at_least:
                return
            await asyncio.sleep(0.1)  # a process's counters cannot signal this loop
