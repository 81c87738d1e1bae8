"""drain: how fast a backlog empties, and what it costs in CPU, four ways.

- one-row loop (the baseline): the simplest outbox relay, in this process: SELECT one
  unsent row, POST it on a new connection, mark it published, sequentially;
- relayd per-row: `relayd run` with sink.batch = off (one POST per row);
- relayd batch: `relayd run` with sink.batch = on (up to sink.batch_max_jobs per POST);
- bare POSTs (the per-row CPU baseline): the same stored jobs POSTed by a bare aiohttp loop
  on the OJS sink's own session (`http_exchange.new_session` with the sink's headers,
  default settings), sink.concurrency at a time, each answer read; no database. relayd
  per-row's CPU per row against it is the cost of everything relayd adds to aiohttp's
  request path (target: within 1.5x).

Each mode drains its own freshly filled outbox; the emulator is reset before each. The loop
runs on fewer rows (it is slow); rates compare, not totals. CPU is read from /proc: the
relay's (relayd's process, or this process for the loop) and PostgreSQL's (the postmaster
and all its children), over the drain, per 1,000 rows.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import asyncpg

from bench.harness import (
    Bench,
    average_envelope_bytes,
    drain_timeout_s,
    drop_outbox,
    filled_outbox,
    paused_relays,
    reset_emulator,
    stored_rows,
)
from bench.measure import BenchError, Drain, Result, ratio, warnings_line
from relayd.core.rows import OutboxTable
from relayd.sinks.http.exchange import new_session
from relayd.sinks.ojs.answers import MEDIA_TYPE
from relayd.sinks.ojs.settings import OjsSettings
from relayd.sinks.ojs.sink import SESSION_HEADERS

NAME = "drain"
ROWS = {"full": 100_000, "quick": 20_000}
LOOP_ROWS = {"full": 2_000, "quick": 1_000}
LOOP_TIMEOUT_S = 600
LOOP_FILL_CHUNK = 1_000
BARE_ROWS = {"full": 20_000, "quick": 5_000}
PER_ROW_TARGET = 1.5


async def one_row_loop(dsn: str, table: OutboxTable, sink_url: str) -> None:
    """The simplest relay, in-process: one row at a time, a new HTTP connection each.
    (This is the loop `make bench` timed before the scenarios existed; kept as it was.)"""
    conn = await asyncpg.connect(dsn)
    connector = aiohttp.TCPConnector(force_close=True)
    headers = {"Content-Type": "application/openjobspec+json"}
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            while True:
                raw = await conn.fetchval(
                    f"SELECT job::text FROM {table.qualified} WHERE published_at IS NULL "
                    "ORDER BY created_at, event_id LIMIT 1"
                )
                if raw is None:
                    return
                expected = json.loads(raw)
                async with http.post(f"{sink_url}/ojs/v1/jobs", data=raw, headers=headers) as r:
                    if r.status == 409:
                        async with http.get(f"{sink_url}/ojs/v1/jobs/{expected['id']}") as g:
                            await g.read()
                    elif r.status >= 300:
                        raise RuntimeError(f"one-row loop: HTTP {r.status}")
                    await r.read()
                await conn.execute(
                    f"UPDATE {table.qualified} SET published_at = now() "
                    "WHERE event_id = $1::uuid AND published_at IS NULL",
                    expected["id"],
                )
    finally:
        await conn.close()


async def drain_loop(bench: Bench, rows: int) -> Drain:
    """Time the one-row loop over `rows` rows. Its CPU is this process's: nothing else
    runs in it meanwhile (the emulator and PostgreSQL are other processes)."""
    # Committed 1,000 rows at a time, as this benchmark's fill did when the loop was
    # written: the loop's SELECT (ORDER BY created_at, event_id) sorts the rows that share
    # the oldest created_at, so its cost depends on how many do.
    table = await filled_outbox(bench, "drain_loop", rows, chunk=LOOP_FILL_CHUNK)
    await reset_emulator(bench)
    cpu0 = bench.cpu_s(None)
    started = time.perf_counter()
    await asyncio.wait_for(one_row_loop(bench.dsn, table, bench.sink_url), LOOP_TIMEOUT_S)
    seconds = time.perf_counter() - started
    relay, pg, sink = (b - a for a, b in zip(cpu0, bench.cpu_s(None), strict=True))
    drained = Drain(rows, seconds, rows, relay, pg, sink)
    await drop_outbox(bench, table)
    return drained


async def bare_posts(bench: Bench, rows: int) -> Drain:
    """Time the bare POST loop over `rows` stored jobs (read from a filled outbox first, so
    the bodies are relayd's). Its CPU is this process's: nothing else runs in it meanwhile."""
    stored = await stored_rows(bench, "drain_bare", rows)
    bodies = iter([record["job"].encode() for record in stored])
    await reset_emulator(bench)
    settings = OjsSettings(url=bench.sink_url)
    url = f"{bench.sink_url}/ojs/v1/jobs"
    headers = {"Content-Type": MEDIA_TYPE}

    async def post_each(http: aiohttp.ClientSession) -> None:
        for body in bodies:  # one shared iterator: each body is POSTed once
            async with http.post(url, data=body, headers=headers, allow_redirects=False) as r:
                await r.read()
                if r.status >= 300:
                    raise BenchError(f"bare POST loop: HTTP {r.status}")

    http = new_session(settings, SESSION_HEADERS)
    try:
        cpu0 = bench.cpu_s(None)
        started = time.perf_counter()
        posters = (post_each(http) for _ in range(settings.concurrency))
        await asyncio.wait_for(asyncio.gather(*posters), LOOP_TIMEOUT_S)
        seconds = time.perf_counter() - started
        relay, pg, sink = (b - a for a, b in zip(cpu0, bench.cpu_s(None), strict=True))
    finally:
        await http.close()
    return Drain(rows, seconds, rows, relay, pg, sink)


async def drain_relayd(bench: Bench, mode: str, rows: int) -> tuple[Drain, int]:
    """Time one `relayd run` (settings `drain.<mode>`) over a fresh outbox of `rows` rows;
    also returns the mean envelope size."""
    table = await filled_outbox(bench, f"drain_{mode}", rows)
    conn = await asyncpg.connect(bench.dsn)
    try:
        envelope_bytes = await average_envelope_bytes(conn, table)
    finally:
        await conn.close()
    await reset_emulator(bench)
    async with paused_relays(bench, table, f"drain.{mode}") as relays:
        drained = await relays.drain(cpu_rows=rows, timeout_s=drain_timeout_s(rows))
    await drop_outbox(bench, table)
    return drained, envelope_bytes


async def run(bench: Bench) -> Result:
    size = "quick" if bench.quick else "full"
    rows, loop_rows = ROWS[size], LOOP_ROWS[size]
    loop = await drain_loop(bench, loop_rows)
    per_row, envelope_bytes = await drain_relayd(bench, "per_row", rows)
    batch, _ = await drain_relayd(bench, "batch", rows)
    bare = await bare_posts(bench, BARE_ROWS[size])
    per_row_cpu = ratio(per_row.relay_cpu_s / per_row.cpu_rows, bare.relay_cpu_s / bare.cpu_rows)
    figures = {
        "one_row_loop": loop.figures(),
        "per_row": per_row.figures() | {"vs_loop": ratio(per_row.rate, loop.rate)},
        "batch": batch.figures() | {"vs_loop": ratio(batch.rate, loop.rate)},
        "batch_vs_per_row": ratio(batch.rate, per_row.rate),
        "bare_posts": bare.figures(),
        "per_row_cpu_vs_bare_posts": per_row_cpu,
    }
    summary = [
        f"{'mode':<16}{'rows':>9}{'seconds':>9}{'rows/s':>10}{'vs loop':>9}"
        f"{'relay cpu s/1k':>16}{'pg cpu s/1k':>13}{'sink cpu s/1k':>15}{'relay us/row':>14}"
    ]
    for name, drained in (
        ("one-row loop", loop),
        ("relayd per-row", per_row),
        ("relayd batch", batch),
        ("bare POSTs", bare),
    ):
        f = drained.figures()
        summary.append(
            f"{name:<16}{drained.rows:>9,}{drained.seconds:>9.2f}{drained.rate:>10,.0f}"
            f"{ratio(drained.rate, loop.rate):>8.1f}x"
            f"{f['relay_cpu_s_per_1000_rows']:>16.3f}{f['pg_cpu_s_per_1000_rows']:>13.3f}"
            f"{f['sink_cpu_s_per_1000_rows']:>15.3f}"
            f"{f['relay_cpu_us_per_row']:>14.0f}"
        )
    verdict = "within" if per_row_cpu <= PER_ROW_TARGET else "over"
    summary.append(
        f"relayd per-row CPU per row: {per_row_cpu:.2f}x the bare POST loop's "
        f"({verdict} the {PER_ROW_TARGET}x target)"
    )
    summary += warnings_line(per_row.relay_warnings) + warnings_line(batch.relay_warnings)
    return Result(
        scenario=NAME,
        params={
            "rows": rows,
            "loop_rows": loop_rows,
            "envelope_bytes": envelope_bytes,
            "relay_cpu_of_loop": "this process (the loop runs in it)",
            "bare_rows": BARE_ROWS[size],
            "bare_posts": "the OJS sink's session at default settings, sink.concurrency at a time",
        },
        baseline="the one-row loop, same run, on loop_rows rows",
        headline={
            "batch_vs_loop": ratio(batch.rate, loop.rate),
            "per_row_vs_loop": ratio(per_row.rate, loop.rate),
            "per_row_cpu_vs_bare_posts": per_row_cpu,
        },
        figures=figures,
        summary=summary,
    )
