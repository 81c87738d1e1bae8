"""`make bench`: drain an outbox backlog three ways in one run and print ratios.
(`python -m bench sampler` times the backlog sampler instead: bench/sampler.py.)

- one-row loop: the simplest outbox relay (SELECT one unsent row, POST it on a new
  connection, mark it published), sequential: the baseline;
- relayd per-row: `relayd run` with sink.batch = off;
- relayd batch: `relayd run` with sink.batch = on.

Each mode drains its own fresh outbox table on one embedded PostgreSQL, against one OJS
emulator process. Figures vary with the machine; the ratios are the result. Never pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import asyncpg

from relayd.migrate import connect_and_migrate
from relayd.models import OutboxTable
from relayd.producer import enqueue_many, new_job
from relayd.testing.postgres import EmbeddedPostgres
from relayd.testing.processes import emulator_process, free_port, relay_process

LOOP_TIMEOUT_S = 600


async def _outbox(dsn: str, name: str, rows: int) -> OutboxTable:
    table = OutboxTable.parse(f"bench.{name}")
    await connect_and_migrate(dsn, table)
    conn = await asyncpg.connect(dsn)
    try:
        for start in range(0, rows, 1000):
            jobs = [
                new_job("bench.job", [{"n": n}], queue="bench")
                for n in range(start, min(start + 1000, rows))
            ]
            async with conn.transaction():
                await enqueue_many(conn, jobs, table=table)
        await conn.execute(f"ANALYZE {table.qualified}")
    finally:
        await conn.close()
    return table


async def _one_row_loop(dsn: str, table: OutboxTable, sink_url: str) -> None:
    """The simplest relay, in-process: one row at a time, a new HTTP connection each."""
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


async def _wait_drained(dsn: str, table: OutboxTable) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        # The state lives in PostgreSQL, which cannot signal this loop: poll.
        while await conn.fetchval(  # noqa: ASYNC110
            f"SELECT EXISTS (SELECT 1 FROM {table.qualified} "
            "WHERE published_at IS NULL AND dead_at IS NULL)"
        ):
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def _relayd(base: Path, dsn: str, table: OutboxTable, sink_url: str, batch: str) -> float:
    async with relay_process(
        base,
        dsn,
        sink_url,
        free_port(),
        RELAYD_OUTBOX__TABLE=str(table),
        RELAYD_SINK__BATCH=batch,
        RELAYD_LOG__LEVEL="warning",
    ):
        started = time.perf_counter()
        await _wait_drained(dsn, table)
        return time.perf_counter() - started


async def _bench(rows: int, loop_rows: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="relayd-bench-"))
    try:
        with EmbeddedPostgres(base / "pg") as pg:
            dsn = pg.dsn()
            async with emulator_process(base) as sink_url:
                results: list[tuple[str, int, float]] = []
                table = await _outbox(dsn, "one_row_loop", loop_rows)
                started = time.perf_counter()
                await asyncio.wait_for(_one_row_loop(dsn, table, sink_url), LOOP_TIMEOUT_S)
                results.append(("one-row loop", loop_rows, time.perf_counter() - started))
                for name, batch in (("per_row", "off"), ("batch", "on")):
                    table = await _outbox(dsn, name, rows)
                    async with aiohttp.ClientSession() as http:
                        await http.post(f"{sink_url}/_emulator/reset")
                    elapsed = await _relayd(base, dsn, table, sink_url, batch)
                    results.append((f"relayd {name.replace('_', '-')}", rows, elapsed))
        _report(results)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _report(results: list[tuple[str, int, float]]) -> None:
    baseline = results[0][1] / results[0][2]
    print(f"{'mode':<22}{'rows':>9}{'seconds':>10}{'rows/s':>10}{'vs loop':>10}")
    for name, rows, seconds in results:
        rate = rows / seconds
        print(f"{name:<22}{rows:>9,}{seconds:>10.2f}{rate:>10,.0f}{rate / baseline:>9.1f}x")


def main() -> None:
    if sys.argv[1:2] == ["sampler"]:
        from bench.sampler import main as sampler  # noqa: PLC0415 - one benchmark per run

        sampler(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--rows", type=int, default=20_000, help="rows per relayd mode")
    parser.add_argument("--loop-rows", type=int, default=2_000, help="rows for the baseline")
    args = parser.parse_args()
    asyncio.run(_bench(args.rows, args.loop_rows))
    sys.stdout.flush()


main()
