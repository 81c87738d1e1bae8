"""LISTEN on the outbox's insert channel: the relay's wakeup."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import asyncpg

from relayd.store.connection import _CONNECTION_GONE, StoreBase, _translated


class ListenQueries(StoreBase):
    """A dedicated connection, outside the pool, for notifications."""

    @contextlib.asynccontextmanager
    async def listen(self, on_notify: Callable[[], None]) -> AsyncIterator[Listener]:
        """A dedicated connection LISTENing on the outbox's insert channel."""
        with _translated("listen"):
            conn = await asyncpg.connect(
                self._dsn, timeout=10, server_settings={"application_name": "relayd-listen"}
            )
        listener = Listener(conn)
        try:
            with _translated("listen"):
                conn.add_termination_listener(lambda _conn: listener.lost.set())
                await conn.add_listener(self.table.channel, lambda *_args: on_notify())
            yield listener
        finally:
            with contextlib.suppress(*_CONNECTION_GONE):
                await asyncio.wait_for(conn.close(), timeout=5)
            conn.terminate()


class Listener:
    """A live LISTEN connection: `lost` is set when it breaks; `ping()` proves it is alive."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self.lost = asyncio.Event()

    async def ping(self) -> None:
        with _translated("listen_ping"):
            await self._conn.fetchval("SELECT 1")
