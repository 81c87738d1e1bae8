"""memory: the resident memory of one relayd over a long drain, against its start-up.

One outbox of 5,000,000 rows, filled before relayd starts; relayd (batch mode) starts on
it paused, so that its RSS right after start-up is read before it has claimed anything;
then the outbox is resumed and drained to the end. VmRSS is sampled from /proc every half
second (the curve: a leak grows with the rows, a batch's spike comes and goes), and VmHWM,
the kernel's high-water mark, is read at the end, before relayd stops.

The emulator is reset every few seconds during the drain, as in every drain whose ledger
is not checked (harness.sink_kept_small): millions of jobs do not pile up in the sink.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg

from bench.harness import (
    Bench,
    drain_timeout_s,
    drop_outbox,
    fill,
    new_outbox,
    paused_relays,
    reset_emulator,
)
from bench.measure import Result, RssSampler, peak_rss_mib, ratio, rss_mib, warnings_line

NAME = "memory"
ROWS = {"full": 5_000_000, "quick": 200_000}


async def run(bench: Bench) -> Result:
    rows = ROWS["quick" if bench.quick else "full"]
    table = await new_outbox(bench, NAME)
    conn = await asyncpg.connect(bench.dsn)
    try:
        await fill(conn, table, range(1, rows + 1))
        await conn.execute(f"ANALYZE {table.qualified}")
    finally:
        await conn.close()
    await reset_emulator(bench)
    async with paused_relays(bench, table, NAME) as relays:
        pid = relays.pids[0]
        startup = rss_mib(pid)
        sampler = RssSampler(pid)
        sampling = asyncio.create_task(sampler.run())
        try:
            drained = await relays.drain(cpu_rows=rows, timeout_s=drain_timeout_s(rows))
            peak = peak_rss_mib(pid)  # before the stop: the high-water mark dies with it
            end = rss_mib(pid)
        finally:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
    await drop_outbox(bench, table)
    await reset_emulator(bench)
    peak = max([peak, *(mib for _, mib in sampler.samples)])
    peak_ratio = ratio(peak, startup)
    curve = {f"rss_mib_at_{p}pct": round(sampler.at_fraction(p / 100), 1) for p in (25, 50, 75)}
    figures = {
        "startup_rss_mib": round(startup, 1),
        "peak_rss_mib": round(peak, 1),
        "end_rss_mib": round(end, 1),
        "peak_vs_startup": peak_ratio,
        "end_vs_startup": ratio(end, startup),
        **curve,
        "samples": len(sampler.samples),
        "drain": drained.figures(),
    }
    return Result(
        scenario=NAME,
        params={"rows": rows, "sample_interval_s": sampler.interval_s},
        baseline="the same process's RSS right after start-up (paused, nothing claimed)",
        headline={"peak_vs_startup": peak_ratio},
        figures=figures,
        summary=[
            f"RSS MiB: start-up {startup:.1f}, peak {peak:.1f} ({peak_ratio:.2f}x), "
            f"end {end:.1f}; at 25/50/75% of the drain "
            + "/".join(f"{v:.1f}" for v in curve.values()),
            f"drained {rows:,} rows at {drained.rate:,.0f} rows/s",
            *warnings_line(drained.relay_warnings),
        ],
    )
