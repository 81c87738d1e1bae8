"""The ordered-delivery fault scenario: many keys of Zipf-distributed sizes on an OJS sink
that refuses a reused id (409, as the specification says), two relays killed with SIGKILL
and restarted by turns, a
relay frozen past its lease mid-send, transient refusals and a few permanent ones. The
ordering checker reads the sink's arrivals; the transition checker the outbox's history."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from relayd.producer import new_job
from tests.faults.harness import Process, Scene
from tests.faults.order_checker import OrderReport, check_order

# Seconds without a pending row settled, after which the run stops and is judged.
STALL_S = 15.0


@dataclass
class OrderedRun:
    rows: dict[str, tuple[str, int]]  # event id -> (key, seq)
    refused: set[str]  # heads refused for good: their keys park
    report: OrderReport
    parked: set[str]  # the keys parked when the run settled
    waiting: set[str]  # the rows of parked keys, from their refused head on
    arrived: set[str]  # the rows the sink stored
    kills: int
    seconds: float


def zipf_keys(events: int, keys: int, *, seed: int, s: float = 1.1) -> list[str]:
    """`events` keys drawn from `keys` with Zipf weights (key 0 the hottest), seeded."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** s for k in range(keys)]
    names = [f"k{k:05}" for k in range(keys)]
    drawn = rng.choices(names, weights, k=events)
    drawn[: len(names)] = names  # every key has at least one row
    rng.shuffle(drawn)
    return drawn


async def insert(scene: Scene, keys: list[str], *, chunk: int = 2000) -> dict[str, tuple[str, int]]:
    """Commit one row per entry of `keys`, `chunk` rows a transaction; (key, seq) by id."""
    rows: dict[str, tuple[str, int]] = {}
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        jobs = [new_job("test.ordered", [{"key": key}]) for key in part]
        rows |= await insert_keyed(scene.conn, scene.sql_table, jobs, part)
    return rows


async def insert_keyed(
    conn: asyncpg.Connection, sql_table: str, jobs: list[dict[str, Any]], keys: list[str]
) -> dict[str, tuple[str, int]]:
    """Commit `jobs` in one transaction, each with its key (as plain SQL would); each row's
    (key, number within its key) by id."""
    async with conn.transaction():
        numbered = await conn.fetch(
            f"INSERT INTO {sql_table} (event_id, job, ordering_key) "
            "SELECT * FROM unnest($1::uuid[], $2::jsonb[], $3::text[]) "
            "RETURNING event_id::text, ordering_key, ordering_seq",
            [job["id"] for job in jobs],
            [json.dumps(job) for job in jobs],
            keys,
        )
    return {r["event_id"]: (r["ordering_key"], r["ordering_seq"]) for r in numbered}


async def ordered_under_faults(  # noqa: PLR0913 - the scenario's dimensions
    scene: Scene,
    *,
    events: int,
    keys: int,
    seed: int = 11,
    kill_every_s: float = 1.5,
    transient: float = 0.05,
    permanent: int = 3,
) -> OrderedRun:
    rng = random.Random(seed)
    # A server that refuses a reused id: a request the frozen relay sends after its lease
    # ran out (its send window checked before the freeze, written after it) is refused.
    # One that overwrites would store it again, after the key's next row: the residual
    # window of C10, measured deterministically in tests/integration/engine/.
    sink = await scene.start_sink()
    rows = await insert(scene, zipf_keys(events, keys, seed=seed))
    ids = sorted(rows)
    refused = set(rng.sample(ids, permanent))
    flaky = rng.sample([i for i in ids if i not in refused], int(len(ids) * transient))
    rules = [
        {"method": "POST", "job_id": i, "action": "status", "status": 503, "times": 2}
        for i in flaky
    ] + [
        {"method": "POST", "job_id": i, "action": "status", "status": 400, "times": None}
        for i in refused
    ]
    for start in range(0, len(rules), 500):
        await sink.faults(*rules[start : start + 500])
    env = {"RELAYD_SINK__ORDERING": "key", "RELAYD_RETRY__MAX_ATTEMPTS": "20"}
    runtime = {name: scene.base / f"run-{name}" for name in ("a", "b")}
    for directory in runtime.values():
        directory.mkdir()
    relays: dict[str, Process] = {
        name: await scene.relay(name, env=env | {"RELAYD_RELAY__RUNTIME_DIR": str(path)})
        for name, path in runtime.items()
    }
    # The rows that wait behind a refused head: its key's, from the head on.
    first_refused: dict[str, int] = {}
    for i in refused:
        key, seq = rows[i]
        first_refused[key] = min(seq, first_refused.get(key, seq))
    waiting = {i for i, (key, seq) in rows.items() if seq >= first_refused.get(key, seq + 1)}
    started, kills, frozen_once = time.monotonic(), 0, False

    progress: list[tuple[float, int]] = []

    async def settled() -> bool:
        """Nothing pending but the rows behind refused heads; or nothing has moved for
        STALL_S (a relay that breaks the order may strand rows: the checker says which)."""
        pending = {
            r["event_id"]
            for r in await scene.conn.fetch(
                f"SELECT event_id::text FROM {scene.sql_table} "
                "WHERE published_at IS NULL AND dead_at IS NULL"
            )
        }
        now = time.monotonic()
        if not progress or progress[-1][1] != len(pending):
            progress.append((now, len(pending)))
        return pending <= waiting or now - progress[-1][0] > STALL_S

    deadline = started + max(600.0, events / 50)
    while not await settled():
        assert time.monotonic() < deadline, (
            f"the ordered run did not settle in {deadline - started:.0f} s"
        )
        await asyncio.sleep(kill_every_s)
        name = rng.choice(sorted(relays))
        if kills == 2 and not frozen_once:
            # Frozen past its lease (3 s) mid-run, then thawed: its late settles are stale.
            relays[name].signal(signal.SIGSTOP)
            await asyncio.sleep(4)
            relays[name].signal(signal.SIGCONT)
            frozen_once = True
            continue
        await relays[name].kill()
        kills += 1
        relays[name] = await scene.relay(
            f"{name}{kills}", env=env | {"RELAYD_RELAY__RUNTIME_DIR": str(runtime[name])}
        )
    for proc in relays.values():
        await proc.stop()
    parked = {
        r["ordering_key"]
        for r in await scene.conn.fetch(
            "SELECT ordering_key FROM relayd.relayd_parked_keys WHERE outbox_table = $1",
            scene.table,
        )
    }
    arrivals = await sink.arrivals()
    report = check_order(arrivals, rows, dead=waiting)
    return OrderedRun(
        rows, refused, report, parked, waiting, set(arrivals), kills, time.monotonic() - started
    )


def summary(run: OrderedRun) -> str:
    r = run.report
    return (
        f"{len(run.rows)} events, {r.keys} keys, {run.kills} kills, {run.seconds:.0f} s: "
        f"{r.delivered} delivered, {r.repeats} repeats, {len(r.violations)} order violations, "
        f"{len(r.lost)} lost, parked {sorted(run.parked)}"
    )


async def ordered_delivery_holds(scene: Scene, *, events: int = 600, keys: int = 60) -> OrderedRun:
    """The scenario's verdict: every key in commit order, nothing lost, the refused heads'
    keys parked and nothing else. Fails naming the count of order violations."""
    run = await ordered_under_faults(scene, events=events, keys=keys, kill_every_s=0.5)
    violations = run.report.violations
    assert not violations, f"order violations ({len(violations)}): {violations[:3]}"
    overtook = run.waiting & run.arrived
    assert not overtook, f"rows behind a parked head delivered ({len(overtook)})"
    if run.report.lost:
        states = await scene.conn.fetch(
            f"SELECT (published_at IS NOT NULL) AS published, dead_reason, "
            f"available_at = 'infinity' AS waiting, count(*) FROM {scene.sql_table} "
            "WHERE event_id = ANY($1::uuid[]) GROUP BY 1, 2, 3",
            run.report.lost,
        )
        assert not run.report.lost, f"lost ({len(run.report.lost)}): {[tuple(r) for r in states]}"
    assert run.parked == {run.rows[i][0] for i in run.refused}, summary(run)
    return run


async def ordered_delivery(scene: Scene) -> None:
    """`ordered_delivery_holds` at its default size, as a scenario."""
    await ordered_delivery_holds(scene)


async def _at_scale(events: int, keys: int, seed: int) -> dict[str, object]:
    """The scenario at a size too long for `make test`, on an embedded server of its own."""
    import tempfile  # noqa: PLC0415 - the command line's own needs

    from relayd.store import Store  # noqa: PLC0415
    from relayd.store.migrations import migrate  # noqa: PLC0415
    from relayd.testing.postgres import EmbeddedPostgres  # noqa: PLC0415
    from tests.faults.harness import scene  # noqa: PLC0415
    from tests.support import DEFAULT_TABLE  # noqa: PLC0415

    base = Path(tempfile.mkdtemp(prefix="relayd-ordered-"))
    with EmbeddedPostgres(base / "pg") as pg:
        store = await Store.connect(pg.dsn(), DEFAULT_TABLE, max_size=2)
        try:
            await migrate(store)
        finally:
            await store.close()
        async with scene(base, pg.dsn()) as stage:
            run = await ordered_under_faults(stage, events=events, keys=keys, seed=seed)
            history = await stage.check(waiting=run.waiting)
    return {
        "summary": summary(run),
        "events": len(run.rows),
        "keys": run.report.keys,
        "kills": run.kills,
        "seconds": round(run.seconds, 1),
        "delivered": run.report.delivered,
        "repeats": run.report.repeats,
        "order_violations": len(run.report.violations),
        "lost": len(run.report.lost),
        "parked": sorted(run.parked),
        "rows_behind_parked_heads_delivered": len(run.waiting & run.arrived),
        "history_violations": len(history.findings),
    }


def main() -> int:
    """`python -m tests.faults.ordered [--events N] [--keys K] [--seed S]`: the ordered
    scenario at scale (200,000 events over 5,000 keys by default); one JSON line; exit 1
    unless every key was in order and nothing was lost."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m tests.faults.ordered")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    result = asyncio.run(_at_scale(args.events, args.keys, args.seed))
    print(json.dumps(result))  # noqa: T201 - the command's output
    clean = not (result["order_violations"] or result["lost"] or result["history_violations"])
    return 0 if clean and not result["rows_behind_parked_heads_delivered"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
