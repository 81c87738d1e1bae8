"""appends: what a producer's write to the outbox costs the server, against a bare INSERT.

Producers and relays share one PostgreSQL, so the server CPU a producer's INSERT costs is
CPU the claims cannot have (docs/performance.md#what-a-write-costs-the-server). Each mode
commits `rows` envelopes from one connection in this process, one transaction after another,
and the figure is the CPU of that connection's backend (read from /proc) per row:

- `bare_insert` (the baseline): one row per transaction, the same event_id and job text, in
  a table with the same two columns and a primary key only;
- `append`: one row per transaction, with `relayd.producer.append` (idempotent: an
  INSERT ... ON CONFLICT DO NOTHING) into a migrated outbox, its check and its NOTIFY
  trigger included;
- `bare_insert_10` and `enqueue_many_10`: the same, ten rows per transaction (one
  multi-row statement each).

Each mode writes into a fresh table; the modes run in the order above, then again in
reverse (a drift over the run weighs on both alike), and a mode's figure is over its two
rounds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from bench.harness import Bench, drop_outbox, new_outbox
from bench.measure import Result, process_cpu_s, ratio
from relayd.models import OutboxTable
from relayd.producer import Outbox, append, enqueue_many, new_job

NAME = "appends"
ROWS = {"full": 40_000, "quick": 10_000}
MODES = ("bare_insert", "append", "bare_insert_10", "enqueue_many_10")

Write = Callable[[asyncpg.Connection, list[dict[str, Any]]], Awaitable[None]]


def _jobs(rows: int) -> list[dict[str, Any]]:
    return [new_job("bench.append", [{"order_id": n, "status": "paid"}]) for n in range(rows)]


async def _bare_table(conn: asyncpg.Connection, bench: Bench) -> str:
    table = bench.table("bare")
    await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {table.quoted_schema}")
    await conn.execute(
        f"CREATE TABLE {table.qualified} (event_id uuid PRIMARY KEY, job jsonb NOT NULL)"
    )
    return table.qualified


def _bare_writer(table: str) -> Write:
    async def write(conn: asyncpg.Connection, jobs: list[dict[str, Any]]) -> None:
        await conn.execute(
            f"INSERT INTO {table} (event_id, job) "
            "SELECT CAST(i AS uuid), CAST(j AS jsonb) "
            "FROM unnest($1::text[], $2::text[]) AS r(i, j)",
            [job["id"] for job in jobs],
            [json.dumps(job) for job in jobs],
        )

    return write


def _append_writer(table: OutboxTable) -> Write:
    outbox = Outbox(table=table)

    async def write(conn: asyncpg.Connection, jobs: list[dict[str, Any]]) -> None:
        for job in jobs:
            await append(conn, job, outbox=outbox)

    return write


def _many_writer(table: OutboxTable) -> Write:
    async def write(conn: asyncpg.Connection, jobs: list[dict[str, Any]]) -> None:
        await enqueue_many(conn, jobs, table=table)

    return write


async def _measure(bench: Bench, mode: str, rows: int) -> tuple[float, float]:
    """Backend CPU seconds and wall seconds for `rows` rows written in `mode`."""
    per_commit = 10 if mode.endswith("_10") else 1
    conn = await asyncpg.connect(bench.dsn)
    outbox: OutboxTable | None = None
    try:
        if mode.startswith("bare"):
            bare = await _bare_table(conn, bench)
            write = _bare_writer(bare)
        else:
            outbox = await new_outbox(bench, "appends")
            write = _append_writer(outbox) if mode == "append" else _many_writer(outbox)
        jobs = _jobs(rows)
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        cpu0, started = process_cpu_s(backend), time.perf_counter()
        for start in range(0, rows, per_commit):
            async with conn.transaction():
                await write(conn, jobs[start : start + per_commit])
        cpu_s, seconds = process_cpu_s(backend) - cpu0, time.perf_counter() - started
        if mode.startswith("bare"):
            await conn.execute(f"DROP TABLE {bare}")
    finally:
        await conn.close()
    if outbox is not None:
        await drop_outbox(bench, outbox)
    return cpu_s, seconds


async def run(bench: Bench) -> Result:
    rows = ROWS["quick" if bench.quick else "full"]
    totals = {mode: [0.0, 0.0] for mode in MODES}
    for mode in (*MODES, *reversed(MODES)):
        cpu_s, seconds = await _measure(bench, mode, rows)
        totals[mode][0] += cpu_s
        totals[mode][1] += seconds
    figures: dict[str, Any] = {
        mode: {
            "rows": 2 * rows,
            "server_cpu_us_per_row": round(cpu_s / (2 * rows) * 1e6, 1),
            "rows_per_s": round(2 * rows / seconds, 1),
        }
        for mode, (cpu_s, seconds) in totals.items()
    }
    us = {mode: figures[mode]["server_cpu_us_per_row"] for mode in MODES}
    headline = {
        "append_vs_bare_insert": ratio(us["append"], us["bare_insert"]),
        "enqueue_many_10_vs_bare_insert_10": ratio(us["enqueue_many_10"], us["bare_insert_10"]),
    }
    summary = [f"{'mode':<18}{'rows':>8}{'server cpu us/row':>19}{'rows/s':>9}{'vs bare':>9}"]
    for mode in MODES:
        base = "bare_insert_10" if mode.endswith("_10") else "bare_insert"
        f = figures[mode]
        summary.append(
            f"{mode:<18}{f['rows']:>8,}{f['server_cpu_us_per_row']:>19.1f}"
            f"{f['rows_per_s']:>9,.0f}{ratio(us[mode], us[base]):>8.2f}x"
        )
    return Result(
        scenario=NAME,
        params={"rows": rows, "rounds": 2, "order": [*MODES, *reversed(MODES)]},
        baseline="a bare INSERT of the same rows into a table with a primary key only, same run",
        headline=headline,
        figures=figures,
        summary=summary,
    )
