"""rowcost: what a row's claim and settle cost PostgreSQL, relayd as it is against relayd before
migration 0013 and its generic plans, in the same run.

Two versions of the same work, each on an outbox of its own:

- `before`: the outbox migrated up to 0012, the relay's session with PostgreSQL's default
  plan cache mode (`auto`), and the claims a worker sent then: the ordered claim, with the
  watermark's marks, every time;
- `after`: every migration, the relay's session exactly as `relayd run` opens it
  (`relayd.store._server_settings`), and the claims a worker sends now: the unordered claim
  while the last claim saw no keyed row pending (none here, after the first), the marks
  when `Watermark.wants_marks` asks for them.

For each, one connection (the relay's: one asyncpg pool of one, through which relayd's own
`Store.claim_from(..., ordered=True)` and `Store.settle_published` run, as a worker sends
them) claims and settles, cycle after cycle, the rows a producer connection committed just
before: `rows_per_cycle` rows (60: what a claim carries at about 5,000 rows/s) in the main
case, 1 row (a quiet outbox: a statement's fixed cost) in the second. The claim asks for
`relay.batch_size` rows (100), as a worker does, and starts at the worker's watermark. The
figures are the CPU of the relay's backend over the claims and settles, read from
/proc/<pid>/schedstat (nanoseconds), per row; as context, the CPU of the whole server over
the cycles (every process of it: the producer's backend and its inserts, autovacuum, the
WAL writer, ...) and the WAL written meanwhile (inserts, claims and settles), per row.

Then what a producer pays: one row per transaction with `relayd.producer.append`, and ten
per transaction with `enqueue_many`, into a fresh outbox of each version, the producer's
backend CPU per row (its acceptance: not slower).

The two versions alternate (before, after, after, before, ...) so that a drift of the
machine (other work starting or stopping) weighs on both; each figure is the median of its
rounds, each round on a fresh table. The machine's busy cores over the scenario are printed
beside the figures.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from bench.harness import Bench, drop_outbox
from bench.measure import BenchError, Result, machine_busy_s, median, pg_cpu_s, ratio
from relayd.core.rows import OutboxTable
from relayd.engine.watermark import Watermark
from relayd.producer import Outbox, append, enqueue_many, new_job
from relayd.store import Store, _server_settings
from relayd.store.migrations import load_migrations, migrate

NAME = "rowcost"
ROWS_PER_CYCLE = 60
CYCLES = {"full": {60: 600, 1: 3_000}, "quick": {60: 200, 1: 1_000}}
APPENDS = {"full": 5_000, "quick": 2_000}  # rows per round, each way of appending
ROUNDS = {"full": 3, "quick": 2}  # per version
CLAIM_LIMIT = 100  # relay.batch_size's default: what a worker asks for
LEASE_S = 30.0  # relay.lease_s's default
STATEMENT_TIMEOUT_S = 30.0  # database.statement_timeout_s's default
BEFORE_MIGRATIONS = 12  # the last migration of `before`


@dataclass(frozen=True)
class Version:
    """The outbox's migrations (through `through`, None: all) and the relay's session."""

    name: str
    through: int | None
    default_plan_cache: bool  # PostgreSQL's `auto`, not what relayd sets
    every_claim_ordered: bool  # the ordered claim with marks every time, as workers did

    def settings(self) -> dict[str, str]:
        settings = _server_settings(STATEMENT_TIMEOUT_S, daemon=True)
        if self.default_plan_cache:
            settings.pop("plan_cache_mode", None)
        return settings


BEFORE = Version(
    "before", through=BEFORE_MIGRATIONS, default_plan_cache=True, every_claim_ordered=True
)
AFTER = Version("after", through=None, default_plan_cache=False, every_claim_ordered=False)


def _order(rounds: int) -> list[Version]:
    """before, after, after, before, ...: each version as often first as second."""
    pairs = [(BEFORE, AFTER) if index % 2 == 0 else (AFTER, BEFORE) for index in range(rounds)]
    return [version for pair in pairs for version in pair]


def schedstat_cpu_s(pid: int) -> float:
    """CPU seconds a process has run (its main thread), from /proc/<pid>/schedstat: in
    nanoseconds, where /proc/<pid>/stat counts clock ticks (10 ms)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text(encoding="ascii").split()[0]) / 1e9


async def _outbox(bench: Bench, version: Version, name: str) -> OutboxTable:
    """A fresh outbox with the version's migrations, as `relayd migrate` applies them."""
    table = bench.table(name)
    migrations = [
        m for m in load_migrations() if version.through is None or m.version <= version.through
    ]
    store = await Store.connect(bench.dsn, table, max_size=2, statement_timeout_s=300)
    try:
        await migrate(store, migrations)
    finally:
        await store.close()
    return table


async def _keep(_conn: asyncpg.Connection) -> None:
    """No reset on release, as relayd's own pool (relayd/store/connection.py)."""


def _jobs(count: int, start: int = 0) -> list[dict[str, Any]]:
    note = "a line of text the size of a typical business payload, 64 b"
    return [
        new_job("bench.rowcost", [{"order_id": n, "status": "paid", "note": note}])
        for n in range(start, start + count)
    ]


@dataclass(frozen=True)
class Cycles:
    rows: int
    relay_cpu_s: float
    server_cpu_s: float
    wal_bytes: int
    seconds: float

    def figures(self) -> dict[str, float]:
        per = 1e6 / self.rows
        return {
            "rows": self.rows,
            "relay_backend_cpu_us_per_row": round(self.relay_cpu_s * per, 2),
            # The whole server over the cycles, the producer's inserts included.
            "server_cpu_us_per_row": round(self.server_cpu_s * per, 2),
            "wal_bytes_per_row": round(self.wal_bytes / self.rows, 1),
            "seconds": round(self.seconds, 2),
        }


async def _cycles(bench: Bench, version: Version, size: int, cycles: int) -> Cycles:
    """`cycles` times: a producer commits `size` rows, the relay claims and settles them."""
    table = await _outbox(bench, version, f"rowcost_{version.name}_{size}")
    producer = await asyncpg.connect(bench.dsn)
    pool = await asyncpg.create_pool(
        bench.dsn, min_size=1, max_size=1, server_settings=version.settings(), reset=_keep
    )
    try:
        store = Store(pool, table, bench.dsn)
        backend: int = await pool.fetchval("SELECT pg_backend_pid()")
        watermark = Watermark(full_scan_every_s=60.0)
        jobs = _jobs(size * cycles)
        relay_s = 0.0
        keyed = True  # a worker's first claim is ordered
        wal0 = await producer.fetchval("SELECT pg_current_wal_insert_lsn()")
        server0, started = pg_cpu_s(bench.postmaster_pid), time.perf_counter()
        for index in range(cycles):
            await enqueue_many(producer, jobs[index * size : (index + 1) * size], table=table)
            owner = uuid.uuid4()
            relay0 = schedstat_cpu_s(backend)
            now = time.monotonic()
            batch = await store.claim_from(
                CLAIM_LIMIT,
                owner,
                LEASE_S,
                watermark.for_claim(now),
                ordered=version.every_claim_ordered or keyed,
                marks=version.every_claim_ordered or watermark.wants_marks(now),
            )
            watermark.advance(batch)
            keyed = batch.keyed
            ids = [row.event_id for row in batch.rows]
            settled = await store.settle_published(owner, ids, ["completed"] * len(ids))
            relay_s += schedstat_cpu_s(backend) - relay0
            if len(ids) != size or len(settled) != size:
                raise BenchError(
                    f"a claim of {size} committed rows returned {len(ids)} and settled "
                    f"{len(settled)}: another relay is running?"
                )
        server_s = pg_cpu_s(bench.postmaster_pid) - server0
        wal = int(await producer.fetchval("SELECT pg_current_wal_insert_lsn() - $1::pg_lsn", wal0))
        seconds = time.perf_counter() - started
    finally:
        await pool.close()
        await producer.close()
    await drop_outbox(bench, table)
    return Cycles(size * cycles, relay_s, server_s, wal, seconds)


async def _appends(bench: Bench, version: Version, rows: int) -> tuple[float, float]:
    """The producer's backend CPU per row (µs): one row per transaction with `append`, then
    ten per transaction with `enqueue_many`, into a fresh outbox of `version`."""
    table = await _outbox(bench, version, f"rowcost_appends_{version.name}")
    outbox = Outbox(table=table)
    single, tens = _jobs(rows), _jobs(rows, start=rows)
    conn = await asyncpg.connect(bench.dsn)
    try:
        backend: int = await conn.fetchval("SELECT pg_backend_pid()")
        cpu0 = schedstat_cpu_s(backend)
        for job in single:
            async with conn.transaction():
                await append(conn, job, outbox=outbox)
        cpu1 = schedstat_cpu_s(backend)
        for start in range(0, rows, 10):
            async with conn.transaction():
                await enqueue_many(conn, tens[start : start + 10], table=table)
        cpu2 = schedstat_cpu_s(backend)
    finally:
        await conn.close()
    await drop_outbox(bench, table)
    return (cpu1 - cpu0) / rows * 1e6, (cpu2 - cpu1) / rows * 1e6


def _medians(runs: Iterable[dict[str, float]]) -> dict[str, Any]:
    listed = list(runs)
    keys = [key for key in listed[0] if key not in {"rows", "seconds"}]
    merged: dict[str, Any] = {key: round(median([run[key] for run in listed]), 2) for key in keys}
    merged["runs"] = listed
    return merged


async def run(bench: Bench) -> Result:
    size_key = "quick" if bench.quick else "full"
    cycles, appends_rows, rounds = CYCLES[size_key], APPENDS[size_key], ROUNDS[size_key]
    order = _order(rounds)
    runs: dict[str, dict[str, list[Any]]] = {
        version.name: {"cycle_60": [], "cycle_1": [], "append_1": [], "commit_10": []}
        for version in (BEFORE, AFTER)
    }
    busy0, wall0 = machine_busy_s(), time.perf_counter()
    for version in order:
        mine = runs[version.name]
        for size, key in ((ROWS_PER_CYCLE, "cycle_60"), (1, "cycle_1")):
            mine[key].append((await _cycles(bench, version, size, cycles[size])).figures())
        single_us, ten_us = await _appends(bench, version, appends_rows)
        mine["append_1"].append(round(single_us, 2))
        mine["commit_10"].append(round(ten_us, 2))
    busy_cores = (machine_busy_s() - busy0) / (time.perf_counter() - wall0)

    figures: dict[str, Any] = {}
    for name, mine in runs.items():
        figures[name] = {
            "cycle_60": _medians(mine["cycle_60"]),
            "cycle_1": _medians(mine["cycle_1"]),
            "append_1_cpu_us_per_row": median(mine["append_1"]),
            "commit_10_cpu_us_per_row": median(mine["commit_10"]),
            "append_1_runs": mine["append_1"],
            "commit_10_runs": mine["commit_10"],
        }
    figures["machine_busy_cores"] = round(busy_cores, 2)
    before, after = figures["before"], figures["after"]
    key = "relay_backend_cpu_us_per_row"
    headline = {
        "cpu_us_per_row_60": after["cycle_60"][key],
        "after_vs_before_60": ratio(after["cycle_60"][key], before["cycle_60"][key]),
        "after_vs_before_1": ratio(after["cycle_1"][key], before["cycle_1"][key]),
        "wal_after_vs_before_60": ratio(
            after["cycle_60"]["wal_bytes_per_row"], before["cycle_60"]["wal_bytes_per_row"]
        ),
        "append_after_vs_before": ratio(
            after["append_1_cpu_us_per_row"], before["append_1_cpu_us_per_row"]
        ),
    }
    summary = [
        f"machine: {busy_cores:.2f} of {os.cpu_count()} cores busy on average (this run and "
        "everything else the machine ran meanwhile)",
        f"{'':28}{'before':>10}{'after':>10}{'after/before':>14}",
    ]
    lines = [
        ("claim+settle, 60 rows: us/row", "cycle_60", key),
        ("  whole server: us/row", "cycle_60", "server_cpu_us_per_row"),
        ("  WAL: bytes/row", "cycle_60", "wal_bytes_per_row"),
        ("claim+settle, 1 row: us/row", "cycle_1", key),
        ("  whole server: us/row", "cycle_1", "server_cpu_us_per_row"),
        ("  WAL: bytes/row", "cycle_1", "wal_bytes_per_row"),
    ]
    for label, case, figure in lines:
        was, now = before[case][figure], after[case][figure]
        summary.append(f"{label:<28}{was:>10.1f}{now:>10.1f}{ratio(now, was):>13.2f}x")
    for label, figure in (
        ("append, 1 row/commit: us/row", "append_1_cpu_us_per_row"),
        ("enqueue, 10 rows/commit", "commit_10_cpu_us_per_row"),
    ):
        was, now = before[figure], after[figure]
        summary.append(f"{label:<28}{was:>10.1f}{now:>10.1f}{ratio(now, was):>13.2f}x")
    return Result(
        scenario=NAME,
        params={
            "rows_per_cycle": [ROWS_PER_CYCLE, 1],
            "cycles": cycles,
            "claim_limit": CLAIM_LIMIT,
            "append_rows": appends_rows,
            "rounds": rounds,
            "order": [version.name for version in order],
            "before": f"migrations through {BEFORE_MIGRATIONS:04d}, plan_cache_mode auto",
        },
        baseline=(
            f"the same cycles on an outbox migrated through {BEFORE_MIGRATIONS:04d} with "
            "PostgreSQL's default plan cache mode, alternating, same run"
        ),
        headline=headline,
        figures=figures,
        summary=summary,
    )
