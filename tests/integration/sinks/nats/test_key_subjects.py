"""Ordered routes whose subject holds the ordering key (`events.orders.{key}`: mode
`key_in_subject`, docs/nats.md#ordered-routes), on a real nats-server: each key's subject
holds its events in commit order, each published expecting the subject's last sequence; a
second store of an event is refused after the duplicate window as within it; a late copy of
a head, arriving after the key's next event, is refused (where a subject without the key
stores it after that event: the residual window); and a sink whose idea of a subject is out
of date (another relay published there since) publishes once more, in order."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client

from relayd.core.envelope import Envelope
from relayd.core.outcomes import Published
from relayd.core.rows import ClaimedRow
from relayd.operator.check import run_checks
from relayd.producer import enqueue_many
from relayd.settings import Settings
from relayd.sinks import SendWindow
from relayd.sinks.nats.settings import NatsSettings
from relayd.sinks.nats.sink import NatsSink
from relayd.testing.nats import NatsServer, Stored, read_stream
from tests.faults.nats_proxy import NatsProxy
from tests.integration.sinks.nats.conftest import Server
from tests.integration.sinks.nats.test_sink import STREAM, add_stream, dead, event, nats_settings
from tests.support import Database, SinkHealthRecord, claimed, drained, eventually, running

KEYED = "events.orders.{key}"
EXPECTED = "Nats-Expected-Last-Subject-Sequence"
# Past a 1 s duplicate window: the stream has forgotten the ids stored before it.
WINDOW_S = 1
PAST_WINDOW_S = 2.0


def keyed_settings(dsn: str, url: str, subject: str = KEYED, **sink: Any) -> Settings:
    routes = [{"type": "order.updated", "subject": subject, "ordering": "key"}]
    return nats_settings(dsn, url, routes=routes, **sink)


async def commit_keyed(conn: asyncpg.Connection, items: list[tuple[str, int]]) -> list[str]:
    """One transaction per (key, n): the commit order is the list's."""
    ids = []
    for key, n in items:
        job = event(n)
        async with conn.transaction():
            await enqueue_many(conn, [job], keys=[key])
        ids.append(str(job["id"]))
    return ids


def by_subject(messages: list[Stored]) -> dict[str, list[Stored]]:
    subjects: dict[str, list[Stored]] = defaultdict(list)
    for message in messages:
        subjects[message.subject].append(message)
    return dict(subjects)


def ids_of(messages: list[Stored]) -> list[str]:
    return [m.event_id for m in messages]


async def test_each_keys_subject_holds_its_events_in_commit_order_each_fenced(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """Three keys' events, committed interleaved: each subject holds its key's events in
    commit order, once each, and each was published expecting the sequence of the one
    before it on its subject (0 for the first); `relayd check` names the mode."""
    await add_stream(js)
    settings = keyed_settings(database.dsn, nats_server.url)
    sink_line = {line.name: line for line in await run_checks(settings, "test")}["sink"]
    assert f"modes: {KEYED} key_in_subject" in sink_line.detail
    items = [(f"order-{n % 3}", n) for n in range(30)]
    ids = await commit_keyed(conn, items)
    async with running(settings):
        await eventually(lambda: drained(conn))
    assert await dead(conn) == {}
    subjects = by_subject(await read_stream(js, STREAM))
    assert set(subjects) == {f"events.orders.order-{k}" for k in range(3)}
    for k in range(3):
        messages = subjects[f"events.orders.order-{k}"]
        assert ids_of(messages) == [
            i for (key, _), i in zip(items, ids, strict=True) if key == f"order-{k}"
        ]
        previous = [0] + [m.seq for m in messages[:-1]]
        assert [int(m.headers[EXPECTED]) for m in messages] == previous


async def test_a_second_store_after_the_window_is_refused_and_reconciled(
    database: Database, conn: asyncpg.Connection, server: Server, client: Client
) -> None:
    """The event's PubAck is lost and the attempt waits 2 s for it, past the stream's 1 s
    duplicate window: the re-send expects the subject as it was before the first store, the
    stream refuses it ("wrong last sequence"), and relayd finds its event last on the subject:
    published, reconciled, stored once. On the dev extra's server and on Debian's 2.9."""
    js = client
    await add_stream(js, duplicate_window=WINDOW_S)
    proxy = NatsProxy.for_url(server.url)
    await proxy.start()
    settings = keyed_settings(database.dsn, proxy.url, timeout_s=PAST_WINDOW_S)
    try:
        proxy.drop_acks(1)
        async with running(settings) as daemon:
            [event_id] = await commit_keyed(conn, [("order-1", 1)])
            await proxy.done()
            await eventually(lambda: drained(conn))
    finally:
        await proxy.close()
    assert await dead(conn) == {}
    assert ids_of(await read_stream(js, STREAM)) == [event_id]
    sample = daemon.metrics.registry.get_sample_value
    assert sample("relayd_outcomes_total", {"outcome": "reconciled"}) == 1
    refused = {"sink": "nats", "operation": "publish", "code": "10071"}
    assert sample("relayd_sink_requests_total", refused) == 1


@pytest.mark.parametrize("subject", [KEYED, "events.orders"], ids=["key", "no_key"])
async def test_a_late_copy_of_a_head_never_lands_after_the_keys_next_event(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client, subject: str
) -> None:
    """The first publish of a key's head is held on the way; relayd gives up on it (0.5 s),
    sends the head again and then the key's next event. Past the duplicate window the held
    copy arrives: with the key in the subject the stream refuses it (the subject moved on);
    without it, the copy is stored after the next event (the residual window of
    docs/contract.md, C10)."""
    await add_stream(js, duplicate_window=WINDOW_S)
    proxy = NatsProxy.for_url(nats_server.url)
    await proxy.start()
    settings = keyed_settings(database.dsn, proxy.url, subject, timeout_s=0.5)
    try:
        async with running(settings):
            first, second = (event(1), event(2))
            proxy.hold_publish(str(first["id"]).encode())
            async with conn.transaction():
                await enqueue_many(conn, [first, second], keys=["order-1", "order-1"])
            await proxy.held()
            await eventually(lambda: drained(conn))
            await asyncio.sleep(PAST_WINDOW_S)  # the stream forgets the ids: the point
            await proxy.release_held()
    finally:
        await proxy.close()
    assert await dead(conn) == {}
    stored = ids_of(await read_stream(js, STREAM))
    head, successor = str(first["id"]), str(second["id"])
    assert stored == ([head, successor] if subject == KEYED else [head, successor, head])


async def test_a_sink_that_missed_another_relays_publish_publishes_once_more_in_order(
    nats_server: NatsServer, js: Client
) -> None:
    """Two sinks (two relays) publish one key's events in turn. The first's idea of the
    subject is out of date when its turn comes back: the stream refuses its publish, it
    reads the subject (another event of the key, not its own) and, its window open,
    publishes once more expecting what it read."""
    await add_stream(js)
    settings = NatsSettings(
        kind="nats",
        servers=(nats_server.url,),
        stream=STREAM,
        routes=({"type": "order.updated", "subject": KEYED, "ordering": "key"},),
        timeout_s=2.0,
    )
    seen: list[tuple[str, str]] = []
    a = NatsSink(settings, SinkHealthRecord(), observe=lambda op, code: seen.append((op, code)))
    b = NatsSink(settings, SinkHealthRecord())

    def row(n: int) -> tuple[ClaimedRow, dict[str, Envelope]]:
        job = event(n)
        one = dataclasses.replace(
            claimed(type=job["type"], args=job["args"], meta=job["meta"]), ordering_key="order-1"
        )
        return one, {one.event_id: Envelope.parse(one.job, one.event_id)}

    await a.start()
    await b.start()
    try:
        now = asyncio.get_running_loop().time()
        window = SendWindow(now + 60, opened_at=now)
        outcomes = []
        for n, sink in enumerate((a, b, a, a)):
            one, envelopes = row(n)
            outcomes.append((await sink.publish([one], envelopes, window=window))[one.event_id])
    finally:
        await a.close()
        await b.close()
    assert outcomes == [Published(sink_state="stored")] * 4
    # a read the subject before its first publish (empty then), and after its one refusal.
    assert seen.count(("publish", "10071")) == 1
    assert [code for operation, code in seen if operation == "msg_get"] == ["10037", "ok"]
    messages = await read_stream(js, STREAM)
    assert [int(m.headers[EXPECTED]) for m in messages] == [0, 1, 2, 3]
