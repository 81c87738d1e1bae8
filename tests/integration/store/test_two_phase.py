"""Producers that use two-phase commit (PREPARE TRANSACTION): an outbox migrated with
`outbox.notify_trigger = false` accepts their rows, and relayd publishes them by polling
within the documented bound (docs/configure.md, two-phase-commit producers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from relayd.producer import new_job
from relayd.store.migrations import connect_and_migrate
from relayd.testing.emulator import RunningEmulator
from relayd.testing.postgres import EmbeddedPostgres
from tests.support import (
    DEFAULT_TABLE,
    PgServer,
    dsn_for,
    eventually,
    produce,
    relay_settings,
    running,
)

# What these tests prepare at most at once, with room for a transaction left by a failure.
_PREPARED_AT_ONCE = 4


async def _max_prepared(admin_dsn: str) -> int:
    conn = await asyncpg.connect(admin_dsn)
    try:
        return int(await conn.fetchval("SHOW max_prepared_transactions"))
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def prepared_server(pg_server: PgServer) -> Iterator[str]:
    """The admin DSN of a server that allows prepared transactions: the session's own if it
    does, else an embedded one of this module's (PostgreSQL's default is 0, and only a
    restart changes it)."""
    if asyncio.run(_max_prepared(pg_server.admin_dsn)) >= _PREPARED_AT_ONCE:
        yield pg_server.admin_dsn
        return
    with EmbeddedPostgres(prepared_transactions=_PREPARED_AT_ONCE) as embedded:
        yield embedded.dsn("postgres")


@contextlib.asynccontextmanager
async def _outbox(admin_dsn: str, *, notify_trigger: bool) -> AsyncIterator[str]:
    """A new database on the server of `admin_dsn` with a migrated outbox; its DSN. Any
    transaction a failed test left prepared in it is rolled back before it is dropped."""
    name = f"relayd_2pc_{uuid.uuid4().hex[:12]}"
    dsn = dsn_for(admin_dsn, name)
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            await connect_and_migrate(dsn, DEFAULT_TABLE, notify_trigger=notify_trigger)
            yield dsn
        finally:
            conn = await asyncpg.connect(dsn)
            try:
                for record in await conn.fetch(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                ):
                    await conn.execute(f"ROLLBACK PREPARED '{record['gid']}'")
            finally:
                await conn.close()
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def _prepare(conn: asyncpg.Connection, jobs: list[dict[str, object]]) -> str:
    """Insert `jobs` in a transaction and PREPARE it, as a two-phase-commit producer does;
    its global id."""
    gid = f"relayd-test-{uuid.uuid4()}"
    await conn.execute("BEGIN")
    try:
        await conn.executemany(
            "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2)",
            [(job["id"], json.dumps(job)) for job in jobs],
        )
        await conn.execute(f"PREPARE TRANSACTION '{gid}'")
    except BaseException:
        if conn.is_in_transaction():
            await conn.execute("ROLLBACK")
        raise
    return gid


async def test_the_notify_trigger_refuses_prepare_transaction(prepared_server: str) -> None:
    """With the NOTIFY trigger (the default), PostgreSQL refuses PREPARE TRANSACTION after an
    outbox insert: why two-phase-commit producers need outbox.notify_trigger = false."""
    async with _outbox(prepared_server, notify_trigger=True) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            with pytest.raises(asyncpg.FeatureNotSupportedError, match="NOTIFY"):
                await _prepare(conn, [new_job("test.two_phase", [])])
        finally:
            await conn.close()


async def test_a_two_phase_commit_producers_rows_publish_within_the_bound(
    prepared_server: str, emulator: RunningEmulator
) -> None:
    """1. outbox.notify_trigger = false: a producer inserts rows and PREPAREs; 2. other
    producers' rows publish across many claims meanwhile (the watermark passes the prepared
    rows, whose transaction left pg_stat_activity at PREPARE); 3. COMMIT PREPARED: the rows
    publish within relay.full_scan_interval_s + relay.poll_interval_s."""
    full_scan_s, poll_s = 2.0, 0.25
    async with _outbox(prepared_server, notify_trigger=False) as dsn:
        settings = relay_settings(
            dsn,
            emulator.url,
            outbox={"notify_trigger": False},
            relay={"workers": 1, "poll_interval_s": poll_s, "full_scan_interval_s": full_scan_s},
        )
        producer = await asyncpg.connect(dsn)
        others = await asyncpg.connect(dsn)
        try:
            async with running(settings):
                # 1.
                jobs = [new_job("test.two_phase", [n]) for n in range(5)]
                gid = await _prepare(producer, jobs)
                # 2.
                for _ in range(3):
                    early = await produce(others, 10)

                    async def published(ids: list[str] = early) -> bool:
                        return set(ids) <= set(emulator.emulator.ledger())

                    await eventually(published, timeout_s=10)
                assert not {str(job["id"]) for job in jobs} & set(emulator.emulator.ledger())
                # 3.
                await others.execute(f"COMMIT PREPARED '{gid}'")
                ids = {str(job["id"]) for job in jobs}

                async def prepared_published() -> bool:
                    return ids <= set(emulator.emulator.ledger())

                # The bound, and a second for the claim and the sink's answer on a busy host.
                await eventually(prepared_published, timeout_s=full_scan_s + poll_s + 1.0)
        finally:
            await producer.close()
            await others.close()


async def test_without_the_notify_trigger_relayd_polls_and_does_not_listen(
    prepared_server: str, emulator: RunningEmulator
) -> None:
    """outbox.notify_trigger = false: `relayd run` opens no LISTEN connection, and an
    ordinary producer's rows publish at the next poll."""
    async with _outbox(prepared_server, notify_trigger=False) as dsn:
        settings = relay_settings(
            dsn,
            emulator.url,
            outbox={"notify_trigger": False},
            relay={"poll_interval_s": 0.25, "full_scan_interval_s": 3600.0},
        )
        conn = await asyncpg.connect(dsn)
        try:
            async with running(settings) as daemon:
                assert not daemon.settings.listens
                ids = await produce(conn, 10)

                async def published() -> bool:
                    return set(ids) <= set(emulator.emulator.ledger())

                await eventually(published, timeout_s=5)
                listening = await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = 'relayd-listen'"
                )
                assert listening == 0
        finally:
            await conn.close()
