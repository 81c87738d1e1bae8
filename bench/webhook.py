"""webhook: how fast the webhook sink drains a backlog, against a one-row loop.

- one-row loop (the baseline), in this process: claim one unsent row (SELECT ... LIMIT 1),
  build its signed delivery with relayd's own functions, POST it over a keep-alive
  connection, mark it published; sequentially;
- relayd: `relayd run` with `[sink] kind = "webhook"`, one signed POST per row, concurrently.

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
import time
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
from aiohttp import web

from bench.harness import (
    Bench,
    Relay,
    Relays,
    drain_timeout_s,
    drop_outbox,
    filled_outbox,
    relayd_command,
)
from bench.measure import BenchError, Drain, Result, ratio, warnings_line
from bench.settings import relay_settings
from relayd.models import Envelope, OutboxTable
from relayd.sinks.webhook_answers import (
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    Delivery,
    delivery_for,
)
from relayd.sinks.webhook_signing import parse_secrets, signature_header
from relayd.testing.processes import await_http, free_port, relay_process

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


async def one_row_loop(dsn: str, table: OutboxTable, url: str) -> None:
    """The simplest webhook relay: one row at a time, signed as relayd signs it."""
    keys = parse_secrets(SECRET)
    conn = await asyncpg.connect(dsn)
    try:
        async with aiohttp.ClientSession() as http:
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


async def drain_loop(bench: Bench, rows: int, url: str) -> Drain:
    table = await filled_outbox(bench, "webhook_loop", rows)
    cpu0 = bench.cpu_s(None)
    started = time.perf_counter()
    await asyncio.wait_for(one_row_loop(bench.dsn, table, url), LOOP_TIMEOUT_S)
    seconds = time.perf_counter() - started
    relay, pg, sink = (b - a for a, b in zip(cpu0, bench.cpu_s(None), strict=True))
    await drop_outbox(bench, table)
    return Drain(rows, seconds, rows, relay, pg, sink)


async def drain_relayd(bench: Bench, rows: int, url: str) -> Drain:
    """One `relayd run` of the webhook kind, started on a paused outbox, timed from the
    resume to the last row (Relays.drain)."""
    table = await filled_outbox(bench, "webhook_relayd", rows)
    directory = bench.relay_dir(f"{table.name}-relay0")
    secret_file = directory / "webhook-secret"
    secret_file.write_text(SECRET + "\n")
    env = relay_settings(NAME) | {
        "RELAYD_OUTBOX__TABLE": str(table),
        "RELAYD_SINK__SECRET_FILE": str(secret_file),
    }
    await relayd_command(bench, table, "pause", "--reason", "bench: start the relay first")
    port = free_port()
    async with relay_process(directory, bench.dsn, url, port, **env) as process:
        await await_http(f"http://127.0.0.1:{port}/readyz", process)
        relays = Relays(bench, table, [Relay(process, port, directory / "relayd.log")])
        # ledger=True: the emulator is not this scenario's sink, nothing to keep small.
        drained = await relays.drain(cpu_rows=rows, timeout_s=drain_timeout_s(rows), ledger=True)
    await drop_outbox(bench, table)
    return drained


async def run(bench: Bench) -> Result:
    size = "quick" if bench.quick else "full"
    rows, loop_rows = ROWS[size], LOOP_ROWS[size]
    async with _receiving() as receiver:
        loop = await drain_loop(bench, loop_rows, receiver.url)
        relayd = await drain_relayd(bench, rows, receiver.url)
        if len(receiver.ids) != loop_rows + rows:
            raise BenchError(
                f"the receiver got {len(receiver.ids):,} ids, expected {loop_rows + rows:,}"
            )
        duplicates = receiver.deliveries - len(receiver.ids)
    vs_loop = ratio(relayd.rate, loop.rate)
    summary = [
        f"{'mode':<16}{'rows':>9}{'seconds':>9}{'rows/s':>10}{'vs loop':>9}{'relay us/row':>14}"
    ]
    for name, drained in (("one-row loop", loop), ("relayd webhook", relayd)):
        summary.append(
            f"{name:<16}{drained.rows:>9,}{drained.seconds:>9.2f}{drained.rate:>10,.0f}"
            f"{ratio(drained.rate, loop.rate):>8.1f}x"
            f"{drained.figures()['relay_cpu_us_per_row']:>14.0f}"
        )
    summary += warnings_line(relayd.relay_warnings)
    return Result(
        scenario=NAME,
        params={
            "rows": rows,
            "loop_rows": loop_rows,
            "receiver": "in the benchmark's process, 204 to each delivery",
            "relay_cpu_of_loop": "this process (the loop and the receiver run in it)",
        },
        baseline="the one-row webhook loop, same run, on loop_rows rows",
        headline={"relayd_vs_loop": vs_loop},
        figures={
            "one_row_loop": loop.figures(),
            "relayd": relayd.figures() | {"vs_loop": vs_loop},
            "duplicate_deliveries": duplicates,
        },
        summary=summary,
    )
