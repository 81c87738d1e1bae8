"""What the benchmarks measure and how they report it: a timed drain's figures, the CPU and
memory of relayd, PostgreSQL and the emulator read from /proc, percentiles and ratios, and
the one JSON line (plus a human table) each scenario prints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import relayd

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A benchmark could not measure what it set out to: one line, said to the user."""


# --- drains -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drain:
    """One timed drain: `rows` in `seconds`; CPU over `cpu_rows` rows."""

    rows: int
    seconds: float
    cpu_rows: int
    relay_cpu_s: float
    pg_cpu_s: float
    sink_cpu_s: float
    relay_warnings: dict[str, int] = field(default_factory=dict)  # see Relay.warnings

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else math.nan

    def figures(self) -> dict[str, Any]:
        per = 1000 / self.cpu_rows if self.cpu_rows else math.nan
        return {
            "rows": self.rows,
            "seconds": round(self.seconds, 3),
            "rows_per_s": round(self.rate, 1),
            "relay_cpu_s_per_1000_rows": round(self.relay_cpu_s * per, 4),
            "pg_cpu_s_per_1000_rows": round(self.pg_cpu_s * per, 4),
            "sink_cpu_s_per_1000_rows": round(self.sink_cpu_s * per, 4),
            "relay_cpu_us_per_row": round(self.relay_cpu_s * per * 1000, 1),
            # CPU of relay + PostgreSQL + sink per second of drain: near the core count,
            # the machine, not any one of them, was the limit.
            "busy_cores": round(
                (self.relay_cpu_s + self.pg_cpu_s + self.sink_cpu_s) / self.seconds, 2
            )
            if self.seconds > 0
            else math.nan,
            "relay_warnings": self.relay_warnings,
        }


# --- CPU and memory, from /proc -----------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses):
    index 0 is field 3 (state), so field n is at n - 3."""
    text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    return text.rsplit(")", 1)[1].split()


def ppid(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def pg_cpu_s(postmaster: int) -> float:
    """CPU seconds of the whole PostgreSQL server: the postmaster, every live child
    (backends, autovacuum, walwriter, ...) and every child that exited already (the
    postmaster reaps them, so their time is in its cutime and cstime)."""
    for _ in range(100):
        before = _stat_fields(postmaster)
        children = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                child = _stat_fields(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue  # gone: reaped, so counted in the postmaster's cutime below
            if int(child[1]) == postmaster:
                children += int(child[11]) + int(child[12])
        after = _stat_fields(postmaster)
        # A child reaped between the two reads of the postmaster would be counted twice or
        # not at all (a backend's exit is when its time moves to the parent): read again.
        if before[13:15] == after[13:15]:
            return (sum(int(after[i]) for i in (11, 12, 13, 14)) + children) / _CLOCK_TICKS
    raise BenchError("PostgreSQL's CPU time would not hold still (its children keep exiting)")


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat's `cpu`
    line: everything but idle and iowait), whatever process it ran."""
    fields = Path("/proc/stat").read_text(encoding="ascii").splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


def pids_cpu_s(pids: Sequence[int]) -> dict[int, float]:
    """`process_cpu_s` of each pid that still runs (an exited one is left out)."""
    seconds: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            seconds[pid] = process_cpu_s(pid)
    return seconds


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise BenchError(f"/proc/{pid}/status has no {key}")


def rss_mib(pid: int) -> float:
    """Resident memory now."""
    return _status_kib(pid, "VmRSS") / 1024


def peak_rss_mib(pid: int) -> float:
    """The most resident memory the process ever had (the kernel's high-water mark)."""
    return _status_kib(pid, "VmHWM") / 1024


@dataclass
class RssSampler:
    """VmRSS of one process every `interval_s`, while running: the curve the high-water
    mark alone cannot show (a leak grows; a batch spike comes and goes)."""

    pid: int
    interval_s: float = 0.5
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)

    async def run(self) -> None:
        started = time.perf_counter()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            while True:
                self.samples.append((time.perf_counter() - started, rss_mib(self.pid)))
                await asyncio.sleep(self.interval_s)

    def at_fraction(self, fraction: float) -> float:
        """The sample nearest to `fraction` of the sampled time."""
        if not self.samples:
            return math.nan
        end = self.samples[-1][0]
        return min(self.samples, key=lambda s: abs(s[0] - fraction * end))[1]


# --- figures ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile q (0-100) of `values`: a value that was observed."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ratio(value: float, baseline: float) -> float:
    """value / baseline, rounded; NaN when the baseline is zero or missing."""
    if not baseline or math.isnan(baseline) or math.isnan(value):
        return math.nan
    return round(value / baseline, 3)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


async def median_s(run: Callable[[], Any], runs: int) -> float:
    durations = []
    for _ in range(runs):
        started = time.perf_counter()
        await run()
        durations.append(time.perf_counter() - started)
    return median(durations)


def warnings_line(warnings: dict[str, int]) -> list[str]:
    """A summary line naming relayd's warnings, or nothing when there were none."""
    if not warnings:
        return []
    listed = ", ".join(f"{name} x{count}" for name, count in sorted(warnings.items()))
    return [f"relayd logged warnings (figures suspect): {listed}"]


@dataclass
class Result:
    """What a scenario measured: one JSON line and a few lines for a human."""

    scenario: str
    params: dict[str, Any]
    baseline: str  # what the ratios are against, in words
    headline: dict[str, float]  # the ratio (or ratios) the scenario exists for
    figures: dict[str, Any]
    summary: list[str]
    elapsed_s: float = 0.0

    def json_line(self, *, quick: bool, durable: bool, load_1m: float) -> str:
        record = {
            "scenario": self.scenario,
            "quick": quick,
            "durable_database": durable,
            "relayd_version": relayd.__version__,
            "cpus": os.cpu_count(),
            "load_1m_at_start": round(load_1m, 2),
            "elapsed_s": round(self.elapsed_s, 1),
            "params": self.params,
            "baseline": self.baseline,
            "headline": self.headline,
            "figures": self.figures,
        }
        return json.dumps(_finite(record), separators=(",", ":"))


def _finite(value: Any) -> Any:
    """JSON has no NaN: a figure that could not be computed is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
