"""appends: what a producer's write to the outbox costs the server, against a bare INSERT.

Producers and relays share one PostgreSQL, so the server CPU a producer's INSERT costs is
CPU the claims cannot have (docs/performance.md#what-a-write-costs-the-server). Each mode
commits `rows` envelopes from one connection in this process, one transaction after another,
and the figure is the CPU of that connection's backend (read from /proc) per row:

- `bare_insert` (the baseline): one row per transaction, the same event_id and job text, in
  a table with the same two columns and a primary key only, with `enqueue_many`'s statement;
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

import time
from dataclasses import dataclass
from typing import Any

import asyncpg

from bench.harness import Bench, drop_outbox, new_outbox
from bench.measure import Result, process_cpu_s, ratio
from relayd.core.rows import OutboxTable
from relayd.producer import Outbox, append, enqueue_many, new_job

NAME = "appends"
ROWS = {"full": 40_000, "quick": 10_000}


@dataclass(frozen=True)
class Mode:
    """How one mode writes: into a migrated outbox (else a bare table), `per_commit` rows
    per transaction, with `append` (else `enqueue_many`'s one statement), compared with
    `baseline`."""

    outbox: bool
    per_commit: int
    append: bool
    baseline: str


MODES = {
    "bare_insert": Mode(outbox=False, per_commit=1, append=False, baseline="bare_insert"),
    "append": Mode(outbox=True, per_commit=1, append=True, baseline="bare_insert"),
    "bare_insert_10": Mode(outbox=False, per_commit=10, append=False, baseline="bare_insert_10"),
    "enqueue_many_10": Mode(outbox=True, per_commit=10, append=False, baseline="bare_insert_10"),
}


def _jobs(rows: int) -> list[dict[str, Any]]:
    return [new_job("bench.append", [{"order_id": n, "status": "paid"}]) for n in range(rows)]


async def _bare_table(bench: Bench) -> OutboxTable:
    """A table with the outbox's two written columns and a primary key only."""
    table = bench.table("bare")
    conn = await asyncpg.connect(bench.dsn)
    try:
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {table.quoted_schema}")
        await conn.execute(
            f"CREATE TABLE {table.qualified} (event_id uuid PRIMARY KEY, job jsonb NOT NULL)"
        )
    finally:
        await conn.close()
    return table


async def _measure(bench: Bench, mode: Mode, rows: int) -> tuple[float, float]:
    """Backend CPU seconds and wall seconds for `rows` rows written in `mode`."""
    table = await new_outbox(bench, "appends") if mode.outbox else await _bare_table(bench)
    outbox = Outbox(table=table)
    jobs = _jobs(rows)
    conn = await asyncpg.connect(bench.dsn)
    try:
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        cpu0, started = process_cpu_s(backend), time.perf_counter()
        for start in range(0, rows, mode.per_commit):
            batch = jobs[start : start + mode.per_commit]
            async with conn.transaction():
                if mode.append:
                    for job in batch:
                        await append(conn, job, outbox=outbox)
                else:
                    await enqueue_many(conn, batch, table=table)
        cpu_s, seconds = process_cpu_s(backend) - cpu0, time.perf_counter() - started
    finally:
        await conn.close()
    await drop_outbox(bench, table)
    return cpu_s, seconds


async def run(bench: Bench) -> Result:
    rows = ROWS["quick" if bench.quick else "full"]
    totals = {mode: [0.0, 0.0] for mode in MODES}
    for name in (*MODES, *reversed(MODES)):
        cpu_s, seconds = await _measure(bench, MODES[name], rows)
        totals[name][0] += cpu_s
        totals[name][1] += seconds
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
    for name, mode in MODES.items():
        f = figures[name]
        summary.append(
            f"{name:<18}{f['rows']:>8,}{f['server_cpu_us_per_row']:>19.1f}"
            f"{f['rows_per_s']:>9,.0f}{ratio(us[name], us[mode.baseline]):>8.2f}x"
        )
    return Result(
        scenario=NAME,
        params={"rows": rows, "rounds": 2, "order": [*MODES, *reversed(MODES)]},
        baseline="a bare INSERT of the same rows into a table with a primary key only, same run",
        headline=headline,
        figures=figures,
        summary=summary,
    )
