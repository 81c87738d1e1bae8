"""Dedupe that outlives the duplicate window (docs/nats.md#deduplication), on real servers:
the dev extra's nats-server (a recent 2.1x, with atomic batches) and, where installed,
Debian's 2.9 (without them, and ignoring the stream settings it does not know). An event
whose PubAck was lost is retried after a 1 s `duplicate_window` has passed: each mode either
stores nothing twice or follows `sink.past_window`, and `relayd check` names the mode. A
`past_window` dead letter an operator redrives is sent on its next claim."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
import structlog
from nats.aio.client import Client

from relayd.operator.check import run_checks
from relayd.operator.dlq_actions import DlqRequest, Selection, act
from relayd.store import Store
from relayd.store.records import AuditEntry, DeadLetterFilter, DlqAction
from tests.integration.sinks.nats.conftest import Server
from tests.integration.sinks.nats.test_sink import (
    STREAM,
    commit,
    dead,
    event,
    nats_settings,
    stored,
)
from tests.support import Database, drained, run_until_idle

WINDOW_NS = 1_000_000_000
# Past the 1 s window: the wait is the point of the test, not a guess at a delay.
PAST_WINDOW_S = 2.0


async def create_stream(client: Client, **config: Any) -> dict[str, Any]:
    """The stream as the raw API creates it (an old server ignores what it does not know);
    returns the configuration the server echoes."""
    wanted = {"name": STREAM, "storage": "memory", "duplicate_window": WINDOW_NS} | config
    reply = await client.request(
        f"$JS.API.STREAM.CREATE.{STREAM}", json.dumps(wanted).encode(), timeout=5
    )
    answer: dict[str, Any] = json.loads(reply.data)
    assert "error" not in answer, answer
    return dict(answer["config"])


async def lose_the_ack(conn: asyncpg.Connection, event_id: str) -> None:
    """The row as it would be had the first attempt's PubAck been lost: stored in the
    stream, not marked published, attempted once."""
    await conn.execute(
        "UPDATE relayd.outbox SET published_at = NULL, sink_state = NULL, "
        "available_at = now(), attempts = 1, last_attempt_at = now() WHERE event_id = $1",
        event_id,
    )


@dataclass(frozen=True)
class Case:
    route: str
    stream: dict[str, Any]
    past_window: str
    # The mode relayd check names, per server (the wheel's, Debian's).
    modes: tuple[str, str]
    # What the retry past the window ends in, per server: "reconciled" (stored once),
    # "resent" (stored twice, by the setting) or "past_window" (dead-lettered, once).
    ends: tuple[str, str]


ATOMIC_STREAM = {"subjects": ["events.>", "relayd.markers.*"], "allow_atomic": True}
PLAIN_STREAM = {"subjects": ["events.>", "relayd.markers.*"]}
CASES = {
    "id_in_subject": Case(
        "events.orders.{id}",
        PLAIN_STREAM,
        "dead_letter",
        ("id_in_subject", "id_in_subject"),
        ("reconciled", "reconciled"),
    ),
    # Debian's 2.9 accepts allow_atomic and ignores it: relayd goes by its API level.
    "atomic_marker": Case(
        "events.orders",
        ATOMIC_STREAM,
        "dead_letter",
        ("atomic_marker", "window"),
        ("reconciled", "past_window"),
    ),
    "window_resend": Case(
        "events.orders", PLAIN_STREAM, "resend", ("window", "window"), ("resent", "resent")
    ),
    "window_dead_letter": Case(
        "events.orders",
        PLAIN_STREAM,
        "dead_letter",
        ("window", "window"),
        ("past_window", "past_window"),
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_a_retry_past_the_window_stores_nothing_twice_or_follows_the_setting(
    database: Database,
    conn: asyncpg.Connection,
    server: Server,
    client: Client,
    case: Case,
) -> None:
    """C2, issue 19 item 4: 1. relayd publishes the event; 2. its PubAck is lost (the row
    is set back in SQL as an unanswered attempt leaves it); 3. the retry comes after the
    1 s window: with the id in the subject, or a marker in an atomic batch, the stream
    refuses a second store and relayd reconciles; in window mode sink.past_window decides,
    and on a server that cannot batch atomically relayd never believes it can."""
    on = 1 if server.old else 0
    await create_stream(client, **case.stream)
    routes = [{"type": "order.updated", "subject": case.route}]
    settings = nats_settings(database.dsn, server.url, routes=routes, past_window=case.past_window)
    sink_line = {line.name: line for line in await run_checks(settings, "test")}["sink"]
    assert f"modes: {case.route} {case.modes[on]}" in sink_line.detail

    # 1. The first attempt stores the event.
    [event_id] = await commit(conn, [event(1)])
    await run_until_idle(settings)
    assert await drained(conn)
    first = [m for m in await stored(client) if m["subject"].startswith("events.")]
    assert [m["headers"]["Nats-Msg-Id"] for m in first] == [event_id]

    # 2. Its PubAck is lost; 3. the retry comes after the window.
    await lose_the_ack(conn, event_id)
    await asyncio.sleep(PAST_WINDOW_S)
    with structlog.testing.capture_logs() as logs:
        daemon = await run_until_idle(settings)
    assert await drained(conn)
    events = [m for m in await stored(client) if m["subject"].startswith("events.")]
    sample = daemon.metrics.registry.get_sample_value
    resends = sample(
        "relayd_sink_requests_total",
        {"sink": "nats", "operation": "past_window", "code": "resend"},
    )
    warned = [e for e in logs if e["event"] == "sink.resending_past_window"]
    ends = case.ends[on]
    if ends == "reconciled":
        assert len(events) == 1
        assert sample("relayd_outcomes_total", {"outcome": "reconciled"}) == 1
        assert await dead(conn) == {}
    elif ends == "resent":
        assert [m["headers"]["Nats-Msg-Id"] for m in events] == [event_id, event_id]
        assert events[0]["body"] == events[1]["body"]
        assert resends == 1
        assert [e["event_id"] for e in warned] == [event_id]
    else:
        assert len(events) == 1
        [(reason, error)] = (await dead(conn)).values()
        assert reason == "past_window"
        assert "past the stream's duplicate window (1s)" in error
    if ends != "resent":
        assert resends is None
        assert warned == []


async def test_an_old_server_ignores_allow_atomic_and_relayd_does_not_believe_it(
    server: Server, client: Client
) -> None:
    """Features come from what the server reports: Debian's 2.9 takes `allow_atomic` and
    echoes nothing back, and reports no API level; the wheel's server echoes both."""
    config = await create_stream(client, **ATOMIC_STREAM)
    reply = await client.request("$JS.API.INFO", b"", timeout=5)
    api = json.loads(reply.data)["api"]
    if server.old:
        assert "allow_atomic" not in config
        assert "level" not in api
    else:
        assert config["allow_atomic"] is True
        assert api["level"] >= 2


async def unanswered_long_ago(conn: asyncpg.Connection, event_ids: list[str]) -> None:
    """The rows as an attempt leaves them when its publish got no answer (and, as the
    operator will find, never reached the stream), created long before the 1 s window: the
    next claim weighs them as past it, without a wait."""
    await conn.execute(
        "UPDATE relayd.outbox SET created_at = now() - interval '1 minute', "
        "available_at = now(), attempts = 1, last_attempt_at = now() "
        "WHERE event_id = ANY($1::uuid[])",
        event_ids,
    )


async def events_in(client: Client) -> list[dict[str, Any]]:
    """The stream's events (markers left out), none when it holds nothing."""
    if (await client.jetstream().stream_info(STREAM)).state.messages == 0:
        return []
    return [m for m in await stored(client) if m["subject"].startswith("events.")]


async def redrive(store: Store, event_ids: list[str]) -> None:
    """`relayd dlq retry ID…`, through the operator function the command calls."""
    selection = Selection(event_ids, DeadLetterFilter(), await store.operator_now())
    actor = AuditEntry(actor="test-operator", action=DlqAction.REDRIVE.value)
    summary = await act(store, DlqRequest(DlqAction.REDRIVE, selection, actor, 500))
    assert summary.changed == len(event_ids)


async def test_a_redriven_past_window_dead_letter_is_sent_once_on_its_next_claim(
    database: Database,
    conn: asyncpg.Connection,
    store: Store,
    server: Server,
    client: Client,
) -> None:
    """sink.past_window = "dead_letter", window mode: a row past the window is dead-lettered
    `past_window`; once an operator redrives it (`relayd dlq retry`) its next claim
    publishes it once, logged and counted as the operator's (`redriven`), while a row past
    the window that was not redriven is dead-lettered again; the redrive covers that one
    attempt, so a retry after it (its PubAck lost) is weighed against the window again."""
    await create_stream(client, **PLAIN_STREAM)
    routes = [{"type": "order.updated", "subject": "events.orders"}]
    settings = nats_settings(database.dsn, server.url, routes=routes, past_window="dead_letter")

    # 1. An unanswered attempt, the row past the window: dead-lettered, nothing sent.
    [redriven] = await commit(conn, [event(1)])
    await unanswered_long_ago(conn, [redriven])
    await run_until_idle(settings)
    assert [reason for reason, _ in (await dead(conn)).values()] == ["past_window"]
    assert await events_in(client) == []

    # 2. The operator finds it missing from the stream and redrives it; another row is
    # past the window meanwhile, not redriven.
    await redrive(store, [redriven])
    [other] = await commit(conn, [event(2)])
    await unanswered_long_ago(conn, [other])
    with structlog.testing.capture_logs() as logs:
        daemon = await run_until_idle(settings)
    events = await events_in(client)
    assert [m["headers"]["Nats-Msg-Id"] for m in events] == [redriven]
    assert {k: reason for k, (reason, _) in (await dead(conn)).items()} == {other: "past_window"}
    row = await conn.fetchrow(
        "SELECT published_at, last_attempt_at, redriven_at FROM relayd.outbox WHERE event_id = $1",
        redriven,
    )
    assert row is not None
    assert row["published_at"] is not None
    assert row["last_attempt_at"] > row["redriven_at"]  # the claim used the redrive up
    sample = daemon.metrics.registry.get_sample_value
    counted = {
        code: sample(
            "relayd_sink_requests_total",
            {"sink": "nats", "operation": "past_window", "code": code},
        )
        for code in ("redriven", "resend", "dead_letter")
    }
    assert counted == {"redriven": 1, "resend": None, "dead_letter": 1}
    told = [e for e in logs if e["event"].startswith("sink.resending_")]
    assert [(e["event"], e["event_id"]) for e in told] == [("sink.resending_redriven", redriven)]

    # 3. That attempt's PubAck lost: the retry is past the window again, with no redrive.
    await conn.execute(
        "UPDATE relayd.outbox SET published_at = NULL, sink_state = NULL, "
        "available_at = now() WHERE event_id = $1",
        redriven,
    )
    await run_until_idle(settings)
    assert (await dead(conn))[redriven][0] == "past_window"
    assert len(await events_in(client)) == 1
