"""horizon: the drain of (drain) in batch mode while a long transaction holds the xmin
horizon back, against the same drain without it.

A `REPEATABLE READ` transaction on its own connection (application_name
'bench-held-snapshot') takes a snapshot (`SELECT count(*)` of the outbox) before the fill
and holds it to the end. Vacuum then cannot remove, and index scans cannot skip for good,
any row version that snapshot might see: every claimed and every settled row leaves
entries behind in the claim index that each later claim walks over again.

The drain runs in steps: `relayd run` until it has published the step's rows (its
/metrics), stopped (SIGTERM: it settles what it holds), then one claim + settle is timed as
in (backlog), on the backlog that is left, and the next step starts a new relay. So the
claim+settle cost is known after every `step` rows drained, as a ratio to the first (before
any drain); the drain rate is all rows relayd published over the time its processes ran
(from /readyz to exit). Both passes, free and held, run the same steps on the same rows:
the headline is the held rate over the free rate (the target is >= 0.8).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import asyncpg

from bench.backlog import claim_settle_ms, open_store
from bench.harness import (
    POLL_S,
    Bench,
    Relays,
    count_pending,
    count_published,
    drain_timeout_s,
    drop_outbox,
    fill,
    new_outbox,
    require_no_dead_letters,
    reset_emulator,
    sink_kept_small,
    start_relays,
)
from bench.measure import BenchError, Result, ratio, warnings_line
from relayd.core.rows import OutboxTable

NAME = "horizon"
ROWS = {"full": 100_000, "quick": 20_000}
STEP = {"full": 20_000, "quick": 7_000}
# Rounds of claim+settle after each step (each publishes 100 rows, plus two warm-up rounds).
ROUNDS = {"full": 20, "quick": 10}
SNAPSHOT_APP = "bench-held-snapshot"


@contextlib.asynccontextmanager
async def held_snapshot(bench: Bench, table: OutboxTable, hold: bool) -> AsyncIterator[None]:
    """While inside, a REPEATABLE READ transaction that has read `table` is open (if
    `hold`): its snapshot holds the xmin horizon where it was taken."""
    if not hold:
        yield
        return
    conn = await asyncpg.connect(bench.dsn, server_settings={"application_name": SNAPSHOT_APP})
    try:
        transaction = conn.transaction(isolation="repeatable_read")
        await transaction.start()
        # The snapshot is taken by the transaction's first statement, not by BEGIN.
        await conn.fetchval(f"SELECT count(*) FROM {table.qualified}")
        try:
            yield
        finally:
            await transaction.rollback()
    finally:
        await conn.close()


async def _run_until_published(
    relays: Relays,
    http: aiohttp.ClientSession,
    conn: asyncpg.Connection,
    already: int,
    wanted: int,
) -> tuple[int, float]:
    """Wait until the relays, started on an outbox where `already` rows were published,
    have published `wanted` more. Returns the rows published between the first reading
    and the last, and the time between: rows relayd took before the first reading (its
    workers run a little before /readyz is seen) are neither counted nor timed.

    relayd's /metrics counts the rows; without its counter, PostgreSQL is asked instead,
    which costs the server a scan of the published index per poll, growing with the drain
    (so it is asked less often).
    """
    timeout_s = drain_timeout_s(wanted)
    started = time.perf_counter()
    deadline = started + timeout_s
    by_metrics = await relays.published_by_metrics(http) is not None
    first: int | None = None
    while True:
        relays.check_alive(f"a step of the drain of {relays.table}")
        # The counter counts from the processes' start; the table from its fill.
        if by_metrics:
            done = await relays.published_by_metrics(http) or 0
        else:
            done = await count_published(conn, relays.table) - already
        seen = time.perf_counter()
        if first is None:
            first, started = done, seen
        if done >= wanted:
            return done - first, seen - started
        if seen > deadline:
            raise BenchError(
                f"{relays.table}: {done:,} of {wanted:,} rows published in {timeout_s:.0f} s"
            )
        await asyncio.sleep(POLL_S if by_metrics else 0.5)


@dataclass
class Pass:
    """One stepped drain: the rows relayd published while timed and in how long, and the
    claim+settle cost after each step."""

    relay_rows: int = 0
    relay_s: float = 0.0
    steps: list[dict[str, float]] = field(default_factory=list)
    relay_warnings: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.relay_rows / self.relay_s if self.relay_s else float("nan")

    def figures(self) -> dict[str, Any]:
        first = self.steps[0]["claim_settle_ms"] if self.steps else float("nan")
        return {
            "relay_rows": self.relay_rows,
            "relay_seconds": round(self.relay_s, 3),
            "rows_per_s": round(self.rate, 1),
            "steps": [s | {"vs_first": ratio(s["claim_settle_ms"], first)} for s in self.steps],
            "relay_warnings": self.relay_warnings,
        }


async def stepped_drain(bench: Bench, hold: bool) -> Pass:
    size = "quick" if bench.quick else "full"
    rows, step, rounds = ROWS[size], STEP[size], ROUNDS[size]
    table = await new_outbox(bench, f"horizon_{'held' if hold else 'free'}")
    await reset_emulator(bench)
    result = Pass()
    conn = await asyncpg.connect(bench.dsn)
    store = await open_store(bench, table)
    try:
        async with (
            held_snapshot(bench, table, hold),
            aiohttp.ClientSession() as http,
            sink_kept_small(bench),
        ):
            await fill(conn, table, range(1, rows + 1))
            await conn.execute(f"ANALYZE {table.qualified}")
            published = 0
            for target in [*range(0, rows, step), rows]:
                if target > published:
                    # relayd until `target` rows are published in all. The rate counts from
                    # the first reading after /readyz to the moment the target was seen:
                    # neither start-up nor the stop (SIGTERM: it settles what it holds) is
                    # a drain.
                    async with start_relays(bench, table, NAME) as relays:
                        rows_seen, seconds = await _run_until_published(
                            relays, http, conn, published, target - published
                        )
                    result.relay_rows += rows_seen
                    result.relay_s += seconds
                    for name, count in relays.warnings().items():
                        result.relay_warnings[name] = result.relay_warnings.get(name, 0) + count
                    published = await count_published(conn, table)
                pending = await count_pending(conn, table)
                if pending < (rounds + 2) * 100:
                    continue  # too few rows left to measure (the last step)
                total, claim, settle, by_store = await claim_settle_ms(store, rounds)
                result.steps.append(
                    {
                        "drained": published,
                        "pending": pending,
                        "claim_settle_ms": round(total, 3),
                        "claim_ms": round(claim, 3),
                        "settle_ms": round(settle, 3),
                    }
                )
                published += by_store
            left = await count_pending(conn, table)
            if left:
                raise BenchError(f"{table}: {left:,} rows still pending after the last step")
            await require_no_dead_letters(conn, table)
    finally:
        await store.close()
        await conn.close()
    await drop_outbox(bench, table)
    return result


async def run(bench: Bench) -> Result:
    size = "quick" if bench.quick else "full"
    free = await stepped_drain(bench, hold=False)
    held = await stepped_drain(bench, hold=True)
    rate_ratio = ratio(held.rate, free.rate)
    summary = [
        f"drain rate: free {free.rate:,.0f} rows/s, held snapshot {held.rate:,.0f} rows/s: "
        f"{rate_ratio:.2f}x (target >= 0.8)",
        f"{'drained':>9}{'free claim+settle ms':>22}{'vs first':>10}"
        f"{'held claim+settle ms':>22}{'vs first':>10}",
    ]
    free_figures, held_figures = free.figures(), held.figures()
    for a, b in zip(free_figures["steps"], held_figures["steps"], strict=False):
        summary.append(
            f"{a['drained']:>9,}{a['claim_settle_ms']:>22.2f}{a['vs_first']:>9.2f}x"
            f"{b['claim_settle_ms']:>22.2f}{b['vs_first']:>9.2f}x"
        )
    summary += warnings_line(free.relay_warnings) + warnings_line(held.relay_warnings)
    return Result(
        scenario=NAME,
        params={
            "rows": ROWS[size],
            "step": STEP[size],
            "rounds": ROUNDS[size],
            "snapshot": f"REPEATABLE READ, application_name {SNAPSHOT_APP!r}, from before the fill",
        },
        baseline="the same stepped drain without the held snapshot, same run",
        headline={"held_rate_vs_free": rate_ratio},
        figures={"free": free_figures, "held": held_figures},
        summary=summary,
    )
