"""The soak: two relays under a steady producer rate and a seeded stream of mixed faults for
a long time (`make soak`: 30 minutes), then the history checker; every 10 s the resident
memory and open file descriptors of each relay process are sampled.

    python -m tests.faults.soak [--minutes 30] [--rate 100] [--seed 7] [--json]

Relay `steady` is never killed (it is stopped, its sessions terminated, its sink fails):
the highest memory and descriptor counts of its warm-up (the first sixth of the run, at
least one minute) are the level the rest of the run must stay within 10 % of. Relay `victim` is also
killed with SIGKILL and terminated with SIGTERM, and started again each time. The run ends
with the faults cleared and the outbox drained; the exit code is 1 if the checker found
anything or a level drifted by more than 10 %, else 0. It never runs in `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from relayd.store import Store
from relayd.store.migrations import migrate
from relayd.testing.postgres import EmbeddedPostgres
from tests.faults.checker import check
from tests.faults.harness import Process, Scene, scene
from tests.support import DEFAULT_TABLE, produce

SAMPLE_EVERY_S = 10.0
FAULT_EVERY_S = (8.0, 20.0)
TOLERANCE = 0.10
LEASE_S = 3.0  # the harness's FAST lease


@dataclass
class Series:
    """One relay process's samples: (seconds since start, RSS KiB, open descriptors)."""

    name: str
    samples: list[tuple[float, int, int]] = field(default_factory=list)

    def sample(self, at_s: float, pid: int) -> None:
        try:
            rss = _rss_kib(pid)
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (FileNotFoundError, ProcessLookupError):
            return  # it exited between the check and the read
        self.samples.append((at_s, rss, fds))

    def drift(self, warmup_s: float) -> dict[str, Any]:
        """The level is the highest sample of the warm-up, by when the process has met the
        faults and grown its pools (a sink connection, a database session) to what they
        take; the rest of the run must stay within TOLERANCE of it. The last sample shows
        where the process ended."""
        during = [s for s in self.samples if s[0] < warmup_s]
        after = [s for s in self.samples if s[0] >= warmup_s]
        if not during or len(after) < 2:
            return {"samples": len(after), "rss_ratio": None, "fd_ratio": None}
        rss0, fd0 = max(s[1] for s in during), max(s[2] for s in during)
        return {
            "samples": len(after),
            "rss_kib_level": rss0,
            "rss_kib_max": max(s[1] for s in after),
            "rss_kib_last": after[-1][1],
            "rss_ratio": round(max(s[1] for s in after) / rss0, 3),
            "fds_level": fd0,
            "fds_range": [min(s[2] for s in after), max(s[2] for s in after)],
            "fds_last": after[-1][2],
            "fd_ratio": round(max(s[2] for s in after) / fd0, 3),
        }


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ProcessLookupError(pid)


class Soak:
    def __init__(self, stage: Scene, rng: random.Random, rate: int) -> None:
        self.stage, self.rng, self.rate = stage, rng, rate
        self.relays: dict[str, Process] = {}
        self.faults: list[str] = []
        self.produced = 0

    async def start(self) -> None:
        await self.stage.start_sink("--duplicate-mode", "overwrite")
        for name in ("steady", "victim"):
            self.relays[name] = await self.stage.relay(name)

    async def producer(self, until: float) -> None:
        conn = await asyncpg.connect(self.stage.dsn)
        try:
            tick, per_tick = 0.1, max(1, self.rate // 10)
            next_at = time.monotonic()
            while time.monotonic() < until:
                await produce(conn, per_tick)
                self.produced += per_tick
                next_at += tick
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        finally:
            await conn.close()

    async def fault_loop(self, until: float) -> None:
        actions: list[Callable[[], Awaitable[None]]] = [
            self.kill_victim,
            self.terminate_victim,
            self.freeze_steady,
            self.sink_outage,
            self.store_then_drop,
            self.slow_sink,
            self.late_answers,
            self.terminate_backends,
        ]
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(*FAULT_EVERY_S))
            if time.monotonic() >= until:
                break
            action = self.rng.choice(actions)
            self.faults.append(action.__name__)
            await action()

    # --- the faults ---

    async def kill_victim(self) -> None:
        await self.relays["victim"].kill()
        self.relays["victim"] = await self.stage.relay(f"victim-{len(self.faults)}")

    async def terminate_victim(self) -> None:
        await self.relays["victim"].stop()
        self.relays["victim"] = await self.stage.relay(f"victim-{len(self.faults)}")

    async def freeze_steady(self) -> None:
        steady = self.relays["steady"]
        steady.signal(signal.SIGSTOP)
        await asyncio.sleep(LEASE_S + 1.0)  # past its leases: the victim takes over
        steady.signal(signal.SIGCONT)

    async def sink_outage(self) -> None:
        sink = self.stage.sink
        assert sink is not None
        status = self.rng.choice([502, 503, 504])
        await sink.faults(
            {"action": "status", "status": status, "path_prefix": "/ojs/v1/jobs", "times": None}
        )
        await asyncio.sleep(3.0)
        await sink.clear_faults()

    async def store_then_drop(self) -> None:
        sink = self.stage.sink
        assert sink is not None
        await sink.faults({"action": "store_then_drop", "method": "POST", "times": 5})

    async def slow_sink(self) -> None:
        """Slow, but within the attempt deadline (sink.timeout_s is 1 s). A request the sink
        takes up only after relayd gave up on it is the window no client can close
        (docs/contract.md, C4): on this sink, which overwrites reused ids, it may create a job
        twice by design, so the soak leaves it to test_sink_faults' refusing sink."""
        sink = self.stage.sink
        assert sink is not None
        await sink.faults({"action": "latency", "delay_ms": 300, "method": "POST", "times": 5})

    async def late_answers(self) -> None:
        """Stored at once, answered after the deadline: relayd must find the jobs by GET."""
        sink = self.stage.sink
        assert sink is not None
        await sink.faults(
            {"action": "store_then_delay", "delay_ms": 1500, "method": "POST", "times": 5}
        )

    async def terminate_backends(self) -> None:
        await self.stage.conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'relayd' AND pid <> pg_backend_pid()"
        )


async def run(minutes: float, rate: int, seed: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="relayd-soak-"))
    duration_s = minutes * 60.0
    # The first sixth of a long run (a short trial run: its first third) is the warm-up.
    warmup_s = max(60.0, duration_s / 6.0) if duration_s >= 360.0 else duration_s / 3.0
    with EmbeddedPostgres(base / "pg") as pg:
        dsn = pg.dsn()
        store = await Store.connect(dsn, DEFAULT_TABLE, max_size=2)
        try:
            await migrate(store)
        finally:
            await store.close()
        async with scene(base, dsn) as stage:
            soak = Soak(stage, random.Random(seed), rate)
            await soak.start()
            started = time.monotonic()
            until = started + duration_s
            series: dict[str, Series] = {"steady": Series("steady")}
            victims: dict[int, Series] = {}

            async def sampler() -> None:
                while time.monotonic() < until:
                    at_s = time.monotonic() - started
                    series["steady"].sample(at_s, soak.relays["steady"].pid)
                    victim = soak.relays["victim"]
                    victims.setdefault(victim.pid, Series(victim.name)).sample(at_s, victim.pid)
                    await asyncio.sleep(SAMPLE_EVERY_S)

            async with asyncio.TaskGroup() as group:
                group.create_task(soak.producer(until))
                group.create_task(soak.fault_loop(until))
                group.create_task(sampler())
            sink = stage.sink
            assert sink is not None
            await sink.clear_faults()
            await stage.drained(timeout_s=300.0)
            codes = {name: await proc.stop() for name, proc in soak.relays.items()}
            report = await check(stage.conn, await sink.ledger(), table=stage.table)
    steady = series["steady"].drift(warmup_s)
    within = all(
        ratio is not None and ratio <= 1.0 + TOLERANCE
        for ratio in (steady["rss_ratio"], steady["fd_ratio"])
    )
    ok = report.ok and within and all(code == 0 for code in codes.values())
    if ok:
        shutil.rmtree(base, ignore_errors=True)  # the logs are kept only when it failed
    return {
        "minutes": minutes,
        "rate": rate,
        "seed": seed,
        "produced": soak.produced,
        "faults": {name: soak.faults.count(name) for name in sorted(set(soak.faults))},
        "exit_codes": codes,
        "warmup_s": warmup_s,
        "steady": steady,
        "victim_incarnations": len(victims),
        "checker": {
            "rows": report.rows,
            "sink_jobs": report.sink_jobs,
            "transitions": report.transitions,
            "violations": len(report.violations),
        },
        "checker_report": None if report.ok else report.format(),
        "ok": ok,
        "logs": None if ok else str(base),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=100, help="rows per second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.minutes, args.rate, args.seed))
    print(json.dumps({k: v for k, v in result.items() if k != "checker_report"}))
    if not args.json:
        steady = result["steady"]
        print(
            f"  {result['minutes']:g} min at {result['rate']} rows/s: {result['produced']:,} "
            f"rows, faults {result['faults']}\n"
            f"  steady relay after warm-up: RSS x{steady['rss_ratio']}, open fds "
            f"x{steady['fd_ratio']} (limit x{1 + TOLERANCE:g}); victim incarnations "
            f"{result['victim_incarnations']}\n"
            f"  checker: {result['checker']['violations']} violations over "
            f"{result['checker']['rows']:,} rows"
            + (f"; logs kept in {result['logs']}" if result["logs"] else "")
        )
    if result["checker_report"]:
        print(result["checker_report"], file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
