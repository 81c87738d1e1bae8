"""Fixtures for the emulator's own tests: emulators on free loopback ports, an HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from relayd.testing.emulator import EmulatorConfig, RunningEmulator, start_emulator
from tests.support import StartEmulator


@pytest.fixture
async def start() -> AsyncIterator[StartEmulator]:
    """Start emulators with a given config; all are stopped after the test."""
    started: list[RunningEmulator] = []

    async def _start(config: EmulatorConfig | None = None) -> RunningEmulator:
        running = await start_emulator(config)
        started.append(running)
        return running

    yield _start
    for running in started:
        await running.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp client session (real loopback HTTP, nothing mocked)."""
    async with aiohttp.ClientSession() as session:
        yield session
