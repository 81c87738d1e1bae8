"""What the tests share: the test database's types, the in-process relay helpers, a
pure-test claimed row, `relayd` run as a child process (its environment and its command
line, one of each), and a TCP proxy that cuts PostgreSQL away. Helpers and types only: the
fixtures stay in the conftest.py files (pytest finds them there) and import from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg
import pytest

from relayd.core.rows import ClaimedRow, OutboxTable
from relayd.daemon.lifecycle import Daemon
from relayd.producer import enqueue_many, new_job, uuid7
from relayd.settings import Settings
from relayd.sinks.ojs.settings import OjsSettings
from relayd.telemetry.metrics import RelayMetrics
from relayd.telemetry.tracing import RelayTracing
from relayd.testing.emulator import RunningEmulator

# --- the test database ------------------------------------------------------------------

DEFAULT_TABLE = OutboxTable.parse("relayd.outbox")


def dsn_for(server_dsn: str, database: str) -> str:
    """The same server, another database."""
    parts = urlsplit(server_dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


def secret_dsn(dsn: str, query: str = "") -> str:
    """`dsn` with the password `hunter2`, which must never show (trust auth ignores it), and
    `query` appended (the embedded server's DSN already has one: ?host=<socket directory>)."""
    dsn = re.sub(r"://([^:@/]+)(?::[^@/]*)?@", r"://\1:hunter2@", dsn, count=1)
    if not query:
        return dsn
    return f"{dsn}{'&' if '?' in dsn else '?'}{query}"


@dataclass(frozen=True)
class PgServer:
    admin_dsn: str
    template: str

    def dsn(self, database: str) -> str:
        return dsn_for(self.admin_dsn, database)


@dataclass(frozen=True)
class Database:
    """One test's private database, already migrated for `relayd.outbox`."""

    name: str
    dsn: str
    table: OutboxTable = DEFAULT_TABLE


# --- the relay, in-process against the emulator -----------------------------------------

# Fast timings so tests finish quickly; every relation the design needs still holds
# (lease > 2 x attempt deadline).
FAST: dict[str, dict[str, Any]] = {
    "relay": {
        "workers": 4,
        "batch_size": 50,
        "lease_s": 10.0,
        "poll_interval_s": 0.5,
        "shutdown_grace_s": 2.0,
    },
    "sink": {"timeout_s": 2.0, "connect_timeout_s": 1.0, "concurrency": 16},
    "retry": {
        "base_s": 0.02,
        "cap_s": 0.2,
        "max_attempts": 5,
        "breaker_threshold": 5,
        "breaker_cooldown_s": 0.05,
    },
    "http": {"enabled": False},
    "cleanup": {"enabled": False},
    "log": {"level": "warning", "format": "json"},
}


def ojs_settings(settings: Settings) -> OjsSettings:
    """`settings.sink`, which a test expects to be of the OJS kind."""
    assert isinstance(settings.sink, OjsSettings), settings.sink.kind
    return settings.sink


def relay_settings(dsn: str, sink_url: str, **sections: dict[str, Any]) -> Settings:
    """Settings for an in-process relay: FAST, overridden section by section."""
    merged: dict[str, dict[str, Any]] = {name: dict(values) for name, values in FAST.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    merged.setdefault("database", {})["dsn"] = dsn
    merged["sink"]["url"] = sink_url
    return Settings(**merged)  # type: ignore[arg-type]


def sink_settings(dsn: str, sink: Mapping[str, Any], **sections: Mapping[str, Any]) -> Settings:
    """Settings for an in-process relay of any sink kind: FAST, the database at `dsn`,
    `[sink]` as `sink` says over FAST's timeouts and concurrency, then `sections`, each over
    FAST's section of that name."""
    merged: dict[str, dict[str, Any]] = {name: dict(values) for name, values in FAST.items()}
    merged["database"] = {"dsn": dsn}
    merged["sink"] |= sink
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return Settings(**merged)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(settings: Settings, *, seed: int = 1) -> AsyncIterator[Daemon]:
    """A relay daemon running in this event loop; drained and awaited on exit."""
    daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(seed))
    task = asyncio.create_task(daemon.run(), name="daemon-under-test")
    ready = asyncio.create_task(daemon.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if task.done():
        task.result()  # raise what startup raised
        raise AssertionError("the daemon exited during startup")
    try:
        yield daemon
    finally:
        daemon.stop()
        code = await task
        assert code == 0, f"daemon exit code {code}"


async def run_until_idle(
    settings: Settings,
    *,
    seed: int = 1,
    timeout_s: float = 60.0,
    tracing: RelayTracing | None = None,
) -> Daemon:
    """Run a relay daemon until nothing is pending (every row published or dead-lettered),
    then return it (for its metrics) once it drained and exited 0; `tracing`: its spans."""
    daemon = Daemon(
        settings, metrics=RelayMetrics(), rng=random.Random(seed), until_idle=True, tracing=tracing
    )
    async with asyncio.timeout(timeout_s):
        code = await daemon.run()
    assert code == 0, f"daemon exit code {code}"
    return daemon


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout_s: float = 30.0) -> None:
    """Await until `check()` holds, re-checking every 20 ms; fail after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        # The state lives in PostgreSQL, which cannot signal this loop: poll under a deadline.
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def produce(
    conn: asyncpg.Connection, count: int, *, job_type: str = "test.echo", **job: Any
) -> list[str]:
    """Commit `count` outbox rows the way an application would; returns their ids."""
    jobs = [new_job(job_type, [{"n": i}], **job) for i in range(count)]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    return [str(j["id"]) for j in jobs]


async def pending(conn: asyncpg.Connection) -> int:
    """How many rows are neither published nor dead-lettered."""
    value: int = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE published_at IS NULL AND dead_at IS NULL"
    )
    return value


async def drained(conn: asyncpg.Connection) -> bool:
    """Nothing is pending."""
    return await pending(conn) == 0


async def rows_in_every_state(conn: asyncpg.Connection) -> dict[str, list[str]]:
    """Commit 14 rows and move them, in SQL, into every state the backlog knows; returns
    their ids by state. Ages are set relative to now(): the `mail` rows have been claimable
    for 1000 s, the oldest `orders` row for 100 s; the oldest pending row (scheduled) was
    created 5000 s ago, a published one 9000 s ago."""
    orders = await produce(conn, 12, queue="orders")
    mail = await produce(conn, 2, job_type="mail.send", queue="mail")
    ids = {
        "ready": orders[0:3] + mail,  # orders[1]: a lease that expired, claimable again
        "scheduled": orders[3:6],
        "leased": orders[6:8],
        "dead": orders[8:10],
        "discarded": orders[10:11],
        "published": orders[11:12],
    }
    moves = [
        ("available_at = now() - interval '100 s'", orders[0:1]),
        ("available_at = now() - interval '5 s', lease_owner = gen_random_uuid()", orders[1:2]),
        ("available_at = now() - interval '1000 s'", mail),
        ("available_at = now() + interval '60 s', attempts = 1", ids["scheduled"]),
        ("created_at = now() - interval '5000 s'", orders[3:4]),
        (
            "available_at = now() + interval '30 s', lease_owner = gen_random_uuid(), attempts = 1",
            ids["leased"],
        ),
        ("dead_at = now(), dead_reason = 'conflict'", orders[8:9]),
        ("dead_at = now(), dead_reason = 'sink_rejected'", orders[9:10]),
        (
            "dead_at = now(), dead_reason = 'conflict', discarded_at = now(), "
            "discard_reason = 'test'",
            ids["discarded"],
        ),
        ("published_at = now(), created_at = now() - interval '9000 s'", ids["published"]),
    ]
    for assignments, rows in moves:
        await conn.execute(
            f"UPDATE relayd.outbox SET {assignments} WHERE event_id = ANY($1::uuid[])", rows
        )
    return ids


async def insert_keyed(
    conn: asyncpg.Connection, key: str | None, n: int = 1, *, job_type: str = "test.echo"
) -> list[str]:
    """Commit `n` rows of ordered key `key` by plain SQL, in one transaction (the key's
    trigger numbers them in that order); their ids in insert order."""
    ids = []
    async with conn.transaction():
        for i in range(n):
            job = new_job(job_type, [{"n": i}])
            await conn.execute(
                "INSERT INTO relayd.outbox (event_id, job, ordering_key) VALUES ($1, $2, $3)",
                job["id"],
                json.dumps(job),
                key,
            )
            ids.append(str(job["id"]))
    return ids


async def park_key(  # noqa: PLR0913 - what the parked key looks like, each by keyword
    conn: asyncpg.Connection,
    key: str,
    rows: int = 3,
    *,
    job_type: str = "order.fulfill",
    reason: str = "max_attempts",
    error: str = "503 Service Unavailable: inventory-db is down",
    attempts: int = 5,
    parked_for: str = "2 hours",
) -> list[str]:
    """Commit `rows` rows of `key` and park the key as settle_parked leaves it after its
    head's last attempt: the head pending at available_at 'infinity' with its attempts and
    last_error, and the key's row in relayd_parked_keys (parked `parked_for` ago). Returns
    the rows' ids in key order; the first is the head."""
    ids = await insert_keyed(conn, key, rows, job_type=job_type)
    async with conn.transaction():
        await conn.execute(
            "UPDATE relayd.outbox SET attempts = $2, last_error = $3, available_at = 'infinity', "
            "last_attempt_at = now() - $4::text::interval, lease_owner = NULL "
            "WHERE event_id = $1",
            ids[0],
            attempts,
            error,
            parked_for,
        )
        await conn.execute(
            "INSERT INTO relayd.relayd_parked_keys "
            "(outbox_table, ordering_key, event_id, type, reason, error, parked_at) "
            "VALUES ('relayd.outbox', $1, $2, $3, $4, $5, now() - $6::text::interval)",
            key,
            ids[0],
            job_type,
            reason,
            error,
            parked_for,
        )
    return ids


def claimed(job_bytes: int = 0, **job: Any) -> ClaimedRow:
    """A claimed row for pure tests; `job_bytes` pads args to about that size."""
    event_id = uuid7()
    body: dict[str, Any] = {"id": event_id, "type": "t.x", "args": []} | job
    if job_bytes:
        filler = max(job_bytes - len(json.dumps(body)) - 4, 0)
        body["args"] = ["x" * filler]
    return ClaimedRow(
        event_id=event_id,
        job=json.dumps(body).encode(),
        attempts=1,
        previous_attempt_at=None,
        age_s=0.0,
    )


# --- relayd as a child process: `python -m relayd ARGS` --------------------------------


def relayd_env(
    settings: Mapping[str, str] | None = None, *, keep: Iterable[str] = ()
) -> dict[str, str]:
    """What a `relayd` child process gets: this environment less its RELAYD_* variables (no
    setting of the developer's shell leaks into a test), bar those named in `keep`, then
    `settings`."""
    kept = set(keep)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYD_") or k in kept}
    return env | dict(settings or {})


def clear_relayd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test, this process's environment as `relayd_env` gives it to a child: no
    RELAYD_* variable."""
    for key in os.environ.keys() - relayd_env().keys():
        monkeypatch.delenv(key)


def relayd_argv(*args: str, switched: bool = False) -> list[str]:
    """`relayd ARGS` run by this interpreter; `switched`: through the test launcher, which
    installs the failpoints and mutant its environment names (tests/faults/switches/launch.py)."""
    if not switched:
        return [sys.executable, "-m", "relayd", *args]
    # The launcher is part of the test suite, not of the package: it is found from this
    # checkout, whatever the child's working directory.
    return [sys.executable, "-c", _LAUNCH, *args]


_LAUNCH = (
    f"import runpy, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
    "runpy.run_module('tests.faults.switches.launch', run_name='__main__', alter_sys=True)"
)


async def start_relayd(
    *args: str,
    env: Mapping[str, str],
    stdout: int | IO[Any] | None = asyncio.subprocess.PIPE,
    stderr: int | IO[Any] | None = asyncio.subprocess.PIPE,
) -> asyncio.subprocess.Process:
    """Start `relayd ARGS` as a process (its output piped unless told otherwise)."""
    return await asyncio.create_subprocess_exec(
        *relayd_argv(*args), env=env, stdout=stdout, stderr=stderr
    )


async def run_relayd(
    *args: str, env: dict[str, str], timeout_s: float = 60.0
) -> tuple[int, str, str]:
    """Run `relayd ARGS` as a process without blocking this event loop (a relay or an
    emulator may run in it); (exit code, stdout, stderr)."""
    process = await start_relayd(*args, env=env)
    out, err = await asyncio.wait_for(process.communicate(), timeout=timeout_s)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def run_relayd_blocking(
    *args: str, env: dict[str, str], cwd: Path | None = None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run `relayd ARGS` as a process and wait for it, blocking (nothing else runs meanwhile)."""
    return subprocess.run(
        relayd_argv(*args),
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


# --- the emulator's own tests -----------------------------------------------------------

# The `start` fixture: start an emulator with a config (None: the spec's defaults).
StartEmulator = Callable[..., Awaitable[RunningEmulator]]


# --- a TCP path to PostgreSQL that a test can cut ---------------------------------------


class TcpProxy:
    """A TCP proxy a test can cut and restore: PostgreSQL "goes away" without stopping it.

    It listens on 127.0.0.1 and forwards to a TCP address or a Unix socket (the embedded
    server listens on a socket only). `cut()` closes every connection and stops listening,
    so new connections are refused; `restore()` listens again on the same port.
    `reply_delay_s` holds back what the server sends (in order, each chunk by the delay in
    force when it arrived): a slow link, or a server whose answers arrive after the client
    gave up on them. `hold_replies_with(markers)` holds, on each connection, the first answer
    holding one of `markers` (an event id's bytes, say) and everything after it, until
    `release()`: one statement's answer arrives when the test says so, not after a guess.
    """

    def __init__(
        self, *, host: str | None = None, port: int | None = None, unix_path: str | None = None
    ) -> None:
        self._target_host, self._target_port, self._unix_path = host, port, unix_path
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self.port = 0
        self.reply_delay_s = 0.0
        self._markers: tuple[bytes, ...] = ()
        self._released = asyncio.Event()
        self._released.set()

    @classmethod
    def for_dsn(cls, dsn: str) -> TcpProxy:
        """A proxy in front of the server of `dsn` (start it, then use `dsn_through`)."""
        parts = urlsplit(dsn)
        socket_dir = parse_qs(parts.query).get("host", [""])[0]
        if socket_dir.startswith("/"):
            port = parts.port or 5432
            proxy = cls(unix_path=str(Path(socket_dir) / f".s.PGSQL.{port}"))
        else:
            proxy = cls(host=parts.hostname or "127.0.0.1", port=parts.port or 5432)
        return proxy

    def dsn_through(self, dsn: str) -> str:
        """`dsn` rewritten to connect through this proxy."""
        parts = urlsplit(dsn)
        user = parts.username or "postgres"
        auth = f"{user}:{parts.password}@" if parts.password else f"{user}@"
        return urlunsplit((parts.scheme, f"{auth}127.0.0.1:{self.port}", parts.path, "", ""))

    def hold_replies_with(self, markers: Iterable[bytes]) -> None:
        """Hold every connection's answers from the first chunk holding a marker on."""
        self._markers = tuple(markers)
        self._released.clear()

    def release(self) -> None:
        """Deliver what is held, in order; hold nothing more."""
        self._markers = ()
        self._released.set()

    def _holds(self, seen: bytes) -> bool:
        return any(marker in seen for marker in self._markers)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._unix_path is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self._unix_path)
            else:
                assert self._target_host is not None
                assert self._target_port is not None
                up_reader, up_writer = await asyncio.open_connection(
                    self._target_host, self._target_port
                )
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump_delayed(up_reader, writer)),
        ]
        self._pumps.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._pumps.difference_update(pumps)
        for end in (writer, up_writer):
            end.transport.abort()
            self._writers.discard(end)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    async def _pump_delayed(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Forward the server's bytes, each chunk `reply_delay_s` after it arrived, and from
        a chunk holding a marker on, only once released."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes, bool]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data, held = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(due - loop.time(), 0.0))
                if held:
                    await self._released.wait()
                writer.write(data)
                await writer.drain()

        delivering = asyncio.create_task(deliver())
        holding, tail = False, b""
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await reader.read(65536):
                    # The tail of the chunk before: a marker split between two reads counts.
                    holding = bool(self._markers) and (holding or self._holds(tail + data))
                    tail = data[-64:]
                    queue.put_nowait((loop.time() + self.reply_delay_s, data, holding))
                queue.put_nowait((loop.time(), b"", False))
                await delivering
        finally:
            delivering.cancel()
            await asyncio.gather(delivering, return_exceptions=True)
            writer.transport.abort()


def dsn_as(dsn: str, role: str) -> str:
    """`dsn` logging in as `role` (trust authentication: no password)."""
    return re.sub(r"://[^:@/]+(?::[^@/]*)?@", f"://{role}@", dsn, count=1)


class SinkHealthRecord:
    """Where an OjsSink reports its exchanges (the breaker, in the daemon): counted here,
    with each failure's severity and reason. `ok` counts rows the sink stored."""

    def __init__(self) -> None:
        self.ok = 0
        self.answered = 0
        self.failed = 0
        self.severities: list[bool] = []
        self.reasons: list[str] = []
        self.reconnects = 0

    def sink_accepted(self) -> None:
        self.ok += 1

    def sink_answered(self) -> None:
        self.answered += 1

    def sink_failed(self, *, severe: bool, reason: str) -> None:
        self.failed += 1
        self.severities.append(severe)
        self.reasons.append(reason)

    def sink_reconnected(self) -> None:
        self.reconnects += 1
