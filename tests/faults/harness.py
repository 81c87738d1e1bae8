"""The fault scenarios' stage: real `relayd run` processes and `relayd emulator` in its own
process, on a test database, with the knobs a scenario turns (failpoints, signals, faults
scripted on the sink, leases expired in SQL) and the history checker at the end.

A scenario reads as: produce rows, start relays (some armed to fail), let the fault happen,
heal (kill, continue, clear faults, start a clean relay), wait for the outbox to drain, and
`await scene.check()`. Every process logs to its own file under the test's tmp_path; a
violation's report names the ids with their timelines, and the logs are there to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from relayd.core.rows import OutboxTable
from relayd.testing.processes import free_port
from tests.faults.checker import Report, assert_clean, check, install_history
from tests.support import DEFAULT_TABLE, produce, relayd_argv, relayd_env

_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 20.0
DRAIN_TIMEOUT_S = 60.0

# Every scenario's relay, unless it says otherwise: short leases and timeouts so that faults
# heal in seconds, quick retries, the full scan often, no retention (the checker reads every
# published row). lease_s must stay above 2 x sink.timeout_s.
FAST: Mapping[str, str] = {
    "RELAYD_RELAY__LEASE_S": "3",
    "RELAYD_SINK__TIMEOUT_S": "1",
    "RELAYD_SINK__CONNECT_TIMEOUT_S": "1",
    "RELAYD_RELAY__POLL_INTERVAL_S": "0.2",
    "RELAYD_RELAY__WORKERS": "2",
    "RELAYD_RELAY__BATCH_SIZE": "20",
    "RELAYD_RELAY__SHUTDOWN_GRACE_S": "3",
    "RELAYD_RELAY__FULL_SCAN_INTERVAL_S": "1",
    "RELAYD_RETRY__BASE_S": "0.05",
    "RELAYD_RETRY__CAP_S": "0.5",
    "RELAYD_RETRY__BREAKER_COOLDOWN_S": "0.3",
    "RELAYD_DATABASE__CONNECT_TIMEOUT_S": "2",
    "RELAYD_CLEANUP__ENABLED": "false",
    "RELAYD_METRICS__SAMPLE_INTERVAL_S": "1",
    "RELAYD_LOG__LEVEL": "info",
    "RELAYD_LOG__FORMAT": "json",
}


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """What a scenario's child process gets: this environment less its RELAYD_* settings
    (bar the two the suite passes on), then `extra`."""
    # A mutant (tests/faults/switches/mutants.py) selected for a negative control reaches every
    # relay.
    return relayd_env(extra, keep=("RELAYD_TEST_OJS_CONFORMANCE", "RELAYD_TEST_MUTANT"))


# What arms a process's failpoints and mutant: only the test launcher reads them.
TEST_SWITCHES = ("RELAYD_TEST_FAILPOINTS", "RELAYD_TEST_MUTANT")


async def await_ok(http: aiohttp.ClientSession, url: str, proc: Process) -> None:
    """Wait until `url` answers 200 while `proc` runs; fail with its output if it exits."""
    async with asyncio.timeout(_READY_TIMEOUT_S):
        while True:
            if proc.returncode is not None:
                raise AssertionError(
                    f"{proc.name} exited ({proc.returncode}) before {url} answered:\n"
                    + proc.log()[-4000:]
                )
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as answer:
                    if answer.status == 200:
                        return
            await asyncio.sleep(0.05)


@dataclass
class Process:
    """One child process of a scenario, logging to `log_path`."""

    name: str
    log_path: Path
    process: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def signal(self, signum: int) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signum)

    async def wait(self, timeout_s: float = _STOP_TIMEOUT_S) -> int:
        async with asyncio.timeout(timeout_s):
            return await self.process.wait()

    async def kill(self) -> int:
        """kill -9, and reap it."""
        self.signal(signal.SIGKILL)
        return await self.wait()

    async def stop(self) -> int:
        """SIGTERM (relayd drains), then SIGKILL if it takes too long; the exit code."""
        if self.process.returncode is None:
            self.signal(signal.SIGCONT)  # a stopped process cannot drain
            self.signal(signal.SIGTERM)
            try:
                return await self.wait()
            except TimeoutError:
                return await self.kill()
        return self.process.returncode

    def stopped(self) -> bool:
        """True while the process is stopped (SIGSTOP, or a `pause` failpoint)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def fired(
        self, point: str, *, times: int = 1, timeout_s: float = _READY_TIMEOUT_S
    ) -> None:
        """Wait until the process wrote that its failpoint `point` fired, `times` times."""
        await self.logged(f"failpoint {point}:", times=times, timeout_s=timeout_s)

    async def logged(
        self, text: str, *, times: int = 1, timeout_s: float = _READY_TIMEOUT_S
    ) -> None:
        """Wait until the process's output contains `text` (`times` times)."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.log().count(text) < times:  # noqa: ASYNC110 - a file cannot signal
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(
                f"{self.name} never wrote {text!r}; its output ends:\n{self.log()[-4000:]}"
            ) from None


@dataclass
class Sink:
    """`relayd emulator` in its own process, and its control API."""

    url: str
    proc: Process
    http: aiohttp.ClientSession

    async def faults(self, *rules: Mapping[str, Any]) -> None:
        """Script faults (the rule JSON of relayd.testing.emulator.faults), replacing none."""
        async with self.http.post(f"{self.url}/_emulator/faults", json=list(rules)) as answer:
            assert answer.status < 300, await answer.text()

    async def clear_faults(self) -> None:
        async with self.http.delete(f"{self.url}/_emulator/faults") as answer:
            assert answer.status < 300, await answer.text()

    async def arrivals(self) -> list[str]:
        """The ids of the jobs the sink stored, in the order it stored them."""
        async with self.http.get(f"{self.url}/_emulator/arrivals") as answer:
            assert answer.status == 200, await answer.text()
            arrivals: list[str] = (await answer.json())["arrivals"]
            return arrivals

    async def ledger(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/_emulator/ledger") as answer:
            assert answer.status == 200, await answer.text()
            ledger: dict[str, Any] = await answer.json()
            return ledger


@dataclass
class Scene:
    """A test database with the transition history installed, a sink, and relays."""

    base: Path
    dsn: str
    conn: asyncpg.Connection
    http: aiohttp.ClientSession
    table: str = str(DEFAULT_TABLE)
    sink: Sink | None = None
    processes: list[Process] = field(default_factory=list)
    # A deliberately broken relay (tests/faults/switches/mutants.py) for every relay started now on:
    # the negative controls of tests/faults/test_mutants.py.
    mutant: str | None = None

    @property
    def sql_table(self) -> str:
        """The outbox's name quoted for SQL."""
        return OutboxTable.parse(self.table).qualified

    # --- the processes ---

    async def start_sink(self, *options: str, failpoints: str | None = None) -> Sink:
        """Start the emulator (`relayd emulator OPTIONS`) and wait until it answers."""
        port = free_port()
        env = {"RELAYD_TEST_FAILPOINTS": failpoints} if failpoints else {}
        proc = await self._spawn(
            "sink", ["emulator", "--listen", f"127.0.0.1:{port}", *options], env
        )
        url = f"http://127.0.0.1:{port}"
        await self._await_ok(f"{url}/ojs/v1/health", proc)
        self.sink = Sink(url=url, proc=proc, http=self.http)
        return self.sink

    async def relay(
        self,
        name: str,
        *,
        failpoints: str | None = None,
        ready: bool = True,
        env: Mapping[str, str] | None = None,
        **settings: str,
    ) -> Process:
        """Start `relayd run` (FAST settings, then `env` and `settings` as RELAYD_*
        variables).

        With `ready`, wait until its /healthz answers; a relay armed to die early may exit
        first, so pass ready=False for those and wait on what the scenario expects.
        """
        port = free_port()
        env = self.relay_env(name, f"127.0.0.1:{port}", **{**(env or {}), **settings})
        if failpoints:
            env["RELAYD_TEST_FAILPOINTS"] = failpoints
        proc = await self._spawn(name, ["run"], env)
        if ready:
            await self._await_ok(f"http://127.0.0.1:{port}/healthz", proc)
        return proc

    def relay_env(self, name: str, http_listen: str, **settings: str) -> dict[str, str]:
        """The environment of relay `name`: FAST, this scene's database, sink, table and
        mutant, its HTTP listener, then `settings` (RELAYD_* variables, or any other)."""
        assert self.sink is not None, "start the sink first"
        config = self.base / f"{name}.toml"
        config.write_text("")
        env = dict(FAST) | {
            "RELAYD_CONFIG": str(config),
            "RELAYD_DATABASE__DSN": self.dsn,
            "RELAYD_SINK__URL": self.sink.url,
            "RELAYD_OUTBOX__TABLE": self.table,
            "RELAYD_HTTP__LISTEN": http_listen,
        }
        if self.mutant:
            env["RELAYD_TEST_MUTANT"] = self.mutant
        return env | settings

    async def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> Process:
        """Start `argv` (any command: relayd under a wrapper, a helper) logging to
        `<name>.log`; it is killed at the end like every process of the scene."""
        log_path = self.base / f"{name}.log"
        with log_path.open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                *argv,
                env=child_env(env),
                stdout=log,
                stderr=log,
                stdin=asyncio.subprocess.DEVNULL,
            )
        proc = Process(name=name, log_path=log_path, process=process)
        self.processes.append(proc)
        return proc

    async def _spawn(self, name: str, args: list[str], env: Mapping[str, str]) -> Process:
        """`relayd ARGS` as process `name`, through the test launcher if its environment
        arms a failpoint or a mutant."""
        switched = any(child_env(env).get(key) for key in TEST_SWITCHES)
        return await self.spawn(name, relayd_argv(*args, switched=switched), env)

    async def _await_ok(self, url: str, proc: Process) -> None:
        await await_ok(self.http, url, proc)

    async def close(self) -> None:
        """Kill whatever still runs (a scenario stops what it means to stop)."""
        for proc in self.processes:
            if proc.returncode is None:
                proc.signal(signal.SIGCONT)
                await proc.kill()

    # --- the outbox ---

    async def produce(self, count: int, **job: Any) -> list[str]:
        return await produce(self.conn, count, **job)

    async def expire_leases(self) -> int:
        """End every current lease now (instead of waiting for it): the rows are due."""
        result: str = await self.conn.execute(
            f"UPDATE {self.sql_table} SET available_at = now() "
            "WHERE lease_owner IS NOT NULL AND published_at IS NULL AND dead_at IS NULL "
            "AND available_at > now()"
        )
        return int(result.rsplit(maxsplit=1)[-1])

    async def pending(self) -> int:
        count: int = await self.conn.fetchval(
            f"SELECT count(*) FROM {self.sql_table} WHERE published_at IS NULL AND dead_at IS NULL"
        )
        return count

    async def published(self) -> int:
        count: int = await self.conn.fetchval(
            f"SELECT count(*) FROM {self.sql_table} WHERE published_at IS NOT NULL"
        )
        return count

    async def until(self, query: str, *, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until the SQL `query` (one boolean) holds."""
        try:
            async with asyncio.timeout(timeout_s):
                # The state lives in PostgreSQL, which cannot signal this loop.
                while not await self.conn.fetchval(query):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"never true: {query}; logs in {self.base}") from None

    async def drained(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until every row is published or dead."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self.pending():  # noqa: ASYNC110 - as in `until`
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(
                f"{await self.pending()} rows still pending after {timeout_s:g} s; logs in "
                f"{self.base}"
            ) from None

    async def dead(self) -> dict[str, str]:
        """Dead rows: event id -> dead_reason."""
        rows = await self.conn.fetch(
            f"SELECT event_id::text AS id, dead_reason FROM {self.sql_table} "
            "WHERE dead_at IS NOT NULL"
        )
        return {row["id"]: row["dead_reason"] for row in rows}

    async def check(self, waiting: AbstractSet[str] = frozenset()) -> Report:
        """The history checker over the outbox, the sink's ledger and the transitions;
        fails the test with every violation's timeline. `waiting`: rows that may still be
        pending (the rows of parked keys)."""
        assert self.sink is not None
        report = await check(self.conn, await self.sink.ledger(), table=self.table, waiting=waiting)
        assert_clean(report)
        return report


@contextlib.asynccontextmanager
async def scene(base: Path, dsn: str, table: str = str(DEFAULT_TABLE)) -> AsyncIterator[Scene]:
    """A Scene on the database at `dsn` (migrated, empty), cleaned up on exit."""
    conn = await asyncpg.connect(dsn)
    try:
        await install_history(conn, table)
        async with aiohttp.ClientSession() as http:
            stage = Scene(base=base, dsn=dsn, conn=conn, http=http, table=table)
            try:
                yield stage
            finally:
                await stage.close()
    finally:
        await conn.close()
