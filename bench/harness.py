"""What every scenario of `python -m bench` shares: one embedded PostgreSQL and one OJS
emulator process per run, outbox tables filled by SQL, `relayd run` processes started and
stopped through their public surface, and the emulator's control API. What they measure and
print is in bench/measure.py.

Only public surfaces of relayd are used here: `relay_process` and `emulator_process`, the
`relayd pause`/`resume` commands, `connect_and_migrate`, SQL on the outbox table, relayd's
/readyz and /metrics, and the emulator's control API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import asyncpg

from bench.measure import BenchError, Drain, pg_cpu_s, ppid, process_cpu_s
from bench.settings import relay_settings
from relayd.core.rows import OutboxTable
from relayd.store.migrations import connect_and_migrate
from relayd.testing.postgres import EmbeddedPostgres
from relayd.testing.processes import await_http, emulator_process, free_port, relay_process

SCHEMA = "bench"
# Rows per INSERT of a fill: one transaction each, so that a multi-million-row fill neither
# holds one huge transaction nor takes minutes of round trips.
FILL_CHUNK = 500_000
# How often a drain asks PostgreSQL whether rows are left. The question (`any_pending`)
# reads the first live entry of a partial index of pending rows, a fraction of a
# millisecond: the observer costs next to nothing, and the end of a drain is seen within
# this. (Not under a held snapshot: see horizon.py.)
POLL_S = 0.05
# How often the emulator forgets its jobs during a measurement (see sink_kept_small): half a
# second's worth at most, a few thousand at `lag`'s 5,000 rows/s. The emulator's pauses
# (its garbage collector's, and forgetting itself) grow with what it holds; at 2 s they
# were 6-21 ms and made most of `lag`'s p99 (bench/README.md, "The sink").
SINK_RESET_S = 0.5

# The rows every scenario but `lag` relays, made by PostgreSQL (ids from relayd_uuidv7(),
# installed by the migration): a business payload in five types, then what the kind of
# envelope adds (`<last>`: the rest of jsonb_build_object's arguments). `n` numbers the
# rows; `$1`..`$2` is the range of one statement.
ROWS_SQL = """
INSERT INTO {outbox} (event_id, job)
SELECT id,
       jsonb_build_object(
           'id', id,
           'type', 'bench.kind' || (n % 5),
           'args', jsonb_build_array(jsonb_build_object(
               'order_id', n, 'sku', 'sku-' || (n % 1000), 'quantity', n % 7 + 1,
               'note', 'a line of text the size of a typical business payload, 64 b')),
           <last>)
FROM (SELECT {schema}.relayd_uuidv7() AS id, n FROM generate_series($1::int, $2::int) AS n) AS s
"""
# OJS envelopes of about 230 bytes, in eight queues.
FILL_SQL = ROWS_SQL.replace("<last>", "'options', jsonb_build_object('queue', 'q' || (n % 8))")
# Domain events (the NATS sink's): the payload is the event's data, `meta` holds its schema
# version and its occurrence time.
EVENT_FILL_SQL = ROWS_SQL.replace(
    "<last>",
    "'meta', jsonb_build_object('version', 1, 'occurred_at', "
    "to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'))",
)


# --- the run: one PostgreSQL, one emulator -----------------------------------------------


@dataclass
class Bench:
    """The shared environment of one `python -m bench` run."""

    base: Path
    dsn: str
    sink_url: str
    quick: bool
    durable: bool  # PostgreSQL with fsync, synchronous commits and full-page writes on
    postmaster_pid: int
    emulator_pid: int
    keep: bool = False  # keep the directory (every process's log) after the run
    _tables: int = 0

    def table(self, name: str) -> OutboxTable:
        """A fresh outbox name: one per measurement, never reused within a run (relayd's
        migration ledger remembers a dropped table's name)."""
        self._tables += 1
        return OutboxTable.parse(f"{SCHEMA}.{name}_{self._tables}")

    def cpu_s(self, relays: Relays | None) -> tuple[float, float, float]:
        """CPU seconds so far of the relays (or this process, which runs the one-row loop),
        of PostgreSQL and of the emulator."""
        relay = relays.cpu_s() if relays is not None else time.process_time()
        return relay, pg_cpu_s(self.postmaster_pid), process_cpu_s(self.emulator_pid)

    def relay_dir(self, name: str) -> Path:
        """A directory for one relay process's config and log, kept until the run ends."""
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@contextlib.asynccontextmanager
async def open_bench(*, quick: bool, keep: bool, durable: bool = True) -> AsyncIterator[Bench]:
    """Start the embedded PostgreSQL (`durable`: crash-safe, as production runs it; else a
    scratch server with fsync off) and the emulator; remove everything afterwards unless
    `keep` or `Bench.keep` (then the directory, with every process's log, is named on
    stderr)."""
    base = Path(tempfile.mkdtemp(prefix="relayd-bench-"))
    bench: Bench | None = None
    try:
        # Commit timestamps let `lag` split a row's wait at each commit (bench/lag.py).
        timed = {"track_commit_timestamp": "on"}
        with EmbeddedPostgres(base / "pg", durable=durable, startup_settings=timed) as pg:
            dsn = pg.dsn()
            async with emulator_process(base) as sink_url:
                conn = await asyncpg.connect(dsn)
                try:
                    # A backend's parent is the postmaster, whose tree is the server's CPU.
                    postmaster = ppid(await conn.fetchval("SELECT pg_backend_pid()"))
                finally:
                    await conn.close()
                emulator = _child_listening_on(sink_url.rsplit(":", 1)[1])
                bench = Bench(base, dsn, sink_url, quick, durable, postmaster, emulator, keep=keep)
                yield bench
    finally:
        if keep or (bench is not None and bench.keep):
            print(f"bench: logs kept in {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


def _child_listening_on(port: str) -> int:
    """The pid of this process's child `relayd emulator --listen 127.0.0.1:<port>`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if ppid(int(entry.name)) != os.getpid():
                continue
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"emulator" in argv and f"127.0.0.1:{port}".encode() in argv:
            return int(entry.name)
    raise BenchError(f"cannot find the emulator process listening on port {port}")


# --- outbox tables ------------------------------------------------------------------------


async def new_outbox(bench: Bench, name: str) -> OutboxTable:
    """An empty, migrated outbox table (what `relayd migrate` makes)."""
    table = bench.table(name)
    await connect_and_migrate(bench.dsn, table)
    return table


async def drop_outbox(bench: Bench, table: OutboxTable) -> None:
    """Drop a scenario's table: a multi-million-row outbox is gigabytes of disk."""
    conn = await asyncpg.connect(bench.dsn)
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {table.qualified}")
    finally:
        await conn.close()


async def fill(
    conn: asyncpg.Connection,
    table: OutboxTable,
    numbers: range,
    *,
    chunk: int = FILL_CHUNK,
    rows_sql: str = FILL_SQL,
) -> None:
    """The rows numbered `numbers` (a range of step 1) of `rows_sql` (FILL_SQL's form),
    pending and due now, `chunk` rows per statement (and transaction: the rows of one share
    their created_at)."""
    sql = rows_sql.format(outbox=table.qualified, schema=table.quoted_schema)
    for start in range(numbers.start, numbers.stop, chunk):
        await conn.execute(sql, start, min(start + chunk, numbers.stop) - 1)


async def filled_outbox(
    bench: Bench, name: str, rows: int, chunk: int = FILL_CHUNK, rows_sql: str = FILL_SQL
) -> OutboxTable:
    """A new outbox holding `rows` pending rows (of `rows_sql`), analyzed (as autovacuum
    would soon)."""
    table = await new_outbox(bench, name)
    conn = await asyncpg.connect(bench.dsn)
    try:
        await fill(conn, table, range(1, rows + 1), chunk=chunk, rows_sql=rows_sql)
        await conn.execute(f"ANALYZE {table.qualified}")
    finally:
        await conn.close()
    return table


async def stored_rows(
    bench: Bench, name: str, rows: int, rows_sql: str = FILL_SQL
) -> list[asyncpg.Record]:
    """The `event_id` and `job` (as text) of `rows` rows of `rows_sql`, as an outbox would
    store them (filled into a table of their own, read, dropped): what a baseline sends
    without any outbox."""
    table = await filled_outbox(bench, name, rows, rows_sql=rows_sql)
    conn = await asyncpg.connect(bench.dsn)
    try:
        stored: list[asyncpg.Record] = await conn.fetch(
            f"SELECT event_id::text AS event_id, job::text AS job FROM {table.qualified}"
        )
    finally:
        await conn.close()
    await drop_outbox(bench, table)
    return stored


async def count_pending(conn: asyncpg.Connection, table: OutboxTable) -> int:
    count: int = await conn.fetchval(
        f"SELECT count(*) FROM {table.qualified} WHERE published_at IS NULL AND dead_at IS NULL"
    )
    return count


async def count_published(conn: asyncpg.Connection, table: OutboxTable) -> int:
    count: int = await conn.fetchval(
        f"SELECT count(*) FROM {table.qualified} WHERE published_at IS NOT NULL"
    )
    return count


async def any_pending(conn: asyncpg.Connection, table: OutboxTable) -> bool:
    found: bool = await conn.fetchval(
        f"SELECT EXISTS (SELECT 1 FROM {table.qualified} "
        "WHERE published_at IS NULL AND dead_at IS NULL)"
    )
    return found


async def average_envelope_bytes(conn: asyncpg.Connection, table: OutboxTable) -> int:
    """The mean size of the envelopes relayd sends (of the first 1,000 rows)."""
    value = await conn.fetchval(
        f"SELECT avg(octet_length(job::text)) FROM (SELECT job FROM {table.qualified} "
        "LIMIT 1000) AS s"
    )
    return round(value or 0)


# --- relayd processes ---------------------------------------------------------------------


@dataclass
class Relay:
    """One running `relayd run`."""

    process: asyncio.subprocess.Process
    metrics_port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_s(self) -> float:
        return process_cpu_s(self.pid)

    def last_log_line(self) -> str:
        return last_line(self.log)

    def warnings(self) -> dict[str, int]:
        """The events this process logged at warning or above, by name: a measurement
        during which relayd met trouble (the breaker opened, the database went away) is
        suspect, and says so in its figures."""
        counts: dict[str, int] = {}
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return counts
        for line in text.splitlines():
            start = line.find("{")  # after a journald priority prefix, if any
            try:
                record = json.loads(line[start:]) if start >= 0 else None
            except ValueError:
                record = None
            if not isinstance(record, dict):
                if line.strip():  # not relayd's JSON: a traceback, a library's print
                    counts["(not JSON)"] = counts.get("(not JSON)", 0) + 1
                continue
            if str(record.get("level", "")).lower() in {"warning", "error", "critical"}:
                name = str(record.get("event", "?"))
                counts[name] = counts.get(name, 0) + 1
        return counts


@dataclass
class Relays:
    """The relay processes of one measurement, all ready."""

    bench: Bench
    table: OutboxTable
    members: list[Relay]

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.members]

    def cpu_s(self) -> float:
        return sum(r.cpu_s() for r in self.members)

    def warnings(self) -> dict[str, int]:
        """Relay.warnings() summed over the processes."""
        counts: dict[str, int] = {}
        for relay in self.members:
            for name, count in relay.warnings().items():
                counts[name] = counts.get(name, 0) + count
        return counts

    def check_alive(self, doing: str) -> None:
        for relay in self.members:
            code = relay.process.returncode
            if code is not None:
                raise BenchError(
                    f"relayd (pid {relay.pid}) exited with code {code} during {doing}: "
                    f"{relay.last_log_line()}"
                )

    async def published_by_metrics(self, http: aiohttp.ClientSession) -> int | None:
        """Rows settled as published (or reconciled) by these processes, from /metrics;
        None if a process does not expose the counter."""
        total = 0
        for relay in self.members:
            async with http.get(f"http://127.0.0.1:{relay.metrics_port}/metrics") as response:
                text = await response.text()
            value = published_counter(text)
            if value is None:
                return None
            total += value
        return total

    async def drain(
        self, *, cpu_rows: int, timeout_s: float, ledger: bool = False, emulator: bool = True
    ) -> Drain:
        """Resume the paused outbox and time its drain to the last row.

        The relays were started paused (`paused_relays`), so that every one of them is
        running when the clock starts. The rows timed are those still pending once the
        resume has returned: rows taken in the instant between the resume's commit and its
        command's exit are not counted, so the rate is not flattered. CPU is read from just
        before the resume to the end, over every row (`cpu_rows`): the relays are idle,
        paused, before it. With `ledger`, the emulator keeps every job (to be checked
        afterwards) instead of being reset as it goes (`sink_kept_small`); without
        `emulator` (the relays publish elsewhere), it is left alone.
        """
        conn = await asyncpg.connect(self.bench.dsn)
        try:
            async with sink_kept_small(self.bench, enabled=emulator and not ledger):
                cpu0 = self.bench.cpu_s(self)
                await relayd_command(self.bench, self.table, "resume", "--reason", "bench: go")
                before = time.perf_counter()
                rows = await count_pending(conn, self.table)
                started = (before + time.perf_counter()) / 2  # the count saw an instant in there
                await wait_drained(conn, self, timeout_s)
                seconds = time.perf_counter() - started
                cpu1 = self.bench.cpu_s(self)
            await require_no_dead_letters(conn, self.table)
        finally:
            await conn.close()
        relay, pg, sink = (b - a for a, b in zip(cpu0, cpu1, strict=True))
        return Drain(rows, seconds, cpu_rows, relay, pg, sink, self.warnings())


@contextlib.asynccontextmanager
async def start_relays(
    bench: Bench,
    table: OutboxTable,
    key: str,
    count: int = 1,
    sink: Mapping[str, str] | None = None,
) -> AsyncIterator[Relays]:
    """`count` `relayd run` processes on `table` with the settings of `key`
    (bench/settings.py), started concurrently; yields once every one answers /readyz (its
    workers are running), stops them all (SIGTERM: they drain) on exit. The sink is the
    emulator unless `sink` gives the RELAYD_SINK__* variables of another."""
    env = relay_settings(key) | {"RELAYD_OUTBOX__TABLE": str(table)} | dict(sink or {})
    sink_url = bench.sink_url if sink is None else None
    ports = _distinct_ports(count)
    async with contextlib.AsyncExitStack() as stack:

        async def one(index: int) -> Relay:
            directory = bench.relay_dir(f"{table.name}-relay{index}")
            port = ports[index]
            try:
                process = await stack.enter_async_context(
                    relay_process(directory, bench.dsn, sink_url, port, **env)
                )
                await await_http(f"http://127.0.0.1:{port}/readyz", process)
            except (RuntimeError, TimeoutError) as exc:
                said = last_line(directory / "relayd.log")
                raise BenchError(
                    f"relayd did not start on {table}: {exc or 'not ready in time'}: {said}"
                ) from None
            return Relay(process, port, directory / "relayd.log")

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i)) for i in range(count)]
        except* BenchError as failed:
            raise failed.exceptions[0] from None
        yield Relays(bench, table, [task.result() for task in tasks])


@contextlib.asynccontextmanager
async def paused_relays(
    bench: Bench,
    table: OutboxTable,
    key: str,
    count: int = 1,
    sink: Mapping[str, str] | None = None,
) -> AsyncIterator[Relays]:
    """`start_relays` on a paused outbox (`relayd pause`): nothing is claimed until
    `Relays.drain()` resumes it, so no process starts ahead of the others and start-up is
    not timed."""
    await relayd_command(bench, table, "pause", "--reason", "bench: start every relay first")
    async with start_relays(bench, table, key, count, sink) as relays:
        yield relays


class Draining(Protocol):
    """What `wait_drained` needs of the relays it waits for (`Relays`, or a bare relay)."""

    @property
    def table(self) -> OutboxTable: ...

    def check_alive(self, doing: str) -> None: ...


async def wait_drained(conn: asyncpg.Connection, relays: Draining, timeout_s: float) -> None:
    """Return once no row of the relays' table is pending; BenchError if a relay exits or
    the drain takes longer than `timeout_s`."""
    deadline = time.perf_counter() + timeout_s
    # The state lives in PostgreSQL, which cannot signal this loop: poll.
    while await any_pending(conn, relays.table):
        relays.check_alive(f"the drain of {relays.table}")
        if time.perf_counter() > deadline:
            left = await count_pending(conn, relays.table)
            raise BenchError(f"{relays.table}: {left:,} rows still pending after {timeout_s:.0f} s")
        await asyncio.sleep(POLL_S)


async def require_no_dead_letters(conn: asyncpg.Connection, table: OutboxTable) -> None:
    """A drain that dead-lettered rows did not publish them: its rate would be a lie."""
    dead = await conn.fetch(
        f"SELECT dead_reason, count(*) AS n FROM {table.qualified} WHERE dead_at IS NOT NULL "
        "GROUP BY dead_reason ORDER BY n DESC"
    )
    if dead:
        reasons = ", ".join(f"{r['n']:,} {r['dead_reason']}" for r in dead)
        raise BenchError(f"{table}: rows were dead-lettered, not published ({reasons})")


def drain_timeout_s(rows: int) -> float:
    """Generous: a drain slower than 100 rows/s is broken, not slow."""
    return 120.0 + rows / 100


async def relayd_command(bench: Bench, table: OutboxTable, *args: str) -> None:
    """Run an operator command (`relayd pause ...`) on `table`; BenchError if it fails."""
    config = bench.base / "operator.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYD_")} | {
        "RELAYD_CONFIG": str(config),
        "RELAYD_DATABASE__DSN": bench.dsn,
        "RELAYD_OUTBOX__TABLE": str(table),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relayd",
        *args,
        "--actor",
        "bench",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await process.communicate()
    if process.returncode != 0:
        said = stderr.decode(errors="replace").strip().splitlines()
        raise BenchError(
            f"relayd {args[0]} on {table} exited with code {process.returncode}: "
            f"{said[-1] if said else '(nothing on stderr)'}"
        )


def published_counter(metrics_text: str) -> int | None:
    """relayd_outcomes_total for published and reconciled rows, from /metrics text; None
    when the family is missing (a family without samples yet counts 0)."""
    found = False
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE relayd_outcomes "):
            found = True
        elif line.startswith("relayd_outcomes_total{") and (
            'outcome="published"' in line or 'outcome="reconciled"' in line
        ):
            found = True
            total += float(line.rsplit(" ", 1)[-1])
    return round(total) if found else None


def last_line(log: Path) -> str:
    """The last line of a log, for a one-line error."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


def _distinct_ports(count: int) -> list[int]:
    """`count` free loopback ports, no two alike (free_port alone may repeat itself)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


# --- the emulator ------------------------------------------------------------------------


async def reset_emulator(bench: Bench, http: aiohttp.ClientSession | None = None) -> None:
    """Forget every job: each measurement starts on an empty sink, and a long drain does not
    grow the emulator's memory without bound. `http`: a session to reuse (see
    sink_kept_small); a new one costs this process milliseconds of CPU."""
    if http is None:
        async with aiohttp.ClientSession() as own:
            await reset_emulator(bench, own)
        return
    async with http.post(f"{bench.sink_url}/_emulator/reset") as r:
        if r.status != 200:
            raise BenchError(f"the emulator's reset answered HTTP {r.status}")


@contextlib.asynccontextmanager
async def sink_kept_small(bench: Bench, enabled: bool = True) -> AsyncIterator[None]:
    """While inside, reset the emulator every SINK_RESET_S. It keeps every job it was sent
    in one Python heap, and its cost per request grows with that heap (the garbage
    collector walks it): without this, a long drain slows down because of the sink, and a
    measurement at a high rate pays more per row than one at a low rate. Only where the
    ledger is not read afterwards."""
    if not enabled:
        yield
        return

    async def janitor() -> None:
        # One session for every reset: this process also runs `lag`'s producers, and a new
        # session (its TLS context, its connection) would stall them every SINK_RESET_S.
        async with aiohttp.ClientSession() as http:
            while True:
                await asyncio.sleep(SINK_RESET_S)
                await reset_emulator(bench, http)

    task = asyncio.create_task(janitor())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def ledger(bench: Bench) -> dict[str, Any]:
    """The emulator's ledger: per job id, how many times it was created, posted, ..."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.get(f"{bench.sink_url}/_emulator/ledger") as r,
    ):
        if r.status != 200:
            raise BenchError(f"the emulator's ledger answered HTTP {r.status}")
        body: dict[str, Any] = await r.json()
    jobs: dict[str, Any] = body["jobs"]
    return jobs
