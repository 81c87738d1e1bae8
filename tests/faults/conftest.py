"""Fixtures for fault tests: a cuttable, slowable TCP path to the test database."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support import Database, TcpProxy


@pytest.fixture
async def proxy(database: Database) -> AsyncIterator[TcpProxy]:
    """A TCP proxy in front of the test database (connect through `dsn_through`)."""
    path = TcpProxy.for_dsn(database.dsn)
    await path.start()
    yield path
    await path.close()
