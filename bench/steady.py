"""steady: commit-to-publish latency under a steady load of producers in this process, at
two rates: what `nats` measures its lag with (`lag` itself runs open-loop producers: see
bench/lag.py).

A running relayd (every other setting at its default) on an empty outbox;
producers in this process commit 10 rows per transaction (relayd.producer.enqueue_many, as
an application would) at a steady total rate, for a fixed time. Several producer tasks,
each on its own connection and its own slot of a fixed schedule, so that one slow commit
delays only its own task; a task that falls behind commits at once until it catches up,
and how late it ran is reported.

The lag of a row is `published_at - created_at`, both stamped by PostgreSQL (no clock of
this process is involved), over the rows committed after a warm-up second. `created_at` is
the producer transaction's start, so a lag includes the producer's own insert and commit.

Each lag is also split at its commits, by the server's commit timestamps
(`track_commit_timestamp`, which the benchmark's server keeps): the scenario's table has one
extra column, the producer's transaction id (a default, so producers pay no round trip),
and a row's last writer is the settle that published it. The parts: the producer's own
transaction (`created_at` to its commit), the wait for a claim (that commit to the claim:
`last_attempt_at`), claim to publish (the claim to the settle's start: `published_at`, which
covers the claim's answer and the sink's), and the settle's own commit (its start to its
commit). relayd's share is the producer's commit to the settle's commit: the last three.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from bench.harness import (
    Bench,
    Relays,
    drain_timeout_s,
    drop_outbox,
    new_outbox,
    require_no_dead_letters,
    reset_emulator,
    sink_kept_small,
    start_relays,
    wait_drained,
)
from bench.measure import (
    machine_busy_s,
    percentile,
    pg_cpu_s,
    pids_cpu_s,
    process_cpu_s,
)
from relayd.core.rows import OutboxTable
from relayd.producer import enqueue_many, new_job

RATES = (1_000, 5_000)  # rows/s; the first is the baseline
SECONDS = {"full": 60.0, "quick": 10.0}
ROWS_PER_COMMIT = 10
PRODUCERS = 8
WARMUP_S = 1.0


def ojs_job(index: int, n: int) -> dict[str, Any]:
    """What the producers commit for the OJS emulator: a small job in one queue."""
    return new_job("bench.lag", [{"producer": index, "n": n}], queue="bench")


@dataclass(frozen=True)
class Target:
    """Where the relay publishes and what the producers commit: the relay's settings `key`
    (bench/settings.py), the RELAYD_SINK__* variables of its sink (None: the emulator), the
    envelope of row `n` of producer `index`, and the sink's process."""

    key: str
    sink: Mapping[str, str] | None = None
    make_job: Callable[[int, int], dict[str, Any]] = ojs_job
    sink_pid: int | None = None  # the sink's process, for its CPU (None: the emulator)


@dataclass(frozen=True)
class Schedule:
    """When the producers commit: `rate` rows/s in all, from `start_at` to `end_at` (loop
    time), each of PRODUCERS tasks on its own interleaved slots."""

    rate: int
    start_at: float
    end_at: float


async def _producer(
    conn: asyncpg.Connection,
    table: OutboxTable,
    index: int,
    schedule: Schedule,
    make_job: Callable[[int, int], dict[str, Any]],
) -> tuple[int, float, list[float]]:
    """One producer task: commits of ROWS_PER_COMMIT rows on its share of the schedule.
    Returns rows committed, how late the latest commit started (s), and each
    transaction's duration (s)."""
    loop = asyncio.get_running_loop()
    interval = PRODUCERS * ROWS_PER_COMMIT / schedule.rate
    due = schedule.start_at + index * ROWS_PER_COMMIT / schedule.rate  # slots interleave
    rows, latest, durations = 0, 0.0, []
    while due < schedule.end_at:
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            latest = max(latest, -delay)
        jobs = [make_job(index, rows + i) for i in range(ROWS_PER_COMMIT)]
        began = loop.time()
        async with conn.transaction():
            await enqueue_many(conn, jobs, table=table)
        durations.append(loop.time() - began)
        rows += ROWS_PER_COMMIT
        due += interval
    return rows, latest, durations


async def measure(bench: Bench, rate: int, seconds: float, target: Target) -> dict[str, Any]:
    """Produce at `rate` rows/s for `seconds` into a running relayd publishing to `target`;
    the lag figures."""
    table = await new_outbox(bench, f"{target.key.replace('.', '_')}_{rate}")
    await _stamp_producers(bench, table)
    emulator = target.sink is None
    if emulator:
        await reset_emulator(bench)
    async with (
        start_relays(bench, table, target.key, sink=target.sink) as relays,
        sink_kept_small(bench, enabled=emulator),
    ):
        producers = [await asyncpg.connect(bench.dsn) for _ in range(PRODUCERS)]
        try:
            producer_pids = [conn.get_server_pid() for conn in producers]
            sink_pid = bench.emulator_pid if target.sink_pid is None else target.sink_pid
            split = CpuSplit(bench, relays, producer_pids, sink_pid)
            before = await split.read(producers[0])
            cpu0 = relays.cpu_s()
            start_at = asyncio.get_running_loop().time()
            schedule = Schedule(rate, start_at, start_at + seconds)
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(_producer(conn, table, i, schedule, target.make_job))
                    for i, conn in enumerate(producers)
                ]
            cores = split.cores(before, await split.read(producers[0]))
        finally:
            for conn in producers:
                await conn.close()
        produced = sum(t.result()[0] for t in tasks)
        latest = max(t.result()[1] for t in tasks)
        durations = [d for t in tasks for d in t.result()[2]]
        conn = await asyncpg.connect(bench.dsn)
        try:
            tail_started = time.perf_counter()
            await wait_drained(conn, relays, drain_timeout_s(produced))
            tail_s = time.perf_counter() - tail_started
            cpu_s = relays.cpu_s() - cpu0
            await require_no_dead_letters(conn, table)
            lags = await _lags_ms(conn, table)
            slowest = await _slowest_seconds(conn, table)
            settles = await conn.fetchval(
                f"SELECT count(DISTINCT xmin::text) FROM {table.qualified}"
            )
        finally:
            await conn.close()
        warnings = relays.warnings()
    await drop_outbox(bench, table)
    return {
        "target_rows_per_s": rate,
        "achieved_rows_per_s": round(produced / seconds, 1),
        "rows_measured": len(lags.total),
        "p50_ms": round(percentile(lags.total, 50), 2),
        "p99_ms": round(percentile(lags.total, 99), 2),
        "max_ms": round(max(lags.total, default=float("nan")), 2),
        "producer_commit_p99_ms": round(percentile(lags.producer, 99), 2),
        "claim_wait_p99_ms": round(percentile(lags.wait, 99), 2),
        "claim_to_publish_p99_ms": round(percentile(lags.send, 99), 2),
        "settle_p99_ms": round(percentile(lags.settle, 99), 2),
        "relayd_p50_ms": round(percentile(lags.relayd, 50), 2),
        "relayd_p99_ms": round(percentile(lags.relayd, 99), 2),
        "producer_latest_start_ms": round(latest * 1000, 1),
        "producer_txn_p99_ms": round(percentile(durations, 99) * 1000, 2),
        "drain_after_producers_s": round(tail_s, 2),
        "relay_cpu_share": round(cpu_s / (seconds + tail_s), 3),
        "slowest_seconds": slowest,
        "rows_per_settle": round(produced / max(settles, 1), 1),
        "cpu_cores": cores,
        "relay_warnings": warnings,
    }


@dataclass(frozen=True)
class CpuReading:
    """CPU seconds so far, by whom (see CpuSplit)."""

    at: float
    machine: float
    relayd: float
    this_process: float
    sink: float
    postgres: float
    backends: dict[int, float]
    relayd_backends: frozenset[int]


@dataclass(frozen=True)
class CpuSplit:
    """Where the CPU went while the producers ran, in cores (CPU seconds per second): the
    machine's busy time, relayd's process, the PostgreSQL backends of relayd's connections
    (application_name relayd*), the producers (this process and their backends), the sink's
    process, and the rest of PostgreSQL (its background processes and backends that came and
    went). A machine near its core count is a queue for CPU, whoever is in it."""

    bench: Bench
    relays: Relays
    producer_pids: list[int]
    sink_pid: int

    async def read(self, conn: asyncpg.Connection) -> CpuReading:
        relayd_pids = [
            r["pid"]
            for r in await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'relayd%'"
            )
        ]
        return CpuReading(
            at=time.perf_counter(),
            machine=machine_busy_s(),
            relayd=self.relays.cpu_s(),
            this_process=time.process_time(),
            sink=process_cpu_s(self.sink_pid),
            postgres=pg_cpu_s(self.bench.postmaster_pid),
            backends=pids_cpu_s([*relayd_pids, *self.producer_pids]),
            relayd_backends=frozenset(relayd_pids),
        )

    def cores(self, before: CpuReading, after: CpuReading) -> dict[str, float]:
        seconds = after.at - before.at

        def used(pids: frozenset[int] | list[int]) -> float:
            # A backend that started in the window began at 0; one that ended is left out
            # (its time is in PostgreSQL's total, so in "postgres_other").
            return sum(after.backends.get(p, 0.0) - before.backends.get(p, 0.0) for p in pids)

        relayd_pg = used(after.relayd_backends)
        producers_pg = used(self.producer_pids)
        cores = {
            "machine_busy": after.machine - before.machine,
            "relayd": after.relayd - before.relayd,
            "relayd_postgres": relayd_pg,
            "producers": after.this_process - before.this_process + producers_pg,
            "sink": after.sink - before.sink,
            "postgres_other": after.postgres - before.postgres - relayd_pg - producers_pg,
        }
        return {name: round(value / seconds, 3) for name, value in cores.items()}


PRODUCER_XID = "bench_producer_xid"


async def _stamp_producers(bench: Bench, table: OutboxTable) -> None:
    """Give the (empty) table a column holding each row's producer transaction id, filled by
    its default: no round trip for the producers, and nothing relayd reads."""
    conn = await asyncpg.connect(bench.dsn)
    try:
        await conn.execute(
            f"ALTER TABLE {table.qualified} "
            f"ADD COLUMN {PRODUCER_XID} xid8 DEFAULT pg_current_xact_id()"
        )
    finally:
        await conn.close()


@dataclass(frozen=True)
class Lags:
    """Each measured row's commit-to-publish and its parts, in milliseconds (module
    docstring): `total` = `producer` + `wait` + `send` (it ends at `published_at`, the
    settle's start); `relayd` = `wait` + `send` + `settle`."""

    total: list[float]
    producer: list[float]
    wait: list[float]
    send: list[float]
    settle: list[float]
    relayd: list[float]


async def _lags_ms(conn: asyncpg.Connection, table: OutboxTable) -> Lags:
    """The lags of the rows created after the warm-up, by the database's clock."""
    rows = await conn.fetch(
        "SELECT extract(epoch FROM o.created_at) AS created,"
        f" extract(epoch FROM pg_xact_commit_timestamp(o.{PRODUCER_XID}::xid)) AS committed,"
        " extract(epoch FROM o.last_attempt_at) AS claimed,"
        " extract(epoch FROM o.published_at) AS published,"
        " extract(epoch FROM pg_xact_commit_timestamp(o.xmin)) AS settled"
        f" FROM {table.qualified} AS o, (SELECT min(created_at) + make_interval(secs => $1)"
        f" AS since FROM {table.qualified}) AS w WHERE o.created_at >= w.since",
        WARMUP_S,
    )
    lags = Lags([], [], [], [], [], [])
    for r in rows:
        created, committed, claimed = (float(r[k]) for k in ("created", "committed", "claimed"))
        published, settled = float(r["published"]), float(r["settled"])
        lags.total.append((published - created) * 1000)
        lags.producer.append((committed - created) * 1000)
        lags.wait.append((claimed - committed) * 1000)
        lags.send.append((published - claimed) * 1000)
        lags.settle.append((settled - published) * 1000)
        lags.relayd.append((settled - committed) * 1000)
    return lags


async def _slowest_seconds(conn: asyncpg.Connection, table: OutboxTable) -> list[dict[str, float]]:
    """The three seconds of the run (by created_at, from its first row) whose rows waited
    longest: a steady lag shows as many alike, a stall as one or two far above the rest."""
    rows = await conn.fetch(
        "SELECT floor(extract(epoch FROM o.created_at - w.t0))::int AS second,"
        " max(extract(epoch FROM o.published_at) - extract(epoch FROM o.created_at)) * 1000"
        " AS max_ms, count(*) AS rows"
        f" FROM {table.qualified} AS o, (SELECT min(created_at) AS t0 FROM {table.qualified})"
        " AS w GROUP BY 1 ORDER BY 2 DESC LIMIT 3"
    )
    return [
        {"second": r["second"], "max_ms": round(float(r["max_ms"]), 1), "rows": r["rows"]}
        for r in rows
    ]


def split_lines(results: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """The p99 of each part of the lag, per rate, and relayd's share (module docstring)."""
    lines = [
        f"{'rows/s':>8}{'producer p99':>14}{'claim wait':>12}{'claim->publish':>16}"
        f"{'settle':>9}{'relayd p50':>12}{'relayd p99 ms':>15}"
    ]
    for rate, f in results.items():
        lines.append(
            f"{rate:>8,}{f['producer_commit_p99_ms']:>14.1f}{f['claim_wait_p99_ms']:>12.1f}"
            f"{f['claim_to_publish_p99_ms']:>16.1f}{f['settle_p99_ms']:>9.1f}"
            f"{f['relayd_p50_ms']:>12.1f}{f['relayd_p99_ms']:>15.1f}"
        )
    return lines


def cpu_lines(results: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """Where the CPU went at each rate (CpuSplit), in cores of the machine's."""
    lines = []
    for rate, f in results.items():
        c = f["cpu_cores"]
        lines.append(
            f"{rate:,} rows/s: CPU busy {c['machine_busy']:.2f} of {os.cpu_count()} cores: "
            f"relayd {c['relayd']:.2f} + its PostgreSQL {c['relayd_postgres']:.2f}, "
            f"producers {c['producers']:.2f}, sink {c['sink']:.2f}, rest of PostgreSQL "
            f"{c['postgres_other']:.2f}; {f['rows_per_settle']:.0f} rows per settle"
        )
    return lines
