"""replicas: 1, 2 and 4 `relayd run` processes sharing one outbox, and whether each job
was still created exactly once.

For each count, a fresh outbox of 100,000 rows and a reset emulator; the processes start
paused, so that all of them are running when the drain is timed (see `Relays.drain`).
The emulator keeps every job here (unlike in the other drains, it is not reset as it goes:
its cost per request grows with them, the same for every count). Then its ledger is
checked against the outbox: every id created exactly once (`created == 1`), and the set of
ids on the sink equal to the outbox's. Baseline: one process; the headline is the rate of
4 over the rate of 1. On a machine with fewer cores than processes (plus PostgreSQL and
the emulator), more processes cannot add CPU: read the ratio with `cpus` and
`busy_cores`.
"""

from __future__ import annotations

import asyncpg

from bench.harness import (
    Bench,
    drain_timeout_s,
    drop_outbox,
    filled_outbox,
    ledger,
    paused_relays,
    reset_emulator,
)
from bench.measure import Drain, Result, ratio, warnings_line

NAME = "replicas"
COUNTS = (1, 2, 4)  # the first is the baseline
ROWS = {"full": 100_000, "quick": 20_000}


async def measure(bench: Bench, count: int, rows: int) -> tuple[Drain, dict[str, int | bool]]:
    """Drain `rows` rows with `count` processes; the drain, and the ledger's verdict."""
    table = await filled_outbox(bench, f"replicas_{count}", rows)
    await reset_emulator(bench)
    async with paused_relays(bench, table, NAME, count) as relays:
        drained = await relays.drain(cpu_rows=rows, timeout_s=drain_timeout_s(rows), ledger=True)
    conn = await asyncpg.connect(bench.dsn)
    try:
        outbox_ids = {
            r[0] for r in await conn.fetch(f"SELECT event_id::text FROM {table.qualified}")
        }
    finally:
        await conn.close()
    jobs = await ledger(bench)
    created = [entry["created"] for entry in jobs.values()]
    check: dict[str, int | bool] = {
        "ids_in_outbox": len(outbox_ids),
        "ids_on_sink": len(jobs),
        "created_more_than_once": sum(1 for c in created if c > 1),
        "never_created": sum(1 for c in created if c < 1) + len(outbox_ids - jobs.keys()),
        "not_in_outbox": len(jobs.keys() - outbox_ids),
    }
    check["exactly_once"] = (
        jobs.keys() == outbox_ids
        and check["created_more_than_once"] == 0
        and check["never_created"] == 0
    )
    await drop_outbox(bench, table)
    return drained, check


async def run(bench: Bench) -> Result:
    rows = ROWS["quick" if bench.quick else "full"]
    results = {count: await measure(bench, count, rows) for count in COUNTS}
    base = results[COUNTS[0]][0]
    figures = {
        f"processes_{count}": drained.figures()
        | {"vs_one": ratio(drained.rate, base.rate), "ledger": check}
        for count, (drained, check) in results.items()
    }
    summary = [f"{'processes':>10}{'rows/s':>10}{'vs one':>9}{'relay cpu s/1k':>16}  ledger"]
    for count, (drained, check) in results.items():
        verdict = (
            "every id created exactly once, same ids as the outbox"
            if check["exactly_once"]
            else f"NOT exactly once: {check}"
        )
        summary.append(
            f"{count:>10}{drained.rate:>10,.0f}{ratio(drained.rate, base.rate):>8.2f}x"
            f"{drained.figures()['relay_cpu_s_per_1000_rows']:>16.3f}  {verdict}"
        )
    for count, (drained, _) in results.items():
        summary += [f"{count} processes: {line}" for line in warnings_line(drained.relay_warnings)]
    top = COUNTS[-1]
    exactly_once = all(check["exactly_once"] for _, check in results.values())
    summary.append(
        "ledger: every id created exactly once in every run"
        if exactly_once
        else "ledger: NOT exactly once (see figures.processes_N.ledger)"
    )
    return Result(
        scenario=NAME,
        params={"rows": rows, "processes": list(COUNTS)},
        baseline="one relayd process, same run",
        headline={f"rate_{top}_vs_1": ratio(results[top][0].rate, base.rate)},
        figures=figures | {"exactly_once_everywhere": exactly_once},
        summary=summary,
    )
