"""ordered: what ordered delivery per key costs a drain, against an unordered drain of the
same rows in the same run (docs/ordering.md).

- unordered (the baseline): `relayd run`, batch mode, a backlog of rows without keys;
- 10,000 keys: the same backlog, each row keyed (`n % 10000`), `[sink] ordering = "key"`:
  one row per key in flight, so every claim walks the keys for heads;
- one hot key: every row of one key: one row per round trip to the sink, the floor of
  ordered delivery (target: >= 300 events/s);
- hot + quiet: one key holding a long backlog (written first) beside 10,000 single-row keys:
  the time until every single-row key is delivered, against the time an unordered drain of
  those 10,000 rows takes (target: within 2x); no key may crowd out the others;
- parked: the 10,000-key backlog with 1 % of its keys parked: the other keys' drain rate, and
  their p99 commit-to-publish (published_at - created_at, all rows written at once), against
  the same backlog with nothing parked (target: p99 within +10 %).

Every mode drains its own freshly filled outbox; the emulator is reset as it goes. CPU is
read from /proc, relayd's and PostgreSQL's, per 1,000 rows.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg

from bench.harness import (
    POLL_S,
    ROWS_SQL,
    Bench,
    drain_timeout_s,
    drop_outbox,
    fill,
    new_outbox,
    paused_relays,
    relayd_command,
    sink_kept_small,
)
from bench.measure import BenchError, Drain, Result, ratio, warnings_line
from relayd.core.rows import OutboxTable

NAME = "ordered"
ROWS = {"full": 100_000, "quick": 20_000}
KEYS = 10_000
HOT_ROWS = {"full": 10_000, "quick": 3_000}
HOT_BACKLOG = {"full": 200_000, "quick": 20_000}
PARKED_SHARE = 0.01
TARGETS = {"keys_vs_unordered": 0.70, "hot_key_rows_per_s": 300.0, "quiet_vs_unordered": 2.0}

# OJS envelopes as the drain scenario's; keyed, each row's key is an SQL expression of `n`.
UNKEYED_SQL = ROWS_SQL.replace("<last>", "'options', jsonb_build_object('queue', 'q' || (n % 8))")


def _keyed(key_sql: str) -> str:
    """UNKEYED_SQL writing each row's `ordering_key` too: `key_sql`, an expression of `n`."""
    head, _, tail = UNKEYED_SQL.partition("\nFROM (SELECT")
    head = head.replace("(event_id, job)", "(event_id, job, ordering_key)")
    return f"{head},\n       {key_sql}\nFROM (SELECT{tail}"


async def _filled(bench: Bench, name: str, parts: list[tuple[int, str | None]]) -> OutboxTable:
    """A new outbox holding, in order, each part's rows: (count, key expression of `n`, or
    None for unkeyed rows)."""
    table = await new_outbox(bench, name)
    conn = await asyncpg.connect(bench.dsn)
    try:
        start = 1
        for count, key_sql in parts:
            sql = UNKEYED_SQL if key_sql is None else _keyed(key_sql)
            await fill(conn, table, range(start, start + count), rows_sql=sql)
            start += count
        await conn.execute(f"ANALYZE {table.qualified}")
    finally:
        await conn.close()
    return table


async def _pending(conn: asyncpg.Connection, table: OutboxTable, where: str = "TRUE") -> int:
    count: int = await conn.fetchval(
        f"SELECT count(*) FROM {table.qualified} "
        f"WHERE published_at IS NULL AND dead_at IS NULL AND ({where})"
    )
    return count


async def _drain(
    bench: Bench, table: OutboxTable, key: str, *, until: str = "TRUE", ordered: bool
) -> Drain:
    """Resume `table` under paused relays and time the drain of the rows `until` selects
    (an SQL condition); stops there, whatever else is still pending."""
    async with paused_relays(
        bench, table, f"{key}.{'keyed' if ordered else 'unordered'}"
    ) as relays:
        conn = await asyncpg.connect(bench.dsn)
        try:
            rows = await _pending(conn, table, until)
            async with sink_kept_small(bench):
                cpu0 = bench.cpu_s(relays)
                await relayd_command(bench, table, "resume", "--reason", "bench: go")
                started = time.perf_counter()
                deadline = started + drain_timeout_s(rows) * 4
                while await _pending(conn, table, until):
                    relays.check_alive("draining")
                    if time.perf_counter() > deadline:
                        raise BenchError(f"{table}: the drain did not end in time")
                    await asyncio.sleep(POLL_S)
                seconds = time.perf_counter() - started
                cpu1 = bench.cpu_s(relays)
        finally:
            await conn.close()
        relay, pg, sink = (b - a for a, b in zip(cpu0, cpu1, strict=True))
        return Drain(rows, seconds, rows, relay, pg, sink, relays.warnings())


async def _p99_commit_to_publish(bench: Bench, table: OutboxTable, where: str) -> float:
    conn = await asyncpg.connect(bench.dsn)
    try:
        value: float = await conn.fetchval(
            "SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY "
            "extract(epoch FROM published_at - created_at)) "
            f"FROM {table.qualified} WHERE published_at IS NOT NULL AND ({where})"
        )
    finally:
        await conn.close()
    return value


async def _park(bench: Bench, table: OutboxTable, keys: int) -> None:
    """Park the first `keys` keys (k0 .. k<keys-1>) at their head, as a relay does."""
    conn = await asyncpg.connect(bench.dsn)
    try:
        await conn.execute(
            f"INSERT INTO {table.quoted_schema}.relayd_parked_keys "
            "(outbox_table, ordering_key, event_id, type, reason) "
            f"SELECT $1, ordering_key, event_id, job ->> 'type', 'bench' FROM {table.qualified} "
            "WHERE ordering_seq = 1 AND ordering_key = ANY($2::text[])",
            str(table),
            [f"k{i}" for i in range(keys)],
        )
    finally:
        await conn.close()


async def run(bench: Bench) -> Result:
    size = "quick" if bench.quick else "full"
    rows, hot_rows, backlog = ROWS[size], HOT_ROWS[size], HOT_BACKLOG[size]
    figures: dict[str, object] = {}

    async def measured(name: str, parts: list[tuple[int, str | None]], **kw: object) -> Drain:
        table = await _filled(bench, f"ordered_{name}", parts)
        try:
            return await _drain(bench, table, NAME, **kw)  # type: ignore[arg-type]
        finally:
            await drop_outbox(bench, table)

    unordered = await measured("unordered", [(rows, None)], ordered=False)
    keyed = await measured("keys", [(rows, f"'k' || (n % {KEYS})")], ordered=True)
    hot = await measured("hot", [(hot_rows, "'hot'")], ordered=True)
    quiet_unordered = await measured("quiet_unordered", [(KEYS, None)], ordered=False)
    quiet = await measured(
        "hot_quiet",
        [(backlog, "'hot'"), (KEYS, "'q' || n")],
        ordered=True,
        until="ordering_key <> 'hot'",
    )
    # Parking: the same keyed backlog with nothing parked, then 1 % of its keys parked.
    parked_keys = int(KEYS * PARKED_SHARE)
    others = (
        f"NOT (ordering_key = ANY(ARRAY[{','.join(repr(f'k{i}') for i in range(parked_keys))}]))"
    )
    p99 = {}
    for mode in ("not_parked", "parked"):
        table = await _filled(bench, f"ordered_{mode}", [(rows, f"'k' || (n % {KEYS})")])
        try:
            if mode == "parked":
                await _park(bench, table, parked_keys)
            drained = await _drain(bench, table, NAME, ordered=True, until=others)
            p99[mode] = await _p99_commit_to_publish(bench, table, others)
            figures[mode] = drained.figures() | {"p99_commit_to_publish_s": round(p99[mode], 3)}
        finally:
            await drop_outbox(bench, table)

    headline = {
        "keys_vs_unordered": ratio(keyed.rate, unordered.rate),
        "hot_key_rows_per_s": round(hot.rate, 1),
        "quiet_vs_unordered": ratio(quiet.seconds, quiet_unordered.seconds),
        "parked_p99_vs_not": ratio(p99["parked"], p99["not_parked"]),
    }
    figures |= {
        "unordered": unordered.figures(),
        "keys": keyed.figures(),
        "hot_key": hot.figures(),
        "quiet_unordered": quiet_unordered.figures(),
        "hot_and_quiet": quiet.figures(),
    }
    summary = [
        f"{'mode':<28}{'rows':>9}{'seconds':>9}{'rows/s':>10}{'relay us/row':>14}{'pg us/row':>11}"
    ]
    for name, drained in (
        ("unordered", unordered),
        (f"ordered, {KEYS:,} keys", keyed),
        ("ordered, one hot key", hot),
        (f"unordered, {KEYS:,} rows", quiet_unordered),
        (f"{KEYS:,} quiet keys beside hot", quiet),
    ):
        f = drained.figures()
        summary.append(
            f"{name:<28}{drained.rows:>9,}{drained.seconds:>9.2f}{drained.rate:>10,.0f}"
            f"{f['relay_cpu_us_per_row']:>14.0f}{f['pg_cpu_s_per_1000_rows'] * 1000:>11.0f}"
        )
    summary.append(
        f"ordered/unordered rate {headline['keys_vs_unordered']:.2f} (target >= "
        f"{TARGETS['keys_vs_unordered']}); hot key {hot.rate:,.0f}/s (target >= 300); quiet keys "
        f"beside a {backlog:,}-row key in {headline['quiet_vs_unordered']:.2f}x an unordered "
        f"drain's time (target <= 2); p99 commit-to-publish with 1 % parked "
        f"{p99['parked']:.3f} s vs {p99['not_parked']:.3f} s ({headline['parked_p99_vs_not']:.2f}x)"
    )
    summary += warnings_line(keyed.relay_warnings) + warnings_line(quiet.relay_warnings)
    return Result(
        scenario=NAME,
        params={"rows": rows, "keys": KEYS, "hot_rows": hot_rows, "hot_backlog": backlog},
        baseline="an unordered drain of the same rows (or of the 10,000 quiet rows), same run",
        headline=headline,
        figures=figures,
        summary=summary,
    )
