"""lag: latency from a producer's commit to the sink's receipt, under an open-loop load at
fractions of the saturation rate found in the same run.

A running relayd (batch mode, every other setting at its default) on an empty outbox;
pgbench commits one-row inserts on a Poisson schedule (bench/pgbench.py), so a slow row
never slows the load down (a closed loop would wait for it, and hide its own queue).

1. `R_sat`, the saturation rate: the highest rate that holds for a trial window, meaning
   pgbench achieved its rate (`void_reasons`), the oldest claimable row never got older than
   AGE_LIMIT_S past the window's first second, and the outbox drained within DRAIN_LIMIT_S
   of the load's end. Rates double from START_ROWS_PER_S to the first that fails (or halve
   to the first that holds); then three bisections (geometric) of that bracket, the median
   of their results.
2. The points: 0.1, 0.5 and 0.75 x `R_sat` with one-row transactions, and 0.5 x with
   ten-row transactions (the variant), each in every round, their order turning round by
   round, so that a change in the machine's load meets every point. A point's windows are
   long enough for SAMPLES rows in all; their rows (after a warm-up) make one histogram.

Latency per row, its stages and their clocks: bench/latency.py. A point is void, and says
so, when pgbench achieved under 98 % of its rate or its schedule lag p99 exceeded 5 ms in
any window, or a row never reached the sink. `R@25ms`: the highest one-row point whose p99
is at most 25 ms.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from bench.bare_relay import BareRelay, bare_relay
from bench.harness import (
    Bench,
    Relays,
    any_pending,
    drain_timeout_s,
    drop_outbox,
    new_outbox,
    start_relays,
    wait_drained,
)
from bench.latency import (
    STAGES,
    Receipts,
    Samples,
    add_bench_columns,
    collecting_receipts,
    relay_figures,
    relay_metrics,
    window_samples,
)
from bench.measure import (
    BenchError,
    Result,
    machine_busy_s,
    median,
    percentile,
    pg_cpu_s,
    process_cpu_s,
    ratio,
    warnings_line,
)
from bench.pgbench import Load, Producers, find_pgbench, pgbench_cpu_s, void_reasons

NAME = "lag"
FRACTIONS = (0.1, 0.5, 0.75)  # of R_sat, one-row transactions
VARIANT = (0.5, 10)  # the variant: at 0.5 x R_sat, ten rows per transaction
SIZES: dict[str, dict[str, float]] = {
    # trial_s: a saturation trial's window; steps: of each bisection; rounds: of the points;
    # samples: rows per point over its rounds; min_window_s: a point's shortest window.
    "full": {"trial_s": 10, "steps": 4, "rounds": 3, "samples": 50_000, "min_window_s": 10},
    "quick": {"trial_s": 3, "steps": 2, "rounds": 2, "samples": 3_000, "min_window_s": 3},
}
START_ROWS_PER_S = 500
MIN_ROWS_PER_S = 50
BISECTIONS = 3
AGE_LIMIT_S = 0.5
DRAIN_LIMIT_S = 1.0
AGE_POLL_S = 0.25
WARMUP_S = 0.5  # of each window: pgbench's connections, relayd's first claims
ACHIEVED_FLOOR = 0.98
SCHEDULE_LAG_LIMIT_MS = 5.0
P99_LIMIT_MS = 25.0
SAMPLE_MARGIN = 1.05


@dataclass
class Run:
    """One server's measurement: the relay, the producers, the receipts, a window counter."""

    bench: Bench
    relays: Relays | BareRelay
    producers: Producers
    receipts: Receipts
    conn: asyncpg.Connection
    windows: int = 0
    trials: list[dict[str, Any]] = field(default_factory=list)

    def next_window(self) -> int:
        self.windows += 1
        return self.windows

    async def settle_down(self, rows: int) -> None:
        """Wait until nothing is pending (`rows` were produced), then forget the receipts
        so far."""
        await wait_drained(self.conn, self.relays, drain_timeout_s(rows))
        await self.receipts.take()
        self.receipts.clear()


# --- R_sat -------------------------------------------------------------------------------


async def _claimable_age_s(conn: asyncpg.Connection, run: Run) -> float:
    age: float = await conn.fetchval(
        "SELECT coalesce(extract(epoch FROM now() - min(available_at)), 0)::float8"
        f" FROM {run.relays.table.qualified}"
        " WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()"
    )
    return age


async def _drained_within(run: Run, limit_s: float) -> float | None:
    """Seconds until nothing is pending, or None if more than `limit_s`."""
    started = time.perf_counter()
    while await any_pending(run.conn, run.relays.table):
        if time.perf_counter() - started > limit_s:
            return None
        await asyncio.sleep(0.02)
    return time.perf_counter() - started


async def trial(run: Run, rows_per_s: float, seconds: int) -> bool:
    """Whether relayd keeps up with `rows_per_s` (module docstring, step 1)."""
    watcher = await asyncpg.connect(run.bench.dsn)
    ages: list[tuple[float, float]] = []

    async def watch() -> None:
        started = time.perf_counter()
        while True:
            ages.append((time.perf_counter() - started, await _claimable_age_s(watcher, run)))
            await asyncio.sleep(AGE_POLL_S)

    try:
        task = asyncio.create_task(watch())
        try:
            load = await run.producers.produce(rows_per_s, seconds, run.next_window(), 1, WARMUP_S)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await watcher.close()
    drained_s = await _drained_within(run, DRAIN_LIMIT_S)
    oldest = max((age for at, age in ages if at >= 1.0), default=math.nan)
    # The schedule lag voids a latency point, not a trial: a late start here is the machine's
    # delay in running pgbench, which the achieved rate and the backlog answer for.
    reasons = void_reasons(load, lag_limit_ms=math.inf, achieved_fraction=ACHIEVED_FLOOR)
    if not oldest <= AGE_LIMIT_S:
        reasons.append(f"claimable age reached {oldest:.2f} s")
    if drained_s is None:
        reasons.append(f"not drained {DRAIN_LIMIT_S:g} s after the load")
    run.trials.append(
        {
            "rows_per_s": round(rows_per_s),
            "held": not reasons,
            "achieved_rows_per_s": round(load.achieved_rows_per_s, 1),
            "schedule_lag_p99_ms": round(load.schedule_lag_p99_ms, 2),
            "oldest_claimable_s": round(oldest, 3),
            "drained_s": None if drained_s is None else round(drained_s, 2),
            "why_not": reasons,
        }
    )
    await run.settle_down(load.rows)
    return not reasons


async def _bracket(run: Run, trial_s: int) -> tuple[float, float]:
    """A rate that holds and its double, which does not: doubling from START_ROWS_PER_S, or
    halving from it if it fails (a slow disk, a busy machine), down to MIN_ROWS_PER_S."""
    rate = float(START_ROWS_PER_S)
    if await trial(run, rate, trial_s):
        while await trial(run, rate * 2, trial_s):
            rate *= 2
            if rate > 1_000_000:
                raise BenchError("relayd kept up with 1,000,000 rows/s: the trials are broken")
        return rate, rate * 2
    while rate / 2 >= MIN_ROWS_PER_S:
        rate /= 2
        if await trial(run, rate, trial_s):
            return rate, rate * 2
    why = "; ".join(run.trials[-1]["why_not"])
    raise BenchError(f"relayd did not keep up with {rate:,.0f} rows/s: {why}")


async def saturation(run: Run, trial_s: int, steps: int) -> tuple[float, list[float]]:
    """R_sat (module docstring, step 1) and the result of each bisection."""
    low, high = await _bracket(run, trial_s)
    found = []
    for _ in range(BISECTIONS):
        ok, bad = low, high
        for _ in range(steps):
            middle = math.sqrt(ok * bad)
            if await trial(run, middle, trial_s):
                ok = middle
            else:
                bad = middle
        found.append(ok)
    return median(found), found


# --- the points --------------------------------------------------------------------------


@dataclass
class Window:
    """One window of one point: pgbench's load, the rows' samples, the CPU seconds of the
    machine, relayd, the emulator, PostgreSQL and pgbench while the load ran, and relayd's
    mean claim statement and request and its rows per claim (its /metrics)."""

    load: Load
    samples: Samples
    seconds: float
    cpu_s: dict[str, float]
    relay: dict[str, float]  # from relayd's /metrics (latency.relay_figures)


def _cpu_reading(run: Run) -> dict[str, float]:
    return {
        "at": time.perf_counter(),
        "machine_busy": machine_busy_s(),
        "relayd": run.relays.cpu_s(),
        "sink": process_cpu_s(run.bench.emulator_pid),
        "postgres": pg_cpu_s(run.bench.postmaster_pid),
        "pgbench": pgbench_cpu_s(),
    }


async def window(run: Run, rows_per_s: float, seconds: int, rows_per_commit: int) -> Window:
    """Produce at `rows_per_s` for `seconds`, let the outbox drain, read the rows' samples."""
    number = run.next_window()
    ports = [relay.metrics_port for relay in run.relays.members]
    metrics = await relay_metrics(run.receipts.http, ports)
    before = _cpu_reading(run)
    load = await run.producers.produce(rows_per_s, seconds, number, rows_per_commit, WARMUP_S)
    after = _cpu_reading(run)
    relay = relay_figures(metrics, await relay_metrics(run.receipts.http, ports))
    await wait_drained(run.conn, run.relays, drain_timeout_s(load.rows))
    await run.receipts.take()
    samples = await window_samples(
        run.conn, run.relays.table, number, WARMUP_S, run.receipts.received
    )
    run.receipts.clear()
    cpu = {k: after[k] - before[k] for k in before if k != "at"}
    return Window(load, samples, after["at"] - before["at"], cpu, relay)


@dataclass(frozen=True)
class Point:
    """A rate (a fraction of R_sat) and its rows per transaction."""

    fraction: float
    rows_per_commit: int

    @property
    def key(self) -> str:
        suffix = "" if self.rows_per_commit == 1 else f"_x{self.rows_per_commit}"
        return f"at_{self.fraction:g}{suffix}".replace(".", "_")


def point_figures(point: Point, rows_per_s: float, windows: list[Window]) -> dict[str, Any]:
    """The point's figures over its windows (one histogram), and why it is void, if it is."""
    samples = Samples.pooled([w.samples for w in windows])
    rows = sum(w.load.rows for w in windows)
    seconds = sum(w.seconds for w in windows)
    lags = [x for w in windows for x in w.load.schedule_lags_ms]
    cpu = {k: sum(w.cpu_s[k] for w in windows) for k in windows[0].cpu_s}
    void = sorted(
        {
            reason
            for w in windows
            for reason in void_reasons(
                w.load, lag_limit_ms=SCHEDULE_LAG_LIMIT_MS, achieved_fraction=ACHIEVED_FLOOR
            )
        }
    )
    if samples.unreceived:
        void.append(f"{samples.unreceived:,} rows never reached the sink")
    return {
        "fraction_of_r_sat": point.fraction,
        "rows_per_commit": point.rows_per_commit,
        "target_rows_per_s": round(rows_per_s, 1),
        # Over the steady parts, as the void check reads it.
        "achieved_rows_per_s": round(
            sum(w.load.achieved_rows_per_s * w.load.steady_s for w in windows)
            / sum(w.load.steady_s for w in windows),
            1,
        ),
        "schedule_lag_p99_ms": round(percentile(lags, 99), 2),
        "pgbench_priority": sorted({w.load.priority for w in windows}),
        "windows": len(windows),
        "window_s": round(windows[0].load.seconds),
        **samples.figures(),
        "p99_ms_by_round": [round(percentile(w.samples.latency_ms, 99), 2) for w in windows],
        **{
            f"relayd_{name}": round(median([w.relay[name] for w in windows]), 2)
            for name in windows[0].relay
        },
        "relay_cpu_us_per_row": round(cpu["relayd"] / rows * 1e6, 1) if rows else math.nan,
        "cores": {k: round(v / seconds, 3) for k, v in cpu.items()},
        "void": void,
    }


def _window_s(rows_per_s: float, size: dict[str, float]) -> int:
    """A window long enough for its share of the point's samples after the warm-up, with a
    margin: a Poisson schedule draws a few per cent fewer at times, and a window a few
    rows short of the target would say the point has too few."""
    per_round = SAMPLE_MARGIN * size["samples"] / size["rounds"] / rows_per_s
    return math.ceil(max(size["min_window_s"], per_round + WARMUP_S))


def _add_warnings(total: dict[str, int], more: dict[str, int]) -> None:
    for name, count in more.items():
        total[name] = total.get(name, 0) + count


async def measure(bench: Bench) -> dict[str, Any]:
    """Both steps on one outbox: R_sat with relayd, then rounds of the points, each round
    relayd's points (a relayd started for the round) and then the bare relay's (the
    ceiling, bench/bare_relay.py); every figure."""
    size = SIZES["quick" if bench.quick else "full"]
    pgbench = find_pgbench()
    table = await new_outbox(bench, NAME)
    conn = await asyncpg.connect(bench.dsn)
    warnings: dict[str, int] = {}
    try:
        await add_bench_columns(conn, table)
        async with collecting_receipts(bench) as receipts:
            producers = Producers(pgbench, bench.dsn, bench.base / "pgbench", table)
            async with start_relays(bench, table, NAME) as relays:
                run = Run(bench, relays, producers, receipts, conn)
                r_sat, bisections = await saturation(run, int(size["trial_s"]), int(size["steps"]))
                _add_warnings(warnings, relays.warnings())
            points = [Point(f, 1) for f in FRACTIONS] + [Point(*VARIANT)]
            windows: dict[Point, list[Window]] = {p: [] for p in points}
            bare = [Point(f, 1) for f in FRACTIONS]
            ceiling: dict[Point, list[Window]] = {p: [] for p in bare}
            for round_ in range(int(size["rounds"])):
                async with start_relays(bench, table, NAME) as relays:
                    run.relays = relays
                    for point in _turned(points, round_):
                        rate = point.fraction * r_sat
                        seconds = _window_s(rate, size)
                        windows[point].append(
                            await window(run, rate, seconds, point.rows_per_commit)
                        )
                    _add_warnings(warnings, relays.warnings())
                log = bench.base / f"bare-relay-{round_}.log"
                async with bare_relay(bench.dsn, table, bench.sink_url, log) as ceiling_relay:
                    run.relays = ceiling_relay
                    for point in _turned(bare, round_):
                        rate = point.fraction * r_sat
                        ceiling[point].append(await window(run, rate, _window_s(rate, size), 1))
    finally:
        await conn.close()
    await drop_outbox(bench, table)
    figures = {p.key: point_figures(p, p.fraction * r_sat, windows[p]) for p in points}
    one_row = [figures[Point(f, 1).key] for f in FRACTIONS]
    within = [
        f["target_rows_per_s"] for f in one_row if not f["void"] and f["p99_ms"] <= P99_LIMIT_MS
    ]
    return {
        "r_sat_rows_per_s": round(r_sat, 1),
        "r_sat_bisections": [round(x, 1) for x in bisections],
        "r_at_25ms_rows_per_s": max(within, default=0.0),
        "trials": run.trials,
        **figures,
        "bare_relay": {
            p.key: {
                k: v
                for k, v in point_figures(p, p.fraction * r_sat, ceiling[p]).items()
                if not k.startswith("relayd_")  # it has no /metrics
            }
            for p in bare
        },
        "relay_warnings": warnings,
    }


def _turned(points: list[Point], round_: int) -> list[Point]:
    """The points in the round's order: turned by one each round."""
    return points[round_ % len(points) :] + points[: round_ % len(points)]


# --- the report --------------------------------------------------------------------------


def targets(figures: dict[str, Any], durable: bool) -> list[tuple[str, float, str, bool]]:
    """The acceptance targets beside the figures: (what, figure, target, met)."""
    low, mid = figures[Point(0.1, 1).key], figures[Point(0.5, 1).key]
    r_sat = figures["r_sat_rows_per_s"]
    if durable:
        limit = 3 * low["p99_ms"]
        return [
            (
                "p99 at 0.5x",
                mid["p99_ms"],
                f"<= 3 x p99 at 0.1x = {limit:.1f}",
                mid["p99_ms"] <= limit,
            )
        ]
    r25 = figures["r_at_25ms_rows_per_s"]
    return [
        ("p99 at 0.1x", low["p99_ms"], "<= 4 ms", low["p99_ms"] <= 4),
        ("p99 at 0.5x", mid["p99_ms"], "<= 8 ms", mid["p99_ms"] <= 8),
        ("p99.9 at 0.5x", mid["p999_ms"], "<= 25 ms", mid["p999_ms"] <= 25),
        ("R@25ms", r25, f">= 0.75 x R_sat = {0.75 * r_sat:,.0f}", r25 >= 0.75 * r_sat - 0.5),
    ]


def summary_lines(figures: dict[str, Any], durable: bool) -> list[str]:
    points = [Point(f, 1) for f in FRACTIONS] + [Point(*VARIANT)]
    r_sat = figures["r_sat_rows_per_s"]
    bisections = ", ".join(f"{x:,.0f}" for x in figures["r_sat_bisections"])
    lines = [
        f"R_sat {r_sat:,.0f} rows/s (median of bisections {bisections}; "
        f"{len(figures['trials'])} trials); R@25ms {figures['r_at_25ms_rows_per_s']:,.0f} rows/s",
        f"{'point':>10}{'rows/s':>8}{'achieved':>9}{'sched p99':>10}{'samples':>9}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'p99.9 ms':>9}{'max ms':>8}  p99 by round",
    ]
    for p in points:
        f = figures[p.key]
        name = f"{p.fraction:g}x" + ("" if p.rows_per_commit == 1 else f" ({p.rows_per_commit}/tx)")
        by_round = " ".join(f"{x:.1f}" for x in f["p99_ms_by_round"])
        lines.append(
            f"{name:>10}{f['target_rows_per_s']:>8,.0f}{f['achieved_rows_per_s']:>9,.0f}"
            f"{f['schedule_lag_p99_ms']:>10.2f}{f['samples']:>9,}{f['p50_ms']:>8.1f}"
            f"{f['p99_ms']:>8.1f}{f['p999_ms']:>9.1f}{f['max_ms']:>8.1f}  {by_round}"
        )
    lines.append("stages p50/p99 ms: " + ", ".join(s.replace("_", " ") for s in STAGES))
    for p in points:
        f = figures[p.key]
        parts = "  ".join(f"{f[s + '_p50_ms']:.1f}/{f[s + '_p99_ms']:.1f}" for s in STAGES)
        relayd = (
            f"; relayd's means: claim statement {f['relayd_claim_statement_mean_ms']:.1f}, "
            f"request {f['relayd_request_mean_ms']:.1f}; "
            f"{f['relayd_rows_per_claim']:.1f} rows per claim"
        )
        lines.append(f"  {p.key}: {parts}{relayd}")
    for p in points:
        f, c = figures[p.key], figures[p.key]["cores"]
        lines.append(
            f"{p.key}: busy {c['machine_busy']:.2f} of {os.cpu_count()} cores: relayd "
            f"{c['relayd']:.2f} ({f['relay_cpu_us_per_row']:.0f} us/row), PostgreSQL "
            f"{c['postgres']:.2f}, emulator {c['sink']:.2f}, pgbench {c['pgbench']:.2f}"
        )
        if f["void"]:
            lines.append(f"{p.key}: VOID: {'; '.join(f['void'])}")
    lines += ceiling_lines(figures)
    server = "durable" if durable else "scratch"
    for what, value, target, met in targets(figures, durable):
        lines.append(
            f"target ({server}): {what} {value:,.1f}, target {target}: {'met' if met else 'MISSED'}"
        )
    lines += warnings_line(figures["relay_warnings"])
    return lines


def ceiling_lines(figures: dict[str, Any]) -> list[str]:
    """The bare relay's points beside relayd's: the ceiling of latency on this machine."""
    lines = [
        "the bare relay (bench/bare_relay.py: the same parts, nothing of relayd), same rates:",
    ]
    for key, bare in figures["bare_relay"].items():
        mine = figures[key]
        stages = "  ".join(f"{bare[s + '_p50_ms']:.1f}/{bare[s + '_p99_ms']:.1f}" for s in STAGES)
        void = f"; VOID: {'; '.join(bare['void'])}" if bare["void"] else ""
        lines.append(
            f"  {key}: p50 {bare['p50_ms']:.1f}, p99 {bare['p99_ms']:.1f}, "
            f"p99.9 {bare['p999_ms']:.1f} ms ({bare['samples']:,} samples); relayd's p99 "
            f"{ratio(mine['p99_ms'], bare['p99_ms']):.2f}x, p99.9 "
            f"{ratio(mine['p999_ms'], bare['p999_ms']):.2f}x; stages {stages}; "
            f"{bare['relay_cpu_us_per_row']:.0f} us/row, busy "
            f"{bare['cores']['machine_busy']:.2f} cores{void}"
        )
    return lines


async def run(bench: Bench) -> Result:
    figures = await measure(bench)
    size = SIZES["quick" if bench.quick else "full"]
    low, mid, high = (figures[Point(f, 1).key] for f in FRACTIONS)
    r_sat = figures["r_sat_rows_per_s"]
    return Result(
        scenario=NAME,
        params={
            **size,
            "fractions": list(FRACTIONS),
            "variant": list(VARIANT),
            "bisections": BISECTIONS,
            "start_rows_per_s": START_ROWS_PER_S,
            "age_limit_s": AGE_LIMIT_S,
            "drain_limit_s": DRAIN_LIMIT_S,
            "warmup_s": WARMUP_S,
        },
        baseline="R_sat, the saturation rate found in the same run",
        headline={
            "r_sat_rows_per_s": r_sat,
            "p99_ms_at_0_1": low["p99_ms"],
            "p99_ms_at_0_5": mid["p99_ms"],
            "p999_ms_at_0_5": mid["p999_ms"],
            "p99_ms_at_0_75": high["p99_ms"],
            "p99_0_5_vs_0_1": ratio(mid["p99_ms"], low["p99_ms"]),
            "r_at_25ms_vs_r_sat": ratio(figures["r_at_25ms_rows_per_s"], r_sat),
            **{
                f"p99_vs_bare_relay_{key.removeprefix('at_')}": ratio(
                    figures[key]["p99_ms"], bare["p99_ms"]
                )
                for key, bare in figures["bare_relay"].items()
            },
        },
        figures=figures,
        summary=summary_lines(figures, bench.durable),
    )
