"""backlog: the cost of one claim + settle as the pending backlog grows.

One outbox, filled in steps (INSERT ... SELECT ... generate_series, ids from
relayd_uuidv7(), as bench/sampler.py) to 10,000, 1,000,000 and 5,000,000 pending rows, each
step then vacuumed and analyzed (as autovacuum would be, long after the commit). At each
step, `rounds` times: one claim of 100 rows (`Store.claim_from` at the watermark, as relayd
runs it) then `Store.settle_published` of those rows, timed on the wall clock; the median
is reported, with the claim's and the settle's own medians, and the ratio to the first
step's.

This is the one scenario (with `horizon`) that calls relayd's Store directly: the claim and
the settle are exactly what `relayd run` sends, without HTTP in between. The rows a step's
rounds publish are taken off its pending count; the next fill tops the backlog up.
"""

from __future__ import annotations

import time
import uuid

import asyncpg

from bench.harness import Bench, drop_outbox, fill, new_outbox
from bench.measure import BenchError, Result, median, ratio
from relayd.core.rows import OutboxTable
from relayd.engine.watermark import Watermark
from relayd.store import Store

NAME = "backlog"
STEPS = {"full": (10_000, 1_000_000, 5_000_000), "quick": (10_000, 200_000)}
ROUNDS = 50
CLAIM_ROWS = 100
LEASE_S = 30.0  # relay.lease_s's default


async def claim_settle_ms(store: Store, rounds: int) -> tuple[float, float, float, int]:
    """Median wall ms of claim+settle, of the claim alone, of the settle alone, over
    `rounds` rounds after two untimed warm-up rounds; also the rows published.

    The claims start where a relay's would: at the watermark (relayd/engine/watermark.py). The
    warm-up rounds read the whole index (the first claim has no marks yet, the second
    not the writers' mark of a previous one) and prepare the statements; the timed rounds
    are the claims a relay makes between its full scans.
    """
    watermark = Watermark(full_scan_every_s=float("inf"))
    warm_up = 2
    published = 0
    totals, claims, settles = [], [], []
    for index in range(rounds + warm_up):
        owner = uuid.uuid4()
        started = time.perf_counter()
        batch = await store.claim_from(
            CLAIM_ROWS, owner, LEASE_S, watermark.for_claim(time.monotonic())
        )
        claimed = time.perf_counter()
        watermark.advance(batch)
        ids = [row.event_id for row in batch.rows]
        settled = await store.settle_published(owner, ids, ["available"] * len(ids))
        ended = time.perf_counter()
        if len(batch.rows) != CLAIM_ROWS or len(settled) != len(ids):
            raise BenchError(
                f"a claim of {CLAIM_ROWS} returned {len(batch.rows)} rows and settled "
                f"{len(settled)}: the backlog ran out, or another relay is running"
            )
        published += len(settled)
        if index >= warm_up:
            if watermark.scan_from is None:
                raise BenchError("the watermark did not advance: writers hidden from the role?")
            totals.append(ended - started)
            claims.append(claimed - started)
            settles.append(ended - claimed)
    return median(totals) * 1000, median(claims) * 1000, median(settles) * 1000, published


async def open_store(bench: Bench, table: OutboxTable) -> Store:
    # A long statement timeout: measuring, not bounding, a slow claim.
    return await Store.connect(bench.dsn, table, max_size=2, statement_timeout_s=600)


async def run(bench: Bench) -> Result:
    steps = STEPS["quick" if bench.quick else "full"]
    table = await new_outbox(bench, NAME)
    conn = await asyncpg.connect(bench.dsn)
    # The embedded server commits asynchronously (synchronous_commit = off), and VACUUM
    # cannot mark a page all-visible until the commit of its rows is flushed: right after a
    # fill, every index-only scan would then visit the table. A real outbox is vacuumed long
    # after its rows were committed.
    await conn.execute("SET synchronous_commit = on")
    store = await open_store(bench, table)
    measured: list[dict[str, float]] = []
    try:
        filled, pending = 0, 0
        for target in steps:
            started = time.perf_counter()
            await fill(conn, table, range(filled + 1, filled + target - pending + 1))
            filled += target - pending
            await conn.execute(f"VACUUM (ANALYZE) {table.qualified}")
            fill_s = time.perf_counter() - started
            total, claim, settle, published = await claim_settle_ms(store, ROUNDS)
            measured.append(
                {
                    "pending": target,
                    "fill_and_vacuum_s": round(fill_s, 1),
                    "claim_settle_ms": round(total, 3),
                    "claim_ms": round(claim, 3),
                    "settle_ms": round(settle, 3),
                }
            )
            pending = target - published
    finally:
        await store.close()
        await conn.close()
        await drop_outbox(bench, table)
    first = measured[0]
    for step in measured:
        step["vs_first"] = ratio(step["claim_settle_ms"], first["claim_settle_ms"])
    summary = [
        f"{'pending rows':>13}{'claim+settle ms':>17}{'claim ms':>10}{'settle ms':>11}"
        f"{'vs first':>10}{'fill s':>8}"
    ]
    for step in measured:
        summary.append(
            f"{step['pending']:>13,}{step['claim_settle_ms']:>17.2f}{step['claim_ms']:>10.2f}"
            f"{step['settle_ms']:>11.2f}{step['vs_first']:>9.2f}x{step['fill_and_vacuum_s']:>8.1f}"
        )
    last = measured[-1]
    return Result(
        scenario=NAME,
        params={
            "steps": list(steps),
            "rounds": ROUNDS,
            "claim_rows": CLAIM_ROWS,
            "statistic": "median wall time of one claim + settle",
        },
        baseline=f"the same measurement at {first['pending']:,} pending rows, same run",
        headline={f"claim_settle_{last['pending']}_vs_{first['pending']}": last["vs_first"]},
        figures={"steps": measured},
        summary=summary,
    )
