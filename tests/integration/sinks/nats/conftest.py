"""What the NATS sink's integration tests share: a client of the test's nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from relayd.testing.nats import NatsServer


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A client of the test's server (for setting up streams and reading them back)."""
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()
