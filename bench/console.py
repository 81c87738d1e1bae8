"""console: the operator console's page times with 1,000,000 rows in the outbox.

One outbox filled by SQL with 1,000,000 rows as a busy relay leaves them: 95 % published,
4 % pending (a few in a backoff, one queue paused), 1 % dead letters of three reasons (10,000,
dead-lettered over the last three hours), then vacuumed and analyzed. A real `relayd console`
process serves it on its own pool (two connections, its default statement timeout), and one
client asks each page `rounds` times in turn, as an operator clicking through would: the
overview and its refreshed fragment, the dead letters (first page, a filter by reason, a
text search, a page far down the keyset), one dead letter, an event's timeline, the pauses,
the parked keys. The p50 and p95 of each page's wall time are reported.

The floor, measured in the same run against the same process: its stylesheet, served
through the same middleware (authentication, headers) without a statement. Each page's p95
is given as a ratio to the floor's and to the 150 ms a page is meant to answer within
(docs/console.md); the connections the console held, sampled from pg_stat_activity after
every request, are reported beside them (they must never exceed 2).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from urllib.parse import quote

import aiohttp
import asyncpg

from bench.harness import Bench, drop_outbox, fill, new_outbox
from bench.measure import BenchError, Result, machine_busy_s, percentile, ratio
from relayd.console.command import POOL_MAX
from relayd.core.rows import OutboxTable
from relayd.testing.processes import free_port

NAME = "console"
ROWS = {"full": 1_000_000, "quick": 200_000}
ROUNDS = {"full": 200, "quick": 40}
# What a page is meant to answer within, at p95 (the console's design target).
BUDGET_MS = 150.0
_READY_S = 60.0
FLOOR = "floor (stylesheet)"

# One statement per chunk of rows numbered $1..$2: the state of row n is decided by n, so
# that the counts are known: n % 100 = 0 dead (three reasons), 1-4 pending (1 in a backoff,
# 4 in the paused queue), the rest published.
_ROWS_SQL = """
INSERT INTO {outbox} (event_id, job, created_at, published_at, dead_at, dead_reason,
                      last_error, attempts, last_attempt_at, available_at)
SELECT id, job, at,
       CASE WHEN n % 100 >= 5 THEN at + interval '40 ms' END,
       CASE WHEN n % 100 = 0 THEN now() - (n % 10800) * interval '1 s' END,
       CASE WHEN n % 100 = 0 THEN (ARRAY['sink_rejected', 'max_attempts', 'conflict'])[n % 3 + 1]
       END,
       CASE WHEN n % 100 = 0 THEN
           (ARRAY['400 invalid_request: total must be positive',
                  '503 Service Unavailable: upstream timeout after 10 s',
                  '409 conflict: the id holds a different job'])[n % 3 + 1] END,
       CASE WHEN n % 100 IN (0, 1) THEN 3 WHEN n % 100 >= 5 THEN 1 ELSE 0 END,
       CASE WHEN n % 100 IN (0, 1) OR n % 100 >= 5 THEN at END,
       CASE WHEN n % 100 = 1 THEN now() + interval '1 hour' ELSE at END
FROM (
    SELECT id, n, at,
           jsonb_build_object(
               'id', id, 'type', 'bench.kind' || (n % 5),
               'args', jsonb_build_array(jsonb_build_object(
                   'order_id', n, 'sku', 'sku-' || (n % 1000), 'quantity', n % 7 + 1)),
               'options', jsonb_build_object('queue', CASE WHEN n % 100 = 4 THEN 'held'
                                                           ELSE 'q' || (n % 8) END)) AS job
    FROM (SELECT {schema}.relayd_uuidv7() AS id, n,
                 now() - (1000000 - n) * interval '10 ms' AS at
          FROM generate_series($1::int, $2::int) AS n) AS g
) AS s
"""


def _rows_sql() -> str:
    # The envelope's id is the row's own (a check of the outbox): set once the id is drawn.
    return _ROWS_SQL.replace(
        "SELECT id, job, at,", "SELECT id, job || jsonb_build_object('id', id), at,"
    )


async def _console(bench: Bench, table: str, port: int) -> asyncio.subprocess.Process:
    directory = bench.relay_dir("console")
    config = directory / "console.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYD_")} | {
        "RELAYD_CONFIG": str(config),
        "RELAYD_DATABASE__DSN": bench.dsn,
        "RELAYD_OUTBOX__TABLE": table,
        "RELAYD_CONSOLE__LISTEN": f"127.0.0.1:{port}",
    }
    log = (directory / "console.log").open("wb")
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relayd", "console", env=env, stdout=log, stderr=log
    )


async def _ready(
    http: aiohttp.ClientSession, base: str, process: asyncio.subprocess.Process
) -> None:
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise BenchError(f"relayd console exited with code {process.returncode}")
        try:
            async with http.get(base + "/static/console.css") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise BenchError(f"relayd console did not answer within {_READY_S:.0f} s")


async def _connections(conn: asyncpg.Connection) -> int:
    """The connections relayd holds on the bench's database (the console's, the only
    relayd process running now)."""
    held: int = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = 'relayd' AND datname = current_database()"
    )
    return held


async def _seed(conn: asyncpg.Connection, table: OutboxTable, rows: int) -> dict[str, str]:
    """Fill the outbox, pause a queue, vacuum; the pages to ask, by name."""
    await conn.execute("SET synchronous_commit = on")  # see backlog.py: VACUUM
    await fill(conn, table, range(1, rows + 1), rows_sql=_ROWS_SQL)
    await conn.execute(
        f"INSERT INTO {table.quoted_schema}.relayd_pauses (outbox_table, queue, reason, "
        "paused_by) VALUES ($1, 'held', 'bench: a paused queue', 'bench')",
        str(table),
    )
    await conn.execute(f"VACUUM (ANALYZE) {table.qualified}")
    dead = await conn.fetch(
        f"SELECT event_id::text AS id, dead_at FROM {table.qualified} "
        "WHERE dead_at IS NOT NULL ORDER BY dead_at DESC, event_id DESC"
    )
    published_id = await conn.fetchval(
        f"SELECT event_id::text FROM {table.qualified} WHERE published_at IS NOT NULL "
        "ORDER BY published_at DESC LIMIT 1"
    )
    middle = dead[len(dead) // 2]
    deep = quote(f"{middle['dead_at'].isoformat()}~{middle['id']}")
    return {
        FLOOR: "/static/console.css",
        "overview": "/",
        "overview fragment": "/overview/figures",
        "dead letters": "/dead-letters",
        "dead letters by reason": "/dead-letters?dead_reason=max_attempts",
        "dead letters, text": "/dead-letters?text=timeout&since=2h",
        "dead letters, deep page": f"/dead-letters?before={deep}",
        "one dead letter": f"/dead-letters/{dead[0]['id']}",
        "event timeline": f"/events/{published_id}",
        "pauses": "/pauses",
        "parked keys": "/keys",
    }


async def _measure(
    base: str, pages: dict[str, str], rounds: int, conn: asyncpg.Connection
) -> tuple[dict[str, list[float]], int, float]:
    """Each page `rounds` times in turn after one warm-up round: the wall times in ms, the
    most connections the console held, the machine's busy cores meanwhile."""
    times: dict[str, list[float]] = {name: [] for name in pages}
    most = 0
    async with aiohttp.ClientSession() as http:
        for path in pages.values():  # warm-up: statements prepared, caches filled
            await _get(http, base, path)
        busy0, wall0 = machine_busy_s(), time.perf_counter()
        for _ in range(rounds):
            for name, path in pages.items():
                began = time.perf_counter()
                await _get(http, base, path)
                times[name].append((time.perf_counter() - began) * 1000)
                most = max(most, await _connections(conn))
        busy_cores = (machine_busy_s() - busy0) / (time.perf_counter() - wall0)
    return times, most, busy_cores


async def _get(http: aiohttp.ClientSession, base: str, path: str) -> None:
    async with http.get(base + path) as response:
        await response.read()
        if response.status != 200:
            raise BenchError(f"GET {path}: {response.status}")


async def run(bench: Bench) -> Result:
    size = "quick" if bench.quick else "full"
    rows, rounds = ROWS[size], ROUNDS[size]
    table = await new_outbox(bench, NAME)
    conn = await asyncpg.connect(bench.dsn)
    process = None
    try:
        started = time.perf_counter()
        pages = await _seed(conn, table, rows)
        fill_s = time.perf_counter() - started
        dead = await conn.fetchval(
            f"SELECT count(*) FROM {table.qualified} WHERE dead_at IS NOT NULL"
        )
        port = free_port()
        process = await _console(bench, str(table), port)
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            await _ready(http, base, process)
        times, most_connections, busy_cores = await _measure(base, pages, rounds, conn)
    finally:
        if process is not None and process.returncode is None:
            process.terminate()
            await process.wait()
        await conn.close()
        await drop_outbox(bench, table)
    if most_connections > POOL_MAX:
        raise BenchError(f"the console held {most_connections} connections (its pool: 2)")
    return _result(
        times,
        {"rows": rows, "dead_letters": dead, "rounds": rounds},
        {
            "connections_max": most_connections,
            "busy_cores": round(busy_cores, 2),
            "fill_and_vacuum_s": round(fill_s, 1),
        },
    )


def _result(
    times: dict[str, list[float]], params: dict[str, int], context: dict[str, float]
) -> Result:
    floor_p95 = percentile(times[FLOOR], 95)
    figures = {
        name: {
            "p50_ms": round(percentile(values, 50), 2),
            "p95_ms": round(percentile(values, 95), 2),
            "p95_vs_floor": ratio(percentile(values, 95), floor_p95),
            "p95_vs_budget": ratio(percentile(values, 95), BUDGET_MS),
        }
        for name, values in times.items()
    }
    worst = max((name for name in figures if name != FLOOR), key=lambda n: figures[n]["p95_ms"])
    summary = [f"{'page':<26}{'p50 ms':>9}{'p95 ms':>9}{'vs floor':>10}{'vs 150 ms':>11}"]
    for name, figure in figures.items():
        summary.append(
            f"{name:<26}{figure['p50_ms']:>9.2f}{figure['p95_ms']:>9.2f}"
            f"{figure['p95_vs_floor']:>9.2f}x{figure['p95_vs_budget']:>10.2f}x"
        )
    summary.append(
        f"{params['rows']:,} rows ({params['dead_letters']:,} dead letters), "
        f"{params['rounds']} rounds; the console held at most {context['connections_max']:.0f} "
        f"connections; machine busy {context['busy_cores']:.2f} of {os.cpu_count()} cores "
        f"while measuring; fill and vacuum {context['fill_and_vacuum_s']:.0f} s"
    )
    return Result(
        scenario=NAME,
        params=params
        | {
            "pool_max": POOL_MAX,
            "budget_ms": BUDGET_MS,
            "statistic": "wall time of one GET, one client, pages in turn",
        },
        baseline="the console's stylesheet from the same process, same run (no statement)",
        headline={
            "worst_page_p95_vs_budget": figures[worst]["p95_vs_budget"],
            "worst_page_p95_vs_floor": figures[worst]["p95_vs_floor"],
        },
        figures={"pages": figures, "worst_page": worst} | context,
        summary=summary,
    )
