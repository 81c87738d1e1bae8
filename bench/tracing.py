"""tracing: what the relay's spans cost, in relayd's CPU per row, batch mode.

The same `relayd run` drains fresh outboxes of the same rows, every row carrying a distinct
producer's `meta.traceparent` (as an instrumented application's rows do), with tracing off
(no OTEL_* variable: nothing of OpenTelemetry is imported) and on through the standard
variables: the SDK, the always-on sampler, no exporter (`OTEL_TRACES_EXPORTER=none`: every
span is recorded, with a link per row, and none is exported). Four drains, off, on, on, off,
so that a drift of the machine over the run (the other drains' autovacuum, a neighbour's
load) weighs on both modes alike; each mode's figures are over its two drains. The headline
is the difference in relayd's CPU per row, in microseconds (target: within +10 µs). The
settings of both modes are in bench/settings.py (`tracing.off`, `tracing.on`).
"""

from __future__ import annotations

import os

from bench.harness import (
    ROWS_SQL,
    Bench,
    drain_timeout_s,
    drop_outbox,
    filled_outbox,
    paused_relays,
    reset_emulator,
)
from bench.measure import BenchError, Drain, Result, warnings_line

NAME = "tracing"
ROWS = {"full": 100_000, "quick": 20_000}
MODES = ("off", "on")
ORDER = ("off", "on", "on", "off")
TARGET_US_PER_ROW = 10.0

# The rows of the other scenarios (harness.FILL_SQL), each with a producer's traceparent in
# meta: a distinct, valid W3C value per row, made from its id.
TRACED_FILL_SQL = ROWS_SQL.replace(
    "<last>",
    "'options', jsonb_build_object('queue', 'q' || (n % 8)), "
    "'meta', jsonb_build_object('traceparent', "
    "'00-' || md5(id::text) || '-' || substr(md5(n::text), 1, 16) || '-01')",
)


async def drain_mode(bench: Bench, mode: str, rows: int) -> Drain:
    """Time one `relayd run` (settings `tracing.<mode>`) over a fresh traced outbox."""
    table = await filled_outbox(bench, f"tracing_{mode}", rows, rows_sql=TRACED_FILL_SQL)
    await reset_emulator(bench)
    async with paused_relays(bench, table, f"{NAME}.{mode}") as relays:
        drained = await relays.drain(cpu_rows=rows, timeout_s=drain_timeout_s(rows))
    await drop_outbox(bench, table)
    return drained


def combined(drains: list[Drain]) -> Drain:
    """Several drains of one mode as one: their rows, times and CPU added up."""
    warnings: dict[str, int] = {}
    for drained in drains:
        for event, count in drained.relay_warnings.items():
            warnings[event] = warnings.get(event, 0) + count
    return Drain(
        rows=sum(d.rows for d in drains),
        seconds=sum(d.seconds for d in drains),
        cpu_rows=sum(d.cpu_rows for d in drains),
        relay_cpu_s=sum(d.relay_cpu_s for d in drains),
        pg_cpu_s=sum(d.pg_cpu_s for d in drains),
        sink_cpu_s=sum(d.sink_cpu_s for d in drains),
        relay_warnings=warnings,
    )


async def run(bench: Bench) -> Result:
    inherited = sorted(name for name in os.environ if name.startswith("OTEL_"))
    if inherited:
        # Every relay inherits this environment: the "off" mode would not be off.
        raise BenchError(f"unset {', '.join(inherited)} first: the relays would inherit it")
    rows = ROWS["quick" if bench.quick else "full"]
    runs: dict[str, list[Drain]] = {mode: [] for mode in MODES}
    for mode in ORDER:
        runs[mode].append(await drain_mode(bench, mode, rows))
    drains = {mode: combined(runs[mode]) for mode in MODES}
    off, on = drains["off"].figures(), drains["on"].figures()
    cost_us = on["relay_cpu_us_per_row"] - off["relay_cpu_us_per_row"]
    summary = [f"{'tracing':<10}{'rows':>9}{'seconds':>9}{'rows/s':>10}{'relay us/row':>14}"]
    for mode, drained in drains.items():
        f = drained.figures()
        summary.append(
            f"{mode:<10}{drained.rows:>9,}{drained.seconds:>9.2f}{drained.rate:>10,.0f}"
            f"{f['relay_cpu_us_per_row']:>14.1f}"
        )
    verdict = "within" if cost_us <= TARGET_US_PER_ROW else "over"
    summary.append(
        f"spans cost {cost_us:+.1f} us of relayd CPU per row ({verdict} the "
        f"+{TARGET_US_PER_ROW:.0f} us target)"
    )
    for drained in drains.values():
        summary += warnings_line(drained.relay_warnings)
    return Result(
        scenario=NAME,
        params={
            "rows": rows,
            "order": list(ORDER),
            "batch": "on",
            "on": "OTEL_TRACES_EXPORTER=none, OTEL_TRACES_SAMPLER=always_on",
            "rows_carry_traceparent": True,
        },
        baseline="the same relayd with tracing off, same run, same rows",
        headline={
            "tracing_cpu_us_per_row": round(cost_us, 1),
            "target_us_per_row": TARGET_US_PER_ROW,
        },
        figures={
            "off": off,
            "on": on,
            "runs_us_per_row": {
                mode: [drained.figures()["relay_cpu_us_per_row"] for drained in runs[mode]]
                for mode in MODES
            },
        },
        summary=summary,
    )
