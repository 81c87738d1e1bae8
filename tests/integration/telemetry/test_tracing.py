"""Trace continuity through the daemon, with the OpenTelemetry SDK and an in-memory exporter:
the producer's trace id reaches the OJS job's meta and its request's `traceparent` header,
and the NATS message's headers; the relay's publish span links to it; rows carrying every
kind of bad trace metadata publish normally, with nothing of it sent."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import asyncpg
import nats
import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from relayd.core.trace_context import producer_meta
from relayd.producer import enqueue, enqueue_many, new_job
from relayd.settings import Settings
from relayd.telemetry.tracing import SPAN_CLAIM, SPAN_PUBLISH, SPAN_SETTLE, RelayTracing
from relayd.testing.emulator import RunningEmulator
from relayd.testing.nats import NatsServer, read_stream
from tests.support import FAST, Database, drained, relay_settings, run_until_idle
from tests.trace_cases import BAD_TRACES, TRACESTATE

STREAM = "EVENTS"
WHEN = "2024-05-01T12:00:00Z"


class Traces:
    """A TracerProvider with an always-on sampler and an in-memory exporter."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(sampler=ALWAYS_ON)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def relay(self, sink: str) -> RelayTracing:
        return RelayTracing(self.provider, sink=sink)

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.name == name]

    def linked(self) -> set[tuple[int, int]]:
        """(trace id, span id) of every link of every publish span."""
        return {
            (link.context.trace_id, link.context.span_id)
            for span in self.named(SPAN_PUBLISH)
            for link in span.links
        }


@pytest.fixture
def traces() -> Iterator[Traces]:
    made = Traces()
    yield made
    made.provider.shutdown()


async def produce_traced(
    conn: asyncpg.Connection, traces: Traces, jobs: Sequence[tuple[str, list[Any], dict[str, Any]]]
) -> list[tuple[dict[str, Any], ReadableSpan]]:
    """Enqueue each job inside a producer span of its own, the way an instrumented
    application would: meta gets the span's context from `producer_meta()`."""
    tracer = traces.provider.get_tracer("tests.producer")
    produced = []
    for job_type, args, meta in jobs:
        with tracer.start_as_current_span("checkout") as span:
            job = new_job(job_type, args, meta=meta | producer_meta() | {"tracestate": TRACESTATE})
            async with conn.transaction():
                await enqueue(conn, job)
        produced.append((job, span))
    ended = {span.context.span_id: span for span in traces.named("checkout")}
    return [(job, ended[span.get_span_context().span_id]) for job, span in produced]


def traceparent_of(span: ReadableSpan) -> str:
    context = span.context
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _attribute(span: ReadableSpan, name: str) -> int:
    assert span.attributes is not None
    value = span.attributes[name]
    assert isinstance(value, int)
    return value


def ids_of(span: ReadableSpan) -> tuple[int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


async def test_the_producers_trace_reaches_the_ojs_job_and_its_request(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, traces: Traces
) -> None:
    """Per-row mode: the job keeps meta.traceparent, its POST carries it as a header, and
    the relay's publish span (child of its claim span) links to the producer's span."""
    produced = await produce_traced(
        conn, traces, [("order.fulfill", [{"n": n}], {}) for n in range(3)]
    )
    settings = relay_settings(database.dsn, emulator.url, sink={"batch": "off"})
    await run_until_idle(settings, tracing=traces.relay("ojs"))
    assert await drained(conn)
    ledger = emulator.emulator.ledger()
    for job, span in produced:
        entry = ledger[job["id"]]
        assert entry.job is not None
        assert entry.job["meta"]["traceparent"] == traceparent_of(span)
        assert entry.job["meta"]["tracestate"] == TRACESTATE
        assert entry.post_traceparents == (traceparent_of(span),)
    assert traces.linked() == {ids_of(span) for _, span in produced}
    claims = {span.context.span_id for span in traces.named(SPAN_CLAIM) if span.context}
    children = traces.named(SPAN_PUBLISH) + traces.named(SPAN_SETTLE)
    publishes = traces.named(SPAN_PUBLISH)
    assert len(publishes) == len(claims)  # one per claim, however many requests
    assert sum(_attribute(span, "relayd.requests") for span in publishes) == 3
    assert all(span.parent is not None and span.parent.span_id in claims for span in children)


async def test_a_batch_request_links_every_row_and_keeps_each_jobs_meta(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, traces: Traces
) -> None:
    """Batch mode: one publish span per request, linking each of its rows' producer spans;
    each job's meta is untouched; the batch request itself carries no traceparent."""
    produced = await produce_traced(
        conn, traces, [("order.fulfill", [{"n": n}], {}) for n in range(20)]
    )
    settings = relay_settings(
        database.dsn, emulator.url, relay={"workers": 1}, sink={"batch": "on"}
    )
    await run_until_idle(settings, tracing=traces.relay("ojs"))
    assert await drained(conn)
    ledger = emulator.emulator.ledger()
    for job, span in produced:
        entry = ledger[job["id"]]
        assert entry.job is not None
        assert entry.job["meta"]["traceparent"] == traceparent_of(span)
        assert entry.post_traceparents == (None,)
    publishes = traces.named(SPAN_PUBLISH)
    assert len(publishes) < len(produced)
    assert sum(_attribute(span, "messaging.batch.message_count") for span in publishes) == 20
    assert traces.linked() == {ids_of(span) for _, span in produced}


@pytest.mark.parametrize("batch", ["off", "on"])
async def test_rows_with_bad_trace_metadata_publish_normally_to_ojs(
    database: Database,
    conn: asyncpg.Connection,
    emulator: RunningEmulator,
    traces: Traces,
    batch: str,
) -> None:
    """Every kind of bad trace value: each row is published at its first attempt with its
    meta unchanged, and its request carries only a valid traceparent."""
    jobs = [
        new_job("order.fulfill", [{"n": n}], meta=case.meta) for n, case in enumerate(BAD_TRACES)
    ]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    settings = relay_settings(database.dsn, emulator.url, sink={"batch": batch})
    await run_until_idle(settings, tracing=traces.relay("ojs"))
    assert await drained(conn)
    dead = await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL")
    assert dead == 0
    ledger = emulator.emulator.ledger()
    for job, case in zip(jobs, BAD_TRACES, strict=True):
        entry = ledger[job["id"]]
        assert entry.job is not None
        assert entry.job["meta"] == case.meta, case.name
        assert len(entry.post_statuses) == 1, case.name  # published at the first attempt
        if batch == "off":
            assert entry.post_traceparents == (case.carried.get("traceparent"),), case.name


def nats_settings(dsn: str, url: str) -> Settings:
    """FAST, with a NATS sink at `url` routing order.updated to events.orders."""
    merged: dict[str, dict[str, Any]] = {name: dict(values) for name, values in FAST.items()}
    merged["database"] = {"dsn": dsn}
    merged["sink"] = {
        "kind": "nats",
        "timeout_s": 2.0,
        "connect_timeout_s": 1.0,
        "servers": [url],
        "stream": STREAM,
        "routes": [{"type": "order.updated", "subject": "events.orders"}],
    }
    return Settings(**merged)  # type: ignore[arg-type]


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A client of the test's server, with the EVENTS stream."""
    client = await nats.connect(nats_server.url)
    await client.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["events.>"]))
    yield client
    await client.close()


EVENT_META = {META_VERSION: 1, META_OCCURRED_AT: WHEN}


async def test_the_producers_trace_reaches_the_nats_message(
    database: Database,
    conn: asyncpg.Connection,
    nats_server: NatsServer,
    js: Client,
    traces: Traces,
) -> None:
    """Each message carries its row's traceparent and tracestate headers; the relay's
    publish spans link to the producers' spans."""
    produced = await produce_traced(
        conn, traces, [("order.updated", [{"order_id": n}], EVENT_META) for n in range(3)]
    )
    await run_until_idle(nats_settings(database.dsn, nats_server.url), tracing=traces.relay("nats"))
    assert await drained(conn)
    by_id = {message.event_id: message for message in await read_stream(js, STREAM)}
    assert set(by_id) == {job["id"] for job, _ in produced}
    for job, span in produced:
        headers = by_id[job["id"]].headers
        assert headers["traceparent"] == traceparent_of(span)
        assert headers["tracestate"] == TRACESTATE
    assert traces.linked() == {ids_of(span) for _, span in produced}
    assert all(
        span.attributes is not None and span.attributes["messaging.system"] == "nats"
        for span in traces.named(SPAN_PUBLISH)
    )


async def test_rows_with_bad_trace_metadata_publish_normally_to_nats(
    database: Database,
    conn: asyncpg.Connection,
    nats_server: NatsServer,
    js: Client,
    traces: Traces,
) -> None:
    """Every kind of bad trace value: each event is stored once, its headers carry only
    what is valid, and no row is dead-lettered."""
    jobs = [
        new_job("order.updated", [{"order_id": n}], meta=EVENT_META | case.meta)
        for n, case in enumerate(BAD_TRACES)
    ]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    await run_until_idle(nats_settings(database.dsn, nats_server.url), tracing=traces.relay("nats"))
    assert await drained(conn)
    dead = await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL")
    assert dead == 0
    messages = await read_stream(js, STREAM)
    assert len(messages) == len(jobs)
    by_id = {message.event_id: message for message in messages}
    for job, case in zip(jobs, BAD_TRACES, strict=True):
        headers = by_id[job["id"]].headers
        trace = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
        assert trace == case.carried, case.name
