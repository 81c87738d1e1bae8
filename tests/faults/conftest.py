"""Fixtures for fault tests: a cuttable, slowable TCP path to the test database, and the
scene of the process-level scenarios (tests/faults/harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.faults.harness import Scene
from tests.faults.harness import scene as make_scene
from tests.faults.nats_stage import NatsStage, nats_stage
from tests.support import Database, TcpProxy


@pytest.fixture
async def proxy(database: Database) -> AsyncIterator[TcpProxy]:
    """A TCP proxy in front of the test database (connect through `dsn_through`)."""
    path = TcpProxy.for_dsn(database.dsn)
    await path.start()
    yield path
    await path.close()


@pytest.fixture
async def scene(database: Database, tmp_path: Path) -> AsyncIterator[Scene]:
    """Real relayd processes and an emulator process on a fresh database, with the
    transition history installed; every process is killed at the end."""
    async with make_scene(tmp_path, database.dsn) as stage:
        yield stage


@pytest.fixture
async def stage(scene: Scene, tmp_path: Path) -> AsyncIterator[NatsStage]:
    """The scene with a nats-server of its own (the dev extra's binary) in place of the
    emulator, and a client of it; see tests/faults/nats_stage.py."""
    async with nats_stage(scene, tmp_path) as nats_scene:
        yield nats_scene
