"""`relayd run` configured by the standard OTEL_* variables records its spans: with the SDK's
console exporter, a drain's claim, publish and settle spans reach stdout at the stop, the
publish span linked to the rows' producer context; the job and its request carry it."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import asyncpg

from relayd.producer import enqueue_many, new_job
from relayd.telemetry.tracing import SPAN_CLAIM, SPAN_PUBLISH, SPAN_SETTLE
from relayd.testing.emulator import start_emulator
from tests.support import Database, drained, eventually, start_relayd
from tests.trace_cases import SPAN_ID, TRACE_ID, TRACEPARENT, TRACESTATE


def _json_documents(text: str) -> list[dict[str, Any]]:
    """The console exporter's output: one indented JSON object per span."""
    decoder = json.JSONDecoder()
    documents: list[dict[str, Any]] = []
    index = 0
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index == len(text):
            return documents
        document, index = decoder.raw_decode(text, index)
        documents.append(document)


async def test_otel_variables_turn_on_the_relays_spans(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    """OTEL_TRACES_EXPORTER=console, always on: spans for claim, publish (linked to the
    producer's span) and settle are exported; daemon.started says tracing=true."""
    meta = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    jobs = [new_job("order.fulfill", [{"n": n}], meta=meta) for n in range(5)]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    async with await start_emulator() as sink:
        env = cli_env | {
            "RELAYD_DATABASE__DSN": database.dsn,
            "RELAYD_SINK__URL": sink.url,
            "RELAYD_SINK__BATCH": "off",
            "RELAYD_HTTP__ENABLED": "false",
            "RELAYD_LOG__FORMAT": "json",
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_TRACES_SAMPLER": "always_on",
            "OTEL_SERVICE_NAME": "relayd-under-test",
        }
        process = await start_relayd("run", env=env)
        try:
            await eventually(lambda: drained(conn))
        finally:
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                stdout, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()[-2000:]
        ledger = sink.emulator.ledger()
    events = [json.loads(line) for line in stderr.decode().splitlines()]
    [started] = [event for event in events if event["event"] == "daemon.started"]
    assert started["tracing"] is True
    spans = _json_documents(stdout.decode())
    names = [span["name"] for span in spans]
    assert {SPAN_CLAIM, SPAN_PUBLISH, SPAN_SETTLE} <= set(names)
    publishes = [span for span in spans if span["name"] == SPAN_PUBLISH]
    links = [
        (link["context"]["trace_id"], link["context"]["span_id"])
        for span in publishes
        for link in span["links"]
    ]
    # The rows share one producer context: one link per publish span (one per claim).
    assert publishes
    assert links == [(f"0x{TRACE_ID}", f"0x{SPAN_ID}")] * len(publishes)
    for span in publishes:
        assert span["resource"]["attributes"]["service.name"] == "relayd-under-test"
    for job in jobs:
        assert ledger[job["id"]].post_traceparents == (TRACEPARENT,)
