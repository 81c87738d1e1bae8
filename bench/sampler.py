"""`python -m bench sampler`: the backlog sampler's statement as the backlog grows.

One embedded PostgreSQL, one outbox filled in steps with `INSERT ... SELECT ...
generate_series` (ids from relayd_uuidv7()): at 10,000, 1,000,000 and 5,000,000 pending
rows by default (`--rows` is the last step), 90% of them due and 10% in a one-hour backoff,
in eight queues, plus 1% as many dead letters. After each step the table is vacuumed and
analyzed, as autovacuum would, and 1,000 due rows are leased; then the sampler's statement
(and, for comparison, the whole `relayd status` read, and the sampler while one queue is
paused) runs several times and the median is printed with its ratio to the first step's.
Figures vary with the machine; the ratios are the result. Never pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from relayd.core.backlog import BACKLOG_BOUND
from relayd.core.rows import OutboxTable
from relayd.daemon.sampler import sample_backlog
from relayd.operator.status import build_report
from relayd.store import Store
from relayd.store.migrations import connect_and_migrate
from relayd.testing.postgres import EmbeddedPostgres

STEPS = (10_000, 1_000_000, 5_000_000)
# Rows per INSERT statement: one transaction each, so a step's progress shows.
CHUNK = 500_000
# relay.lease_s, and the rows in flight at each step (a few relays' claims).
LEASE_S = 30.0
LEASED = 1_000

FILL = """
INSERT INTO {outbox} (event_id, job, available_at, dead_at, dead_reason)
SELECT id,
       jsonb_build_object('id', id, 'type', 'bench.kind' || (n % 5), 'args', jsonb_build_array(n),
                          'options', jsonb_build_object('queue', 'q' || (n % 8))),
       CASE WHEN n % 10 = 0 THEN now() + interval '1 hour' ELSE now() END,
       CASE WHEN $3 THEN now() END,
       CASE WHEN $3 THEN 'max_attempts' END
FROM (SELECT {schema}.relayd_uuidv7() AS id, n FROM generate_series($1::int, $2::int) AS n) AS s
"""


async def _fill(conn: asyncpg.Connection, table: OutboxTable, first: int, last: int) -> None:
    """Rows first..last (1-based, inclusive) pending, and 1% as many dead letters."""
    sql = FILL.format(outbox=table.qualified, schema=table.quoted_schema)
    for start in range(first, last + 1, CHUNK):
        await conn.execute(sql, start, min(start + CHUNK - 1, last), False)
    dead_first, dead_last = first // 100 + 1, last // 100
    if dead_last >= dead_first:
        await conn.execute(sql, -dead_last, -dead_first, True)
    await conn.execute(f"VACUUM (ANALYZE) {table.qualified}")


async def _median_s(run: Callable[[], Awaitable[object]], runs: int) -> float:
    await run()  # warm the cache and the prepared statement
    durations = []
    for _ in range(runs):
        started = time.perf_counter()
        await run()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


async def _measure(
    conn: asyncpg.Connection, store: Store, table: OutboxTable, runs: int
) -> tuple[float, float, float]:
    """The sampler, the whole status read, and the sampler while one queue of eight is
    paused (its due rows are then told apart by reading their queue), in seconds."""
    # Rows in flight, as a few relays hold them: their leases end within relay.lease_s.
    # The previous step's leases are handed back first.
    await conn.execute(
        f"UPDATE {table.qualified} SET lease_owner = NULL, available_at = now() "
        "WHERE lease_owner IS NOT NULL AND published_at IS NULL AND dead_at IS NULL"
    )
    await conn.execute(
        f"UPDATE {table.qualified} SET lease_owner = gen_random_uuid(), "
        "available_at = now() + make_interval(secs => $1) WHERE event_id IN ("
        f"SELECT event_id FROM {table.qualified} WHERE published_at IS NULL "
        "AND dead_at IS NULL AND available_at <= now() ORDER BY available_at, event_id "
        "LIMIT $2)",
        LEASE_S,
        LEASED,
    )
    sample = await _median_s(lambda: sample_backlog(store, lease_s=LEASE_S), runs)
    report = await _median_s(
        lambda: build_report(store, sample_interval_s=5.0, lease_s=LEASE_S), runs
    )
    backlog = await sample_backlog(store, lease_s=LEASE_S)
    print(f"  sampled: {backlog.by_state()} estimated={sorted(backlog.estimated)}")
    pause = f"{table.quoted_schema}.relayd_pauses"
    await conn.execute(
        f"INSERT INTO {pause} (outbox_table, queue, reason, paused_by) "
        "VALUES ($1, 'q3', 'bench', 'bench')",
        str(table),
    )
    paused = await _median_s(lambda: sample_backlog(store, lease_s=LEASE_S), runs)
    await conn.execute(f"DELETE FROM {pause}")
    return sample, report, paused


async def _bench(steps: list[int], runs: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="relayd-bench-sampler-"))
    table = OutboxTable.parse("bench.sampler")
    try:
        with EmbeddedPostgres(base / "pg") as pg:
            dsn = pg.dsn()
            await connect_and_migrate(dsn, table)
            conn = await asyncpg.connect(dsn)
            # The embedded server commits asynchronously (synchronous_commit = off), and
            # VACUUM cannot mark a page all-visible until the commit of its rows is flushed:
            # right after a fill, every index-only scan would then visit the table. A real
            # outbox is vacuumed long after its rows were committed.
            await conn.execute("SET synchronous_commit = on")
            store = await Store.connect(dsn, table, max_size=2, statement_timeout_s=600)
            try:
                results: list[tuple[int, tuple[float, float, float]]] = []
                filled = 0
                for rows in steps:
                    started = time.perf_counter()
                    await _fill(conn, table, filled + 1, rows)
                    filled = rows
                    print(f"filled {rows:,} pending rows in {time.perf_counter() - started:.0f} s")
                    results.append((rows, await _measure(conn, store, table, runs)))
            finally:
                await store.close()
                await conn.close()
        _report(results, runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _report(results: list[tuple[int, tuple[float, float, float]]], runs: int) -> None:
    print(
        f"\nmedian of {runs} runs; each scan bounded at {BACKLOG_BOUND:,} rows; "
        f"{LEASED:,} rows leased"
    )
    print("sampler: its statement; status: the whole report; paused: the sampler, q3 paused")
    columns = ("sampler", "status", "paused")
    print(f"{'pending rows':>14}" + "".join(f"{c + ' ms':>12}{'vs first':>10}" for c in columns))
    first = results[0][1]
    for rows, figures in results:
        cells = "".join(
            f"{seconds * 1000:>12.1f}{seconds / base:>9.1f}x"
            for seconds, base in zip(figures, first, strict=True)
        )
        print(f"{rows:>14,}{cells}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench sampler", description=__doc__)
    parser.add_argument(
        "--rows", type=int, default=STEPS[-1], help="pending rows at the last step (5,000,000)"
    )
    parser.add_argument("--runs", type=int, default=7, help="timed runs per step (7)")
    args = parser.parse_args(argv)
    steps = [step for step in STEPS if step < args.rows] + [args.rows]
    asyncio.run(_bench(steps, args.runs))
