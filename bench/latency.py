"""What `lag` measures of each row: from its producer's commit to the sink's receipt, and the
stages between, from PostgreSQL's commit timestamps and the emulator's receipt times.

A row's times, all from the machine's one wall clock:

- `committed`: its producer transaction's commit (`track_commit_timestamp`, which the
  benchmark's server keeps, of the transaction id in the table's `bench_producer_xid`
  column: a default, so the producer pays no round trip for it);
- `claimed`: the start of the claim that leased it (`last_attempt_at`, the claim's `now()`);
- `received`: when the emulator began handling the request that carried it (its first
  receipt, if it was sent twice);
- `settle_began`: the start of the settle that recorded it (`published_at`);
- `settled`: that settle's commit (the commit timestamp of the row's `xmin`).

The latency is `received - committed`; the stages are commit → claim, claim → receipt (the
claim's statement and commit, relayd's request and the sink's queue), receipt → settle (the
sink's answer and relayd's reading of it) and the settle's own commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import asyncpg

from bench.harness import SINK_RESET_S, Bench
from bench.measure import BenchError, percentile
from bench.pgbench import WINDOW_COLUMN
from relayd.core.rows import OutboxTable

PRODUCER_XID = "bench_producer_xid"
STAGES = ("commit_to_claim", "claim_to_receipt", "receipt_to_settle", "settle_commit")


async def add_bench_columns(conn: asyncpg.Connection, table: OutboxTable) -> None:
    """Give the (empty) table the producer's transaction id (filled by its default) and the
    measurement window the producer stamps: nothing relayd reads."""
    await conn.execute(
        f"ALTER TABLE {table.qualified} "
        f"ADD COLUMN {PRODUCER_XID} xid8 DEFAULT pg_current_xact_id(), "
        f"ADD COLUMN {WINDOW_COLUMN} integer"
    )


@dataclass
class Receipts:
    """The emulator's receipt time of each job id, collected while the emulator is reset
    every SINK_RESET_S (as `sink_kept_small` does, and for the same reason): each reset
    answers the receipts it forgot, so none is lost between two calls."""

    bench: Bench
    http: aiohttp.ClientSession
    received: dict[str, float] = field(default_factory=dict)

    async def take(self) -> None:
        """Reset the emulator now and keep what it had received (a first receipt wins)."""
        async with self.http.post(
            f"{self.bench.sink_url}/_emulator/reset", json={"receipts": True}
        ) as answer:
            if answer.status != 200:
                raise BenchError(f"the emulator's reset answered HTTP {answer.status}")
            body = await answer.json()
        for job_id, at in zip(body["arrivals"], body["received_at"], strict=True):
            self.received.setdefault(job_id, at)

    def clear(self) -> None:
        self.received.clear()


@contextlib.asynccontextmanager
async def collecting_receipts(bench: Bench) -> AsyncIterator[Receipts]:
    """A `Receipts` kept up to date by a task that takes them every SINK_RESET_S."""
    async with aiohttp.ClientSession() as http:
        receipts = Receipts(bench, http)
        await receipts.take()  # an empty emulator to begin with

        async def janitor() -> None:
            while True:
                await asyncio.sleep(SINK_RESET_S)
                await receipts.take()

        task = asyncio.create_task(janitor())
        try:
            yield receipts
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass(frozen=True)
class Samples:
    """The rows of one window committed after its warm-up: each one's latency and stages
    (ms), and how many never reached the sink."""

    latency_ms: list[float]
    stages_ms: dict[str, list[float]]
    rows: int
    unreceived: int

    @staticmethod
    def pooled(parts: Sequence[Samples]) -> Samples:
        return Samples(
            [x for p in parts for x in p.latency_ms],
            {s: [x for p in parts for x in p.stages_ms[s]] for s in STAGES},
            sum(p.rows for p in parts),
            sum(p.unreceived for p in parts),
        )

    def figures(self) -> dict[str, Any]:
        """p50, p99, p99.9 and max of the latency; p50 and p99 of each stage."""
        figures: dict[str, Any] = {
            "samples": len(self.latency_ms),
            "rows": self.rows,
            "unreceived": self.unreceived,
            "p50_ms": _ms(percentile(self.latency_ms, 50)),
            "p99_ms": _ms(percentile(self.latency_ms, 99)),
            "p999_ms": _ms(percentile(self.latency_ms, 99.9)),
            "max_ms": _ms(max(self.latency_ms, default=math.nan)),
        }
        for stage in STAGES:
            figures[f"{stage}_p50_ms"] = _ms(percentile(self.stages_ms[stage], 50))
            figures[f"{stage}_p99_ms"] = _ms(percentile(self.stages_ms[stage], 99))
        return figures


def _ms(value: float) -> float:
    return round(value, 2)


# relayd's own timings (its /metrics), as sums and counts: (family, label filter).
TIMINGS = {
    "claim_statement": ("relayd_claim_duration_seconds", ""),
    "request": ("relayd_publish_duration_seconds", 'outcome="published"'),
}
# And its counters: claims run, rows they leased.
COUNTERS = {"claims": "relayd_claims_total", "claimed_rows": "relayd_claimed_rows_total"}


async def relay_metrics(http: aiohttp.ClientSession, ports: Sequence[int]) -> dict[str, float]:
    """Over the relays on `ports`, so far: the sum (s) and count of each of TIMINGS
    (`<name>_s`, `<name>_n`) and each of COUNTERS."""
    totals = {f"{name}_{part}": 0.0 for name in TIMINGS for part in ("s", "n")}
    totals |= dict.fromkeys(COUNTERS, 0.0)
    for port in ports:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as answer:
            text = await answer.text()
        for line in text.splitlines():
            for name, (family, labels) in TIMINGS.items():
                for suffix, part in (("_sum", "s"), ("_count", "n")):
                    if line.startswith(family + suffix) and labels in line:
                        totals[f"{name}_{part}"] += float(line.rsplit(" ", 1)[1])
            for name, family in COUNTERS.items():
                if line.startswith(family + " "):
                    totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def relay_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two `relay_metrics` readings: the mean of each of TIMINGS (`<name>_mean_ms`)
    and the rows per claim (an empty claim counts: more claims than rows means workers woke
    for rows another had taken)."""
    figures = {}
    for name in TIMINGS:
        count = after[f"{name}_n"] - before[f"{name}_n"]
        total_s = after[f"{name}_s"] - before[f"{name}_s"]
        figures[f"{name}_mean_ms"] = total_s / count * 1000 if count > 0 else math.nan
    claims = after["claims"] - before["claims"]
    rows = after["claimed_rows"] - before["claimed_rows"]
    figures["rows_per_claim"] = rows / claims if claims > 0 else math.nan
    return figures


async def window_samples(
    conn: asyncpg.Connection,
    table: OutboxTable,
    window: int,
    warmup_s: float,
    received: dict[str, float],
) -> Samples:
    """The samples of the rows stamped `window`, committed `warmup_s` or more after its
    first row, against the receipts in `received`."""
    rows = await conn.fetch(
        "SELECT o.event_id::text AS id,"
        f" extract(epoch FROM pg_xact_commit_timestamp(o.{PRODUCER_XID}::xid)) AS committed,"
        " extract(epoch FROM o.last_attempt_at) AS claimed,"
        " extract(epoch FROM o.published_at) AS settle_began,"
        " extract(epoch FROM pg_xact_commit_timestamp(o.xmin)) AS settled"
        f" FROM {table.qualified} AS o WHERE o.{WINDOW_COLUMN} = $1",
        window,
    )
    if not rows:
        return Samples([], {s: [] for s in STAGES}, 0, 0)
    since = min(float(r["committed"]) for r in rows) + warmup_s
    latency: list[float] = []
    stages: dict[str, list[float]] = {s: [] for s in STAGES}
    measured = unreceived = 0
    for r in rows:
        committed = float(r["committed"])
        if committed < since:
            continue
        measured += 1
        at = received.get(r["id"])
        if at is None or r["settle_began"] is None:
            unreceived += 1
            continue
        claimed, began, settled = (float(r[k]) for k in ("claimed", "settle_began", "settled"))
        latency.append((at - committed) * 1000)
        stages["commit_to_claim"].append((claimed - committed) * 1000)
        stages["claim_to_receipt"].append((at - claimed) * 1000)
        stages["receipt_to_settle"].append((began - at) * 1000)
        stages["settle_commit"].append((settled - began) * 1000)
    return Samples(latency, stages, measured, unreceived)
