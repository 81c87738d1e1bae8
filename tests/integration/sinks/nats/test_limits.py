"""The NATS sink at the stream's limits, on a real nats-server: a duplicate window shortened
while relayd runs is read again before an ambiguous re-send, a message's age is weighed as
it leaves (after waiting for a sending slot), a message larger than the stream's whole
budget is dead-lettered at once instead of failing the sink, and a full stream is a wait
that spends no row's attempts."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime
from urllib.parse import urlsplit

import asyncpg
import nats
import pytest
import structlog
from nats.aio.client import Client
from nats.js.api import DiscardPolicy

from relayd.core.envelope import Envelope
from relayd.core.outcomes import DeadLetter, DeadReason, Published
from relayd.producer import enqueue_many
from relayd.sinks import SendWindow
from relayd.sinks.nats.settings import NatsSettings
from relayd.sinks.nats.sink import NatsSink
from relayd.testing.nats import NatsServer, read_stream
from tests.integration.sinks.nats.test_dedupe import lose_the_ack
from tests.integration.sinks.nats.test_sink import (
    STREAM,
    add_stream,
    commit,
    dead,
    event,
    nats_settings,
    stored,
)
from tests.support import (
    Database,
    SinkHealthRecord,
    TcpProxy,
    claimed,
    drained,
    eventually,
    pending,
    running,
)

# A row's attempts, above the breaker's threshold (5): a wait must not use them up.
MAX_ATTEMPTS = 10


async def _events(js: Client) -> list[str]:
    """The ids of the messages the stream holds, in order (none when it is empty)."""
    if (await js.jetstream().stream_info(STREAM)).state.messages == 0:
        return []
    return [m["headers"]["Nats-Msg-Id"] for m in await stored(js)]


@pytest.mark.parametrize("past_window", ["dead_letter", "resend"])
async def test_a_window_shortened_mid_run_is_read_again_before_a_resend(
    database: Database,
    conn: asyncpg.Connection,
    nats_server: NatsServer,
    js: Client,
    past_window: str,
) -> None:
    """Issue 31, item 1: 1. relayd publishes an event to a stream whose duplicate window is
    120 s, and holds those facts; 2. an operator shortens the window to 1 s, and the stream
    forgets the id; 3. the event's PubAck was lost, and its retry comes 2 s after the first
    store: relayd reads the window again first, so the re-send follows `sink.past_window`
    (dead-lettered, the event stored once; or re-sent, logged and counted as past the
    window), never an ordinary publish of a second copy."""
    await add_stream(js, duplicate_window=120)
    settings = nats_settings(
        database.dsn, nats_server.url, routes=[{"type": "order.updated", "subject": "events.o"}]
    )
    settings = settings.model_copy(
        update={"sink": settings.sink.model_copy(update={"past_window": past_window})}
    )
    with structlog.testing.capture_logs() as logs:
        async with running(settings) as daemon:
            # 1.
            [event_id] = await commit(conn, [event(1)])
            await eventually(lambda: drained(conn))
            # 2.
            info = await js.jetstream().stream_info(STREAM)
            await js.jetstream().update_stream(dataclasses.replace(info.config, duplicate_window=1))
            await asyncio.sleep(2.0)  # the point of the test: past the new window
            # 3.
            await lose_the_ack(conn, event_id)
            await eventually(lambda: drained(conn))
    resends = daemon.metrics.registry.get_sample_value(
        "relayd_sink_requests_total",
        {"sink": "nats", "operation": "past_window", "code": past_window},
    )
    warned = [e["event_id"] for e in logs if e["event"] == "sink.resending_past_window"]
    if past_window == "dead_letter":
        assert await _events(js) == [event_id]
        [(reason, error)] = (await dead(conn)).values()
        assert reason == "past_window"
        assert "past the stream's duplicate window (1s)" in error
        assert warned == []
    else:
        assert await _events(js) == [event_id, event_id]
        assert await dead(conn) == {}
        assert warned == [event_id]
    assert resends == 1


async def test_a_message_that_waited_for_a_slot_is_weighed_as_it_leaves(
    nats_server: NatsServer, js: Client
) -> None:
    """Issue 31, item 2: a row claimed 0.5 s after its first store (an unanswered attempt)
    whose claim was answered 3 s before it leaves, because the claim's rows waited for one of
    sink.concurrency's sending slots, is past a 3 s window as it leaves (0.5 + 3 s, plus the
    attempt's timeout): the past-window rule applies, nothing is sent."""
    await add_stream(js, duplicate_window=3)
    settings = NatsSettings(
        kind="nats",
        servers=(nats_server.url,),
        stream=STREAM,
        routes=({"type": "order.updated", "subject": "events.o"},),
        timeout_s=0.5,
        past_window="dead_letter",
    )
    job = event(1)
    row = dataclasses.replace(
        claimed(type=job["type"], args=job["args"], meta=job["meta"]),
        age_s=0.5,
        previous_attempt_at=datetime.now(UTC),
    )
    envelopes = {row.event_id: Envelope.parse(row.job, row.event_id)}
    sink = NatsSink(settings, SinkHealthRecord())
    await sink.start()
    try:
        now = asyncio.get_running_loop().time()
        just_claimed = SendWindow(now + 60, opened_at=now)
        waited = SendWindow(now + 60, opened_at=now - 3.0)
        late = await sink.publish([row], envelopes, window=waited)
        assert isinstance(late[row.event_id], DeadLetter)
        assert late[row.event_id].reason is DeadReason.PAST_WINDOW  # type: ignore[union-attr]
        assert await _events(js) == []
        fresh = await sink.publish([row], envelopes, window=just_claimed)
        assert fresh == {row.event_id: Published(sink_state="stored")}
    finally:
        await sink.close()
    assert await _events(js) == [row.event_id]


async def test_a_message_the_stream_can_never_hold_is_dead_lettered_at_once(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """Issue 31, item 3: on a discard-new stream of 16 KiB, a 20 KiB event is dead-lettered
    `sink_too_large` on its first attempt; the breaker does not open, and the small events
    beside it are stored."""
    await add_stream(js, max_bytes=16 * 1024, discard=DiscardPolicy.NEW)
    settings = nats_settings(database.dsn, nats_server.url)
    big = event(0) | {"args": [{"order_id": 0, "note": "x" * (20 * 1024)}]}
    ids = await commit(conn, [big, event(1), event(2)])
    async with running(settings) as daemon:
        await eventually(lambda: drained(conn))
    [(reason, error)] = (await dead(conn)).values()
    assert reason == "sink_too_large"
    assert "over the stream's max_bytes (16384): the stream can never hold it" in error
    attempts = await conn.fetchval("SELECT attempts FROM relayd.outbox WHERE event_id = $1", ids[0])
    assert attempts == 1
    assert sorted(await _events(js)) == sorted(ids[1:])
    opened = daemon.metrics.registry.get_sample_value("relayd_breaker_opened_total")
    assert opened == 0


async def test_a_full_stream_is_a_wait_that_spends_no_attempts(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """A full discard-new stream refuses a small event for want of room, more times than
    retry.max_attempts: a sink-wide wait (the breaker), the row neither dead-lettered nor
    short of attempts; once an operator makes room, it is stored."""
    await add_stream(js, max_bytes=4 * 1024, discard=DiscardPolicy.NEW)
    filler = b"f" * 1024
    for n in range(3):
        await js.jetstream().publish("events.filler", filler, headers={"Nats-Msg-Id": f"f{n}"})
    settings = nats_settings(database.dsn, nats_server.url)
    settings = settings.model_copy(
        update={"retry": settings.retry.model_copy(update={"max_attempts": MAX_ATTEMPTS})}
    )
    [event_id] = await commit(conn, [event(1) | {"args": [{"note": "y" * 1500}]}])
    async with running(settings) as daemon:
        sample = daemon.metrics.registry.get_sample_value

        def refused() -> float:
            labels = {"sink": "nats", "operation": "publish", "code": "10077"}
            return sample("relayd_sink_requests_total", labels) or 0

        async def waiting() -> bool:
            return refused() > MAX_ATTEMPTS and await pending(conn) == 1

        await eventually(waiting)
        assert await dead(conn) == {}
        await js.jetstream().purge_stream(STREAM)  # an operator makes room
        await eventually(lambda: drained(conn))
    assert await _events(js) == [event_id]
    assert await dead(conn) == {}
    attempts = await conn.fetchval(
        "SELECT attempts FROM relayd.outbox WHERE event_id = $1", event_id
    )
    # Refused more often than retry.max_attempts, yet only the attempts before the breaker
    # opened were used (retry.breaker_threshold): those of a wait for the sink are given back.
    assert attempts <= settings.retry.breaker_threshold < MAX_ATTEMPTS


# Scarce sending slots: one slot for four workers' claims of three rows each, claimed at
# once; every reply of the server held back 0.9 s (the stream's facts, re-read once before
# the first re-send, and each pipeline's PubAcks), so the claims' pipelines leave one after
# another, about 0, 1.8, 2.7 and 3.6 s after their claims. With a 2.5 s attempt timeout, a
# row is past a 5.5 s window once it is 3 s old; nothing leaves after 5 s (lease 10 s).
SLOT_WINDOW_S = 5.5
SLOT_TIMEOUT_S = 2.5
SLOT_REPLY_DELAY_S = 0.9


async def test_rows_waiting_for_a_scarce_slot_are_weighed_as_they_leave(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """Issue 31, item 2, end to end: twelve rows, each tried before (an unanswered attempt),
    claimed by four workers at once, wait for `sink.concurrency = 1`'s one slot. The stream
    holds no message that left past the window: every message stored arrived less than
    `window - timeout` after its row was created (the rule, taken as the message leaves);
    the rows whose turn came later are dead-lettered `past_window`, never sent. (With the
    age taken at the claim, the last claim's rows are sent 3.6 s after their creation.)"""
    await add_stream(js, duplicate_window=SLOT_WINDOW_S)
    proxy = TcpProxy(host="127.0.0.1", port=urlsplit(nats_server.url).port)
    await proxy.start()
    settings = nats_settings(
        database.dsn,
        f"nats://127.0.0.1:{proxy.port}",
        timeout_s=SLOT_TIMEOUT_S,
        concurrency=1,
        past_window="dead_letter",
    )
    settings = settings.model_copy(
        update={
            "relay": settings.relay.model_copy(
                update={"workers": 4, "batch_size": 3, "lease_s": 10.0}
            )
        }
    )
    try:
        async with running(settings):
            # The relay connects (through the proxy, promptly) with a first event.
            await commit(conn, [event(99)])
            await eventually(lambda: drained(conn))
            proxy.reply_delay_s = SLOT_REPLY_DELAY_S
            jobs = [event(n) for n in range(12)]
            async with conn.transaction():
                await enqueue_many(conn, jobs)
                # Each tried before: an earlier attempt may have stored it (a re-send).
                await conn.execute("UPDATE relayd.outbox SET attempts = 1, last_attempt_at = now()")
            await eventually(lambda: drained(conn), timeout_s=60)
            proxy.reply_delay_s = 0.0
    finally:
        await proxy.close()
    created = {
        row["event_id"]: row["created_at"]
        for row in await conn.fetch("SELECT event_id::text, created_at FROM relayd.outbox")
    }
    client = await nats.connect(nats_server.url)
    try:
        messages = await read_stream(client, STREAM)
    finally:
        await client.close()
    late = {
        m.event_id: round((m.stored_at - created[m.event_id]).total_seconds(), 3)
        for m in messages
        if m.stored_at is not None
        and (m.stored_at - created[m.event_id]).total_seconds()
        >= SLOT_WINDOW_S - SLOT_TIMEOUT_S + 0.1
    }
    assert late == {}, f"stored past the window's rule, seconds after creation: {late}"
    reasons = {reason for reason, _ in (await dead(conn)).values()}
    assert len(messages) > 1, "nothing but the first event was published"
    assert reasons == {"past_window"}, reasons
