"""The NATS sink through the daemon, against a real nats-server with JetStream (the dev
extra's binary): events stored once each with their body and headers, a different message
under an event's id is a conflict, rows that cannot be sent are dead-lettered alone, and
failures of the sink (no stream, refused credentials) dead-letter nothing."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import asyncpg
import nats
import structlog
from nats.aio.client import Client
from nats.js.api import StreamConfig

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from relayd.core.outcomes import DeadReason
from relayd.operator.check import Verdict, run_checks
from relayd.producer import enqueue_many, new_job
from relayd.settings import Settings
from relayd.testing.nats import NatsServer
from tests.support import FAST, Database, drained, eventually, pending, run_until_idle, running

WHEN = "2024-05-01T12:00:00Z"
STREAM = "EVENTS"
ROUTES = [
    {"type": "order.updated", "subject": "events.orders"},
    {"type": "order.updated", "version": 2, "subject": "events.orders.v2"},
]


def nats_settings(dsn: str, url: str, **sink: Any) -> Settings:
    """FAST, with `[sink] kind = "nats"` at `url` (stream EVENTS, the order routes)."""
    merged: dict[str, dict[str, Any]] = {name: dict(values) for name, values in FAST.items()}
    merged["database"] = {"dsn": dsn}
    merged["sink"] = {
        "kind": "nats",
        "timeout_s": 2.0,
        "connect_timeout_s": 1.0,
        "concurrency": 16,
        "servers": [url],
        "stream": STREAM,
        "routes": ROUTES,
        "source": "/orders-service",
    } | sink
    return Settings(**merged)  # type: ignore[arg-type]


def event(n: int, *, version: int = 1, event_type: str = "order.updated") -> dict[str, Any]:
    return new_job(
        event_type, [{"order_id": n}], meta={META_VERSION: version, META_OCCURRED_AT: WHEN}
    )


async def commit(conn: asyncpg.Connection, jobs: list[dict[str, Any]]) -> list[str]:
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    return [str(job["id"]) for job in jobs]


async def add_stream(client: Client, **config: Any) -> None:
    await client.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["events.>"], **config))


async def stored(client: Client) -> list[dict[str, Any]]:
    """Every message of the stream, in order: subject, headers, body."""
    messages = []
    info = await client.jetstream().stream_info(STREAM)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        reply = await client.request(
            f"$JS.API.STREAM.MSG.GET.{STREAM}", json.dumps({"seq": seq}).encode()
        )
        message = json.loads(reply.data)["message"]
        raw = base64.b64decode(message.get("hdrs", "")).decode().split("\r\n")[1:]
        headers = dict(line.split(": ", 1) for line in raw if line)
        body = base64.b64decode(message.get("data", ""))
        messages.append({"subject": message["subject"], "headers": headers, "body": body})
    return messages


async def dead(conn: asyncpg.Connection) -> dict[str, tuple[str, str]]:
    rows = await conn.fetch(
        "SELECT event_id::text, dead_reason, last_error FROM relayd.outbox "
        "WHERE dead_at IS NOT NULL"
    )
    return {row["event_id"]: (row["dead_reason"], row["last_error"]) for row in rows}


async def test_events_are_stored_once_each_with_their_body_and_headers(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """C1, C2: every committed event is in the stream exactly once, on its route's subject,
    its data as the body, its id as Nats-Msg-Id and Message-Id, its CloudEvents attributes
    as ce- headers; each row is marked published."""
    await add_stream(js)
    jobs = [event(n) for n in range(150)] + [event(n, version=2) for n in range(150, 200)]
    ids = await commit(conn, jobs)
    daemon = await run_until_idle(nats_settings(database.dsn, nats_server.url))
    assert await drained(conn)
    messages = await stored(js)
    assert sorted(m["headers"]["Nats-Msg-Id"] for m in messages) == sorted(ids)
    by_id = {m["headers"]["Nats-Msg-Id"]: m for m in messages}
    for n, job in enumerate(jobs):
        message = by_id[job["id"]]
        assert message["subject"] == ("events.orders" if n < 150 else "events.orders.v2")
        assert message["body"] == f'{{"order_id":{n}}}'.encode()
        assert message["headers"] == {
            "Nats-Msg-Id": job["id"],
            "Message-Id": job["id"],
            "Nats-Expected-Stream": STREAM,
            "ce-specversion": "1.0",
            "ce-id": job["id"],
            "ce-type": "order.updated",
            "ce-source": "/orders-service",
            "ce-time": WHEN,
            "ce-dataversion": "1" if n < 150 else "2",
            "ce-datacontenttype": "application/json",
            "Content-Type": "application/json",
        }
    published = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox "
        "WHERE published_at IS NOT NULL AND sink_state = 'stored'"
    )
    assert published == 200
    sample = daemon.metrics.registry.get_sample_value
    labels = {"sink": "nats", "operation": "publish", "code": "ok"}
    assert sample("relayd_sink_requests_total", labels) == 200


async def test_an_event_stored_before_is_reconciled_and_resent_rows_are_logged(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """C2: an event an earlier attempt stored (its answer lost) is sent again with the same
    id; the stream answers with a duplicate's PubAck, relayd reads the message back, finds
    its own, and marks the row published as reconciled; the stream holds it once. The
    relay logs each row it re-sends."""
    await add_stream(js)
    [job] = [event(1)]
    [event_id] = await commit(conn, [job])
    await js.jetstream().publish(
        "events.orders", b'{"order_id":1}', headers={"Nats-Msg-Id": event_id}
    )
    await conn.execute(
        "UPDATE relayd.outbox SET last_attempt_at = now() - interval '1 minute', attempts = 1"
    )
    with structlog.testing.capture_logs() as logs:
        daemon = await run_until_idle(nats_settings(database.dsn, nats_server.url))
    assert await drained(conn)
    assert len(await stored(js)) == 1
    reconciled = daemon.metrics.registry.get_sample_value(
        "relayd_outcomes_total", {"outcome": "reconciled"}
    )
    assert reconciled == 1
    assert [e["event_id"] for e in logs if e["event"] == "relay.resending"] == [event_id]


async def test_a_different_message_under_the_events_id_is_a_conflict(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """C2: JetStream deduplicates by id without comparing bytes; relayd reads the stored
    message back, and another body under its id is dead-lettered `conflict`, never marked
    published; the stream keeps the other message alone."""
    await add_stream(js)
    ids = await commit(conn, [event(n) for n in range(5)])
    await js.jetstream().publish(
        "events.orders", b'{"someone":"else"}', headers={"Nats-Msg-Id": ids[2]}
    )
    await run_until_idle(nats_settings(database.dsn, nats_server.url))
    assert await drained(conn)
    assert await dead(conn) == {
        ids[2]: (
            "conflict",
            "the stream holds a different message under this id at seq 1 "
            "(body of 18 bytes, ours 14)",
        )
    }
    messages = await stored(js)
    assert len(messages) == 5
    assert messages[0]["body"] == b'{"someone":"else"}'


async def test_rows_that_cannot_be_sent_are_dead_lettered_and_the_rest_flow(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """C6: an event type without a route (`no_route`), an envelope that is not an event
    (`invalid_envelope`), and data over sink.max_payload_bytes (`too_large`) are each
    dead-lettered with their reason, unsent; the events around them are stored."""
    await add_stream(js)
    good = [event(n) for n in range(10)]
    unrouted = event(10, event_type="order.created")
    not_an_event = new_job("order.updated", [{"order_id": 11}], meta={META_VERSION: 1})
    too_large = new_job(
        "order.updated", [{"blob": "x" * 5000}], meta={META_VERSION: 1, META_OCCURRED_AT: WHEN}
    )
    ids = await commit(conn, [*good[:5], unrouted, not_an_event, too_large, *good[5:]])
    await run_until_idle(nats_settings(database.dsn, nats_server.url, max_payload_bytes=4096))
    assert await drained(conn)
    reasons = {event_id: reason for event_id, (reason, _) in (await dead(conn)).items()}
    assert reasons == {
        ids[5]: DeadReason.NO_ROUTE,
        ids[6]: DeadReason.INVALID_ENVELOPE,
        ids[7]: DeadReason.TOO_LARGE,
    }
    errors = {event_id: error for event_id, (_, error) in (await dead(conn)).items()}
    assert errors[ids[5]] == "no route for type 'order.created' version 1 (sink.routes)"
    assert errors[ids[6]] == "meta.occurred_at is missing (when the event occurred)"
    assert errors[ids[7]].startswith("the event's data is 5011 bytes as JSON, over")
    assert sorted(m["headers"]["Nats-Msg-Id"] for m in await stored(js)) == sorted(
        str(job["id"]) for job in good
    )


async def test_a_missing_stream_dead_letters_nothing_and_opens_the_breaker(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """C5: with no stream on the routes' subjects the publishes have no responders: a
    failure of the sink, not of the rows; the breaker opens, attempts are refunded, nothing
    is dead-lettered, and once the stream exists every event is stored."""
    ids = await commit(conn, [event(n) for n in range(20)])
    async with running(nats_settings(database.dsn, nats_server.url)) as daemon:

        async def opened() -> bool:
            value = daemon.metrics.registry.get_sample_value("relayd_breaker_opened_total")
            return (value or 0) >= 2

        await eventually(opened)
        assert await pending(conn) == 20
        assert await dead(conn) == {}
        errors = await conn.fetch("SELECT DISTINCT last_error FROM relayd.outbox")
        # The stream's configuration decides each route's dedupe mode: it is read first.
        assert {row["last_error"] for row in errors} <= {
            None,
            "stream EVENTS not found (create it: docs/nats.md#operations)",
        }
        await add_stream(js)
        await eventually(lambda: drained(conn))
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") <= 1
    assert sorted(m["headers"]["Nats-Msg-Id"] for m in await stored(js)) == sorted(ids)


async def test_publishes_without_responders_are_the_sinks_failure(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """C5: a route whose subject holds the event id needs no stream facts, so its pipeline
    is written at once; with no stream on that subject the server answers each publish "no
    responders": the sink's failure (the breaker), nothing dead-lettered, no attempt used;
    once the stream exists every event is stored once."""
    ids = await commit(conn, [event(n) for n in range(30)])
    routes = [{"type": "order.updated", "subject": "events.orders.{id}"}]
    async with running(nats_settings(database.dsn, nats_server.url, routes=routes)) as daemon:

        async def opened() -> bool:
            value = daemon.metrics.registry.get_sample_value("relayd_breaker_opened_total")
            return (value or 0) >= 1

        await eventually(opened)
        answered = daemon.metrics.registry.get_sample_value(
            "relayd_sink_requests_total",
            {"sink": "nats", "operation": "publish", "code": "no_responders"},
        )
        assert (answered or 0) >= 1
        assert await dead(conn) == {}

        async def named() -> bool:  # the settle follows the breaker's count
            errors = await conn.fetch("SELECT last_error FROM relayd.outbox")
            return any(
                (e["last_error"] or "").startswith("no responders on events.orders.")
                for e in errors
            )

        await eventually(named)
        await add_stream(js)
        await eventually(lambda: drained(conn))
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") <= 1
    messages = await stored(js)
    assert sorted(m["headers"]["Nats-Msg-Id"] for m in messages) == sorted(ids)
    assert {m["subject"] for m in messages} == {f"events.orders.{i}" for i in ids}


async def test_refused_credentials_are_severe_and_never_shown(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """C5: a server that refuses relayd's password opens the breaker at once (severe);
    nothing is dead-lettered, the password is in no error, and `relayd check` says so."""
    password = tmp_path / "password"
    password.write_text("wrong-hunter2\n")
    config = "authorization { user: relayd, password: right-hunter2 }\n"
    await commit(conn, [event(n) for n in range(5)])
    with NatsServer(config=config) as server:
        settings = nats_settings(
            database.dsn, server.url, user="relayd", password_file=str(password)
        )
        lines = {line.name: line for line in await run_checks(settings, "test")}
        assert lines["sink"].verdict is Verdict.FAIL
        assert "authorization violation (check the sink's credentials)" in lines["sink"].detail
        with structlog.testing.capture_logs() as logs:
            async with running(settings) as daemon:

                async def opened() -> bool:
                    value = daemon.metrics.registry.get_sample_value("relayd_breaker_opened_total")
                    return (value or 0) >= 1

                await eventually(opened)
    opened_events = [e for e in logs if e["event"] == "breaker.opened"]
    assert opened_events[0]["severe"] is True
    assert await dead(conn) == {}
    texts = [str(e) for e in logs] + [
        str(row["last_error"]) for row in await conn.fetch("SELECT last_error FROM relayd.outbox")
    ]
    assert not any("hunter2" in text for text in texts)


async def test_check_reports_the_stream_the_routes_and_the_window(
    database: Database, nats_server: NatsServer, js: Client
) -> None:
    """`relayd check`: the stream exists, takes every route's subject, and its duplicate
    window is shown; a route its subjects do not take fails the line."""
    await add_stream(js, duplicate_window=30.0)
    settings = nats_settings(database.dsn, nats_server.url)
    lines = {line.name: line for line in await run_checks(settings, "test")}
    assert lines["sink"].verdict is Verdict.OK
    assert lines["sink"].detail == (
        f"{nats_server.url} stream EVENTS: JetStream answers (API level "
        + lines["sink"].detail.split("API level ")[1].split(")")[0]
        + "); stream EVENTS takes every route's subject; duplicate window 30s, retry "
        "horizon 40.3s (window-mode routes: an unanswered attempt retried past the window is "
        "handled by sink.past_window = resend); max_payload 1048576; modes: events.orders "
        "window, events.orders.v2 window (atomic markers need the stream's allow_atomic and "
        "its subject relayd.markers.*); an unanswered attempt is re-sent with the same id, for "
        "the destination to dedupe"
    )
    routes = [*ROUTES, {"type": "mail.sent", "subject": "mail.sent"}]
    lines = {
        line.name: line
        for line in await run_checks(
            nats_settings(database.dsn, nats_server.url, routes=routes), "test"
        )
    }
    assert lines["sink"].verdict is Verdict.FAIL
    assert "stream EVENTS does not take mail.sent (its subjects: events.>" in lines["sink"].detail


async def test_a_server_restart_mid_run_loses_nothing_and_stores_nothing_twice(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer
) -> None:
    """C1, C5: rows committed while the server is down fail before anything is sent
    (nothing buffered for later: no reconnect buffer), are refunded, and are stored once
    each after the client reconnects to the restarted server."""
    client = await nats.connect(nats_server.url)
    await add_stream(client)
    await client.close()
    first = await commit(conn, [event(n) for n in range(20)])
    async with running(nats_settings(database.dsn, nats_server.url)) as daemon:
        await eventually(lambda: drained(conn))
        nats_server.stop()
        second = await commit(conn, [event(n) for n in range(20, 40)])

        async def opened() -> bool:
            value = daemon.metrics.registry.get_sample_value("relayd_breaker_opened_total")
            return (value or 0) >= 1

        await eventually(opened)
        assert await dead(conn) == {}
        nats_server.start()
        await eventually(lambda: drained(conn))
    client = await nats.connect(nats_server.url)
    try:
        ids = [m["headers"]["Nats-Msg-Id"] for m in await stored(client)]
    finally:
        await client.close()
    assert sorted(ids) == sorted(first + second)
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") <= 2


async def test_the_servers_max_payload_bounds_the_setting_and_each_message(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """The server's max_payload counts the headers too: a message whose body fits
    sink.max_payload_bytes but not, with its headers, the server's bound is dead-lettered
    `too_large` unsent (a server closes the connection on such a message); a setting above
    the server's bound fails `relayd check`."""
    with NatsServer(config="max_payload: 2048\n") as server:
        client = await nats.connect(server.url)
        try:
            await add_stream(client)
            small = event(1)
            big = new_job(
                "order.updated",
                [{"blob": "x" * 1800}],
                meta={META_VERSION: 1, META_OCCURRED_AT: WHEN},
            )
            ids = await commit(conn, [small, big])
            settings = nats_settings(database.dsn, server.url, max_payload_bytes=2000)
            await run_until_idle(settings)
            assert await drained(conn)
            [(reason, error)] = (await dead(conn)).values()
            assert (reason, ids[1] in await dead(conn)) == ("too_large", True)
            assert error.endswith(
                "with its headers, over the server's max_payload (2048); not sent"
            )
            assert [m["headers"]["Nats-Msg-Id"] for m in await stored(client)] == [ids[0]]
        finally:
            await client.close()
        over = nats_settings(database.dsn, server.url, max_payload_bytes=4096)
        lines = {line.name: line for line in await run_checks(over, "test")}
    assert lines["sink"].verdict is Verdict.FAIL
    assert "sink.max_payload_bytes (4096) is above the server's max_payload (2048)" in (
        lines["sink"].detail
    )
