"""What the NATS sink's integration tests share: a client of the test's nats-server, and
the `server` fixture that runs a test on the dev extra's server and on Debian's 2.9."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from relayd.testing.nats import SERVER_ENV_VAR, NatsServer
from tests.tools import missing

# The Debian package's server: 2.9, which knows neither API levels nor atomic batches.
DEBIAN_SERVER = Path("/usr/sbin/nats-server")


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A client of the test's server (for setting up streams and reading them back)."""
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@dataclass(frozen=True)
class Server:
    nats: NatsServer
    old: bool  # Debian's 2.9, not the wheel's

    @property
    def url(self) -> str:
        return self.nats.url


@pytest.fixture(params=["wheel", "debian"])
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The dev extra's nats-server, then Debian's 2.9 where installed."""
    old = request.param == "debian"
    if old:
        if not DEBIAN_SERVER.is_file():
            missing(str(DEBIAN_SERVER), "nats-server", "the 2.9 server feature gating is tested on")
        monkeypatch.setenv(SERVER_ENV_VAR, str(DEBIAN_SERVER))
    else:
        monkeypatch.delenv(SERVER_ENV_VAR, raising=False)  # the wheel's, whatever is set
    with NatsServer() as running:
        yield Server(running, old)


@pytest.fixture
async def client(server: Server) -> AsyncIterator[Client]:
    """A client of the test's server (to create the stream and read it back)."""
    connected = await nats.connect(server.url)
    yield connected
    await connected.close()
