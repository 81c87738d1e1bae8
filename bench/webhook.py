"""webhook: how fast the webhook sink drains a backlog, against a one-row loop.

- one-row loop (the baseline), in this process: claim one unsent row (SELECT ... LIMIT 1),
  build its signed delivery with relayd's own functions, POST it over a keep-alive
  connection, mark it published; sequentially; and the same loop with a new connection per
  POST, as `drain`'s OJS loop does;
- relayd: `relayd run` with `[sink] kind = "webhook"`, one signed POST per row, concurrently;
- bare POSTs (the ceiling): the same number of deliveries, signed beforehand, POSTed by a
  bare aiohttp loop in a process of its own (bench/bare_posts.py) on the sink's session,
  sink.concurrency at a time: what any aiohttp relay could reach here, with nothing of a
  relay's work.

Both deliver to the same receiver, in this process: it answers 204 to each delivery and
records its webhook-id (signatures are verified by the tests, not here, so that the
receiver's CPU is not what is measured). Each mode drains its own freshly filled outbox;
the loop runs on fewer rows. Rates compare, not totals. The loop's CPU is this process's,
the receiver's included; relayd's is its process's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
from aiohttp import web

from bench.harness import (
    Bench,
    drain_timeout_s,
    drop_outbox,
    filled_outbox,
    paused_relays,
    stored_rows,
)
from bench.measure import BenchError, Drain, Result, ratio, warnings_line
from relayd.core.envelope import Envelope
from relayd.core.rows import OutboxTable
from relayd.sinks.webhook.answers import (
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    Delivery,
    delivery_for,
)
from relayd.sinks.webhook.settings import WebhookSettings
from relayd.sinks.webhook.signing import SigningKeys, parse_secrets, signature_header
from relayd.testing.processes import free_port

NAME = "webhook"
ROWS = {"full": 50_000, "quick": 10_000}
LOOP_ROWS = {"full": 2_000, "quick": 1_000}
LOOP_TIMEOUT_S = 600
SECRET = "whsec_" + base64.b64encode(b"bench webhook secret, 32 bytes!!").decode()


class _Receiver:
    """Answers 204 to every delivery and counts the ids it received."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.deliveries = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.ids.add(request.headers.get(HEADER_ID, ""))
        self.deliveries += 1
        return web.Response(status=204)


@contextlib.asynccontextmanager
async def _receiving() -> AsyncIterator[_Receiver]:
    receiver = _Receiver()
    app = web.Application()
    app.router.add_post("/hooks", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        receiver.url = f"http://127.0.0.1:{port}/hooks"
        yield receiver
    finally:
        await runner.cleanup()


async def one_row_loop(dsn: str, table: OutboxTable, url: str, *, keep_alive: bool) -> None:
    """The simplest webhook relay: one row at a time, signed as relayd signs it, over one
    kept connection or a new one per POST."""
    keys = parse_secrets(SECRET)
    conn = await asyncpg.connect(dsn)
    connector = aiohttp.TCPConnector(force_close=not keep_alive)
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            while True:
                row = await conn.fetchrow(
                    f"SELECT event_id::text, job::text FROM {table.qualified} "
                    "WHERE published_at IS NULL ORDER BY created_at, event_id LIMIT 1"
                )
                if row is None:
                    return
                delivery = delivery_for(
                    Envelope.parse(row["job"], row["event_id"]), url=url, routes={}
                )
                if not isinstance(delivery, Delivery):
                    raise BenchError(f"one-row loop: {delivery.error}")
                now_s = int(time.time())
                headers = dict(delivery.headers) | {
                    HEADER_TIMESTAMP: str(now_s),
                    HEADER_SIGNATURE: signature_header(
                        keys, delivery.headers[HEADER_ID], now_s, delivery.body
                    ),
                }
                async with http.post(url, data=delivery.body, headers=headers) as answer:
                    await answer.read()
                    if answer.status >= 300:
                        raise BenchError(f"one-row loop: HTTP {answer.status}")
                await conn.execute(
                    f"UPDATE {table.qualified} SET published_at = now() "
                    "WHERE event_id = $1::uuid AND published_at IS NULL",
                    row["event_id"],
                )
    finally:
        await conn.close()


async def drain_loop(bench: Bench, rows: int, url: str, *, keep_alive: bool) -> Drain:
    table = await filled_outbox(bench, "webhook_loop", rows)
    cpu0 = bench.cpu_s(None)
    started = time.perf_counter()
    await asyncio.wait_for(
        one_row_loop(bench.dsn, table, url, keep_alive=keep_alive), LOOP_TIMEOUT_S
    )
    seconds = time.perf_counter() - started
    relay, pg, sink = (b - a for a, b in zip(cpu0, bench.cpu_s(None), strict=True))
    await drop_outbox(bench, table)
    return Drain(rows, seconds, rows, relay, pg, sink)


def signed_request(keys: SigningKeys, raw_job: str, event_id: str, url: str) -> dict[str, object]:
    """A row's delivery as relayd would send it now: its body and its signed headers."""
    delivery = delivery_for(Envelope.parse(raw_job, event_id), url=url, routes={})
    if not isinstance(delivery, Delivery):
        raise BenchError(f"bare POSTs: {delivery.error}")
    now_s = int(time.time())
    headers = dict(delivery.headers) | {
        HEADER_TIMESTAMP: str(now_s),
        HEADER_SIGNATURE: signature_header(keys, delivery.headers[HEADER_ID], now_s, delivery.body),
    }
    return {"headers": headers, "body": delivery.body.decode()}


async def bare_posts(bench: Bench, rows: int, url: str) -> Drain:
    """Time bench/bare_posts.py over `rows` signed deliveries (rows of a filled outbox,
    signed first); the receiver, in this process, is the sink's CPU."""
    stored = await stored_rows(bench, "webhook_bare", rows)
    keys = parse_secrets(SECRET)
    requests = bench.relay_dir("webhook") / "bare-requests.jsonl"
    lines = (json.dumps(signed_request(keys, r["job"], r["event_id"], url)) for r in stored)
    requests.write_text("".join(line + "\n" for line in lines))
    concurrency = str(WebhookSettings(url=url).concurrency)
    receiver0 = time.process_time()
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.bare_posts",
        str(requests),
        url,
        concurrency,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(child.communicate(), LOOP_TIMEOUT_S)
    receiver_s = time.process_time() - receiver0
    if child.returncode != 0:
        raise BenchError(f"bare POSTs exited {child.returncode}")
    timed = json.loads(out)
    return Drain(rows, timed["seconds"], rows, timed["cpu_s"], 0.0, receiver_s)


async def drain_relayd(bench: Bench, rows: int, url: str) -> Drain:
    """One `relayd run` of the webhook kind, started on a paused outbox, timed from the
    resume to the last row (Relays.drain). The receiver runs in this process: its CPU over
    the drain is reported as the sink's."""
    table = await filled_outbox(bench, "webhook_relayd", rows)
    secret_file = bench.relay_dir("webhook") / "webhook-secret"
    secret_file.write_text(SECRET + "\n")
    sink = {
        "RELAYD_SINK__KIND": "webhook",
        "RELAYD_SINK__URL": url,
        "RELAYD_SINK__SECRET_FILE": str(secret_file),
    }
    async with paused_relays(bench, table, NAME, sink=sink) as relays:
        receiver0 = time.process_time()
        drained = await relays.drain(cpu_rows=rows, timeout_s=drain_timeout_s(rows), emulator=False)
        drained = dataclasses.replace(drained, sink_cpu_s=time.process_time() - receiver0)
    await drop_outbox(bench, table)
    return drained


async def run(bench: Bench) -> Result:
    size = "quick" if bench.quick else "full"
    rows, loop_rows = ROWS[size], LOOP_ROWS[size]
    async with _receiving() as receiver:
        loop = await drain_loop(bench, loop_rows, receiver.url, keep_alive=True)
        fresh = await drain_loop(bench, loop_rows, receiver.url, keep_alive=False)
        relayd = await drain_relayd(bench, rows, receiver.url)
        bare = await bare_posts(bench, rows, receiver.url)
        expected = 2 * loop_rows + 2 * rows
        if len(receiver.ids) != expected:
            raise BenchError(f"the receiver got {len(receiver.ids):,} ids, expected {expected:,}")
        duplicates = receiver.deliveries - len(receiver.ids)
    vs_loop = ratio(relayd.rate, loop.rate)
    cpu_vs_bare = ratio(relayd.relay_cpu_s / relayd.cpu_rows, bare.relay_cpu_s / bare.cpu_rows)
    vs_fresh = ratio(relayd.rate, fresh.rate)
    summary = [
        f"{'mode':<28}{'rows':>9}{'seconds':>9}{'rows/s':>10}{'vs loop':>9}{'relay us/row':>14}"
        f"{'receiver us/row':>17}"
    ]
    for name, drained in (
        ("one-row loop (keep-alive)", loop),
        ("one-row loop (new conn.)", fresh),
        ("relayd webhook", relayd),
        ("bare POSTs (ceiling)", bare),
    ):
        f = drained.figures()
        summary.append(
            f"{name:<28}{drained.rows:>9,}{drained.seconds:>9.2f}{drained.rate:>10,.0f}"
            f"{ratio(drained.rate, loop.rate):>8.1f}x{f['relay_cpu_us_per_row']:>14.0f}"
            f"{f['sink_cpu_s_per_1000_rows'] * 1000:>17.0f}"
        )
    summary.append(f"relayd vs the new-connection loop: {vs_fresh:.1f}x")
    summary.append(
        f"relayd vs the bare POSTs: {ratio(relayd.rate, bare.rate):.2f}x the rate, "
        f"{cpu_vs_bare:.2f}x the CPU per row"
    )
    summary += warnings_line(relayd.relay_warnings)
    return Result(
        scenario=NAME,
        params={
            "rows": rows,
            "loop_rows": loop_rows,
            "receiver": "in the benchmark's process, 204 to each delivery",
            "relay_cpu_of_loop": "this process (the loop and the receiver run in it)",
            "sink_cpu_of_relayd": "this process's during the drain (the receiver)",
            "bare_posts": "bench/bare_posts.py, its own process, the sink's session, "
            "sink.concurrency at a time, on rows deliveries signed beforehand",
        },
        baseline="the one-row webhook loop, same run, on loop_rows rows",
        headline={
            "relayd_vs_loop": vs_loop,
            "relayd_vs_new_connection_loop": vs_fresh,
            "bare_posts_vs_loop": ratio(bare.rate, loop.rate),
            "relayd_vs_bare_posts": ratio(relayd.rate, bare.rate),
            "relayd_cpu_vs_bare_posts": cpu_vs_bare,
        },
        figures={
            "one_row_loop": loop.figures(),
            "one_row_loop_new_connection": fresh.figures(),
            "relayd": relayd.figures() | {"vs_loop": vs_loop},
            "bare_posts": bare.figures() | {"vs_loop": ratio(bare.rate, loop.rate)},
            "duplicate_deliveries": duplicates,
        },
        summary=summary,
    )
