"""nats: the NATS JetStream sink: how fast it drains, what it costs, how late it publishes.

Against one `nats-server` with JetStream (the dev extra's binary), a file-stored stream and
five event types routed to five subjects, each figure beside a baseline of the same run:

- client pipeline (the CPU baseline): this process publishes the same messages relayd sends
  (built beforehand by relayd's own `message_for`: same subjects, bodies and headers) with
  nats-py's JetStream publish, 32 publishers each awaiting its PubAck before the next: what
  the client library itself costs per message, with no outbox around it;
- one-row loop (the rate baseline): the simplest NATS outbox relay, in this process: SELECT
  one unsent row, `await js.publish`, mark it published, sequentially;
- relayd drain: `relayd run` with `[sink] kind = "nats"` on a filled outbox;
- lag: producers committing events at 1,000 and 5,000 rows/s into a running relayd, as
  bench/steady.py measures it (the lag of a row is published_at - created_at, the database's clock).

CPU comes from /proc as in `drain`; nats-server's own is reported as the sink's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats
from nats.js.api import StorageType, StreamConfig
from nats.js.client import JetStreamContext

from bench import steady
from bench.harness import (
    EVENT_FILL_SQL,
    Bench,
    drain_timeout_s,
    drop_outbox,
    filled_outbox,
    paused_relays,
    stored_rows,
)
from bench.measure import BenchError, Drain, Result, process_cpu_s, ratio, warnings_line
from relayd.core.envelope import META_OCCURRED_AT, META_VERSION, Envelope
from relayd.core.rows import OutboxTable
from relayd.producer import new_job
from relayd.sinks.nats.message import NatsMessage, Route, Routes, message_for
from relayd.testing.nats import NatsServer

NAME = "nats"
ROWS = {"full": 50_000, "quick": 10_000}
LOOP_ROWS = {"full": 2_000, "quick": 1_000}
LAG_SECONDS = {"full": 30.0, "quick": 10.0}
CONCURRENCY = 32  # publishers in the client pipeline, each with one publish in flight
STREAM = "BENCH"
KINDS = 5
SUBJECT_PREFIX = "bench.events"
ROUTES = [{"type": f"bench.kind{k}", "subject": f"{SUBJECT_PREFIX}.kind{k}"} for k in range(KINDS)]
PUBLISH_TIMEOUT_S = 10.0

_ROUTES = Routes([Route(str(r["type"]), str(r["subject"])) for r in ROUTES])


def message_of(raw: str) -> NatsMessage:
    """The message relayd sends for a stored envelope (the same subject, body, headers)."""
    job = json.loads(raw)
    message = message_for(
        Envelope.parse(raw, str(job["id"])),
        _ROUTES,
        stream=STREAM,
        source="relayd",
        max_body_bytes=1024 * 1024,
    )
    if not isinstance(message, NatsMessage):
        raise BenchError(f"a bench event cannot be sent: {message.error}")
    return message


def event_job(index: int, n: int) -> dict[str, Any]:
    """What the steady producers commit here: an event of one of the routed types."""
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return new_job(
        f"bench.kind{n % KINDS}",
        [{"producer": index, "n": n}],
        meta={META_VERSION: 1, META_OCCURRED_AT: when},
    )


@contextlib.asynccontextmanager
async def nats_stream(bench: Bench) -> AsyncIterator[tuple[NatsServer, JetStreamContext]]:
    """A nats-server in the run's directory with the stream on the routes' subjects."""
    with NatsServer(bench.base / "nats") as server:
        client = await nats.connect(server.url)
        try:
            js = client.jetstream()
            await js.add_stream(
                StreamConfig(
                    name=STREAM, subjects=[f"{SUBJECT_PREFIX}.>"], storage=StorageType.FILE
                )
            )
            yield server, js
        finally:
            await client.close()


def sink_env(server: NatsServer) -> dict[str, str]:
    return {
        "RELAYD_SINK__KIND": "nats",
        "RELAYD_SINK__SERVERS": server.url,
        "RELAYD_SINK__STREAM": STREAM,
        "RELAYD_SINK__ROUTES": json.dumps(ROUTES),
    }


async def stored(js: JetStreamContext) -> int:
    info = await js.stream_info(STREAM)
    return int(info.state.messages)


async def client_pipeline(
    bench: Bench, server: NatsServer, js: JetStreamContext, rows: int
) -> Drain:
    """nats-py's JetStream publish by CONCURRENCY publishers, of `rows` messages built
    beforehand: the client's own cost per message."""
    raws = await stored_rows(bench, "nats_client", rows, rows_sql=EVENT_FILL_SQL)
    messages = iter([message_of(r["job"]) for r in raws])

    async def publisher() -> None:
        for message in messages:  # shared: each message goes to the next free publisher
            await js.publish(
                message.subject,
                message.body,
                timeout=PUBLISH_TIMEOUT_S,
                headers=dict(message.headers),
            )

    await js.purge_stream(STREAM)
    cpu0, sink0 = time.process_time(), process_cpu_s(server.pid)
    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(CONCURRENCY):
            group.create_task(publisher())
    seconds = time.perf_counter() - started
    cpu, sink = time.process_time() - cpu0, process_cpu_s(server.pid) - sink0
    if await stored(js) != rows:
        raise BenchError(f"client pipeline: {await stored(js):,} of {rows:,} messages stored")
    return Drain(rows, seconds, rows, cpu, 0.0, sink)


async def one_row_loop(dsn: str, table: OutboxTable, js: JetStreamContext) -> None:
    """The simplest NATS outbox relay, in-process: one row at a time."""
    conn = await asyncpg.connect(dsn)
    try:
        while True:
            raw = await conn.fetchval(
                f"SELECT job::text FROM {table.qualified} WHERE published_at IS NULL "
                "ORDER BY created_at, event_id LIMIT 1"
            )
            if raw is None:
                return
            message = message_of(raw)
            await js.publish(
                message.subject,
                message.body,
                timeout=PUBLISH_TIMEOUT_S,
                headers=dict(message.headers),
            )
            await conn.execute(
                f"UPDATE {table.qualified} SET published_at = now() "
                "WHERE event_id = $1::uuid AND published_at IS NULL",
                message.headers["Nats-Msg-Id"],
            )
    finally:
        await conn.close()


async def drain_loop(bench: Bench, server: NatsServer, js: JetStreamContext, rows: int) -> Drain:
    """Time the one-row loop over `rows` rows (its CPU is this process's)."""
    table = await filled_outbox(bench, "nats_loop", rows, chunk=1_000, rows_sql=EVENT_FILL_SQL)
    await js.purge_stream(STREAM)
    cpu0, pg0, sink0 = (*bench.cpu_s(None)[:2], process_cpu_s(server.pid))
    started = time.perf_counter()
    await asyncio.wait_for(one_row_loop(bench.dsn, table, js), drain_timeout_s(rows))
    seconds = time.perf_counter() - started
    relay, pg = (b - a for a, b in zip((cpu0, pg0), bench.cpu_s(None)[:2], strict=True))
    await drop_outbox(bench, table)
    return Drain(rows, seconds, rows, relay, pg, process_cpu_s(server.pid) - sink0)


async def drain_relayd(bench: Bench, server: NatsServer, js: JetStreamContext, rows: int) -> Drain:
    """Time one `relayd run` publishing a fresh outbox of `rows` events to the stream."""
    table = await filled_outbox(bench, "nats_drain", rows, rows_sql=EVENT_FILL_SQL)
    await js.purge_stream(STREAM)
    async with paused_relays(bench, table, NAME, sink=sink_env(server)) as relays:
        sink0 = process_cpu_s(server.pid)
        drained = await relays.drain(cpu_rows=rows, timeout_s=drain_timeout_s(rows), emulator=False)
        drained = dataclasses.replace(drained, sink_cpu_s=process_cpu_s(server.pid) - sink0)
    await drop_outbox(bench, table)
    if await stored(js) != rows:
        raise BenchError(f"relayd drain: {await stored(js):,} of {rows:,} events in the stream")
    return drained


async def run(bench: Bench) -> Result:
    size = "quick" if bench.quick else "full"
    rows, loop_rows, seconds = ROWS[size], LOOP_ROWS[size], LAG_SECONDS[size]
    async with nats_stream(bench) as (server, js):
        client = await client_pipeline(bench, server, js, rows)
        loop = await drain_loop(bench, server, js, loop_rows)
        relayd = await drain_relayd(bench, server, js, rows)
        target = steady.Target(
            key=NAME, sink=sink_env(server), make_job=event_job, sink_pid=server.pid
        )
        lags = {rate: await steady.measure(bench, rate, seconds, target) for rate in steady.RATES}
    low, high = steady.RATES
    relay_us = relayd.figures()["relay_cpu_us_per_row"]
    client_us = client.figures()["relay_cpu_us_per_row"]
    figures = {
        "client_pipeline": client.figures(),
        "one_row_loop": loop.figures(),
        "relayd": relayd.figures() | {"vs_loop": ratio(relayd.rate, loop.rate)},
        **{f"lag_{rate}": f for rate, f in lags.items()},
    }
    summary = [
        f"{'mode':<18}{'rows':>9}{'seconds':>9}{'rows/s':>10}{'vs loop':>9}"
        f"{'cpu us/row':>12}{'pg cpu us/row':>15}{'nats cpu us/row':>17}"
    ]
    for name, drained in (
        ("client pipeline", client),
        ("one-row loop", loop),
        ("relayd", relayd),
    ):
        f = drained.figures()
        summary.append(
            f"{name:<18}{drained.rows:>9,}{drained.seconds:>9.2f}{drained.rate:>10,.0f}"
            f"{ratio(drained.rate, loop.rate):>8.1f}x{f['relay_cpu_us_per_row']:>12.0f}"
            f"{f['pg_cpu_s_per_1000_rows'] * 1000:>15.0f}"
            f"{f['sink_cpu_s_per_1000_rows'] * 1000:>17.0f}"
        )
    summary.append(
        f"relayd cpu per row vs the client's own: {ratio(relay_us, client_us):.2f}x "
        f"({relay_us:.0f} vs {client_us:.0f} us); its rate: "
        f"{ratio(relayd.rate, client.rate):.2f}x the client pipeline's"
    )
    for rate, f in lags.items():
        summary.append(
            f"lag at {rate:,} rows/s (achieved {f['achieved_rows_per_s']:,.0f}): "
            f"p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, max {f['max_ms']:.1f} ms"
        )
        summary += [f"{rate:,} rows/s: {line}" for line in warnings_line(f["relay_warnings"])]
    summary += steady.split_lines(lags)
    summary += steady.cpu_lines(lags)
    summary += warnings_line(relayd.relay_warnings)
    return Result(
        scenario=NAME,
        params={
            "rows": rows,
            "loop_rows": loop_rows,
            "lag_seconds": seconds,
            "client_pipeline_publishers": CONCURRENCY,
            "routes": len(ROUTES),
            "stream_storage": "file",
        },
        baseline=(
            "the one-row loop (rate) and nats-py's own pipelined publish (CPU per row), "
            f"same run; lag at {low:,} rows/s"
        ),
        headline={
            "relayd_vs_loop": ratio(relayd.rate, loop.rate),
            "relay_cpu_vs_client": ratio(relay_us, client_us),
            "relayd_vs_client_pipeline": ratio(relayd.rate, client.rate),
            f"p99_ms_at_{high}": lags[high]["p99_ms"],
            f"p99_{high}_vs_{low}": ratio(lags[high]["p99_ms"], lags[low]["p99_ms"]),
            f"relayd_p99_ms_at_{high}": lags[high]["relayd_p99_ms"],
        },
        figures=figures,
        summary=summary,
    )
