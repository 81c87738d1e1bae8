"""The drivers `relayd.producer` supports, each as one open transaction on one connection,
driven from a test's event loop: what the producer's integration tests run every append
through."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg
import psycopg
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from relayd import producer
from relayd.producer import DEFAULT_OUTBOX, Event, Outbox
from relayd.producer import psycopg as producer_psycopg
from relayd.producer import sqlalchemy as producer_sqlalchemy


class Tx(Protocol):
    """One open transaction on one connection of a driver, driven from the test's loop."""

    pid: int

    async def execute(self, sql: str) -> None: ...
    async def append(
        self,
        event: Event | Mapping[str, Any],
        *,
        key: str | None = None,
        outbox: Outbox = DEFAULT_OUTBOX,
    ) -> None: ...
    async def commit(self) -> None: ...
    async def rollback(self) -> None: ...
    async def close(self) -> None: ...


class AsyncpgTx:
    def __init__(self, conn: asyncpg.Connection, tx: Any) -> None:
        self._conn, self._tx = conn, tx
        self.pid: int = conn.get_server_pid()

    @classmethod
    async def open(cls, dsn: str) -> AsyncpgTx:
        conn = await asyncpg.connect(dsn)
        tx = conn.transaction()
        await tx.start()
        return cls(conn, tx)

    async def execute(self, sql: str) -> None:
        await self._conn.execute(sql)

    async def append(
        self,
        event: Event | Mapping[str, Any],
        *,
        key: str | None = None,
        outbox: Outbox = DEFAULT_OUTBOX,
    ) -> None:
        await producer.append(self._conn, event, key=key, outbox=outbox)

    async def commit(self) -> None:
        await self._tx.commit()

    async def rollback(self) -> None:
        await self._tx.rollback()

    async def close(self) -> None:
        await self._conn.close()


class PsycopgTx:
    """A blocking connection, each call run in a thread so that one may wait on a lock."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self.pid = conn.info.backend_pid

    @classmethod
    async def open(cls, dsn: str) -> PsycopgTx:
        return cls(await asyncio.to_thread(psycopg.connect, dsn))

    async def execute(self, sql: str) -> None:
        await asyncio.to_thread(self._conn.execute, sql)

    async def append(
        self,
        event: Event | Mapping[str, Any],
        *,
        key: str | None = None,
        outbox: Outbox = DEFAULT_OUTBOX,
    ) -> None:
        def run() -> None:
            producer_psycopg.append(self._conn, event, key=key, outbox=outbox)

        await asyncio.to_thread(run)

    async def commit(self) -> None:
        await asyncio.to_thread(self._conn.commit)

    async def rollback(self) -> None:
        await asyncio.to_thread(self._conn.rollback)

    async def close(self) -> None:
        await asyncio.to_thread(self._conn.close)


class PsycopgAsyncTx:
    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn
        self.pid = conn.info.backend_pid

    @classmethod
    async def open(cls, dsn: str) -> PsycopgAsyncTx:
        return cls(await psycopg.AsyncConnection.connect(dsn))

    async def execute(self, sql: str) -> None:
        await self._conn.execute(sql)

    async def append(
        self,
        event: Event | Mapping[str, Any],
        *,
        key: str | None = None,
        outbox: Outbox = DEFAULT_OUTBOX,
    ) -> None:
        await producer_psycopg.append(self._conn, event, key=key, outbox=outbox)

    async def commit(self) -> None:
        await self._conn.commit()

    async def rollback(self) -> None:
        await self._conn.rollback()

    async def close(self) -> None:
        await self._conn.close()


def _url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://", 1)


class SqlalchemyTx:
    """A `Connection` or a `Session` (both autobegin), each call run in a thread."""

    def __init__(self, dsn: str, *, session: bool) -> None:
        self._engine = create_engine(_url(dsn, "psycopg"))
        self._conn: Connection | Session = (
            Session(self._engine) if session else self._engine.connect()
        )
        self.pid = 0

    @classmethod
    async def open(cls, dsn: str, *, session: bool) -> SqlalchemyTx:
        opened = await asyncio.to_thread(cls, dsn, session=session)
        opened.pid = await asyncio.to_thread(
            lambda: int(opened._conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
        )
        return opened

    async def execute(self, sql: str) -> None:
        await asyncio.to_thread(self._conn.execute, text(sql))

    async def append(
        self,
        event: Event | Mapping[str, Any],
        *,
        key: str | None = None,
        outbox: Outbox = DEFAULT_OUTBOX,
    ) -> None:
        def run() -> None:
            producer_sqlalchemy.append(self._conn, event, key=key, outbox=outbox)

        await asyncio.to_thread(run)

    async def commit(self) -> None:
        await asyncio.to_thread(self._conn.commit)

    async def rollback(self) -> None:
        await asyncio.to_thread(self._conn.rollback)

    async def close(self) -> None:
        await asyncio.to_thread(self._conn.close)
        await asyncio.to_thread(self._engine.dispose)


class SqlalchemyAsyncTx:
    """An `AsyncConnection` (over psycopg) or an `AsyncSession` (over asyncpg)."""

    def __init__(self, dsn: str, *, session: bool) -> None:
        self._engine = create_async_engine(_url(dsn, "asyncpg" if session else "psycopg"))
        self._session = session
        self._conn: Any = None
        self.pid = 0

    @classmethod
    async def open(cls, dsn: str, *, session: bool) -> SqlalchemyAsyncTx:
        opened = cls(dsn, session=session)
        if session:
            opened._conn = AsyncSession(opened._engine)
        else:
            opened._conn = await opened._engine.connect()
        pid = await opened._conn.execute(text("SELECT pg_backend_pid()"))
        opened.pid = int(pid.scalar_one())
        return opened

    async def execute(self, sql: str) -> None:
        await self._conn.execute(text(sql))

    async def append(
        self,
        event: Event | Mapping[str, Any],
        *,
        key: str | None = None,
        outbox: Outbox = DEFAULT_OUTBOX,
    ) -> None:
        await producer_sqlalchemy.append(self._conn, event, key=key, outbox=outbox)

    async def commit(self) -> None:
        await self._conn.commit()

    async def rollback(self) -> None:
        await self._conn.rollback()

    async def close(self) -> None:
        await self._conn.close()
        await self._engine.dispose()


@dataclass(frozen=True)
class Driver:
    name: str
    open: Callable[[str], Any]


DRIVERS = [
    Driver("asyncpg", AsyncpgTx.open),
    Driver("psycopg", PsycopgTx.open),
    Driver("psycopg-async", PsycopgAsyncTx.open),
    Driver("sqlalchemy-connection", lambda dsn: SqlalchemyTx.open(dsn, session=False)),
    Driver("sqlalchemy-session", lambda dsn: SqlalchemyTx.open(dsn, session=True)),
    Driver("sqlalchemy-async-connection", lambda dsn: SqlalchemyAsyncTx.open(dsn, session=False)),
    Driver("sqlalchemy-async-session", lambda dsn: SqlalchemyAsyncTx.open(dsn, session=True)),
]
