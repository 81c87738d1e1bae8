"""`append` for SQLAlchemy 2: the event written in the transaction of a `Connection` or
`Session`, or awaited on an `AsyncConnection` or `AsyncSession`; the same checks,
idempotence and errors as every driver (relayd/producer/__init__.py, docs/producers.md). Needs the
`sqlalchemy` extra and a PostgreSQL dialect.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any, overload

from sqlalchemy import Connection, TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from relayd.producer import (
    DEFAULT_OUTBOX,
    INSERT_TRIES,
    Event,
    Outbox,
    settle,
    statements,
    vanished,
)


@overload
def append(
    conn: AsyncConnection | AsyncSession,
    event: Event | Mapping[str, Any],
    *,
    outbox: Outbox = ...,
    key: str | None = ...,
) -> Coroutine[Any, Any, None]: ...


@overload
def append(
    conn: Connection | Session,
    event: Event | Mapping[str, Any],
    *,
    outbox: Outbox = ...,
    key: str | None = ...,
) -> None: ...


def append(
    conn: Connection | Session | AsyncConnection | AsyncSession,
    event: Event | Mapping[str, Any],
    *,
    outbox: Outbox = DEFAULT_OUTBOX,
    key: str | None = None,
) -> Coroutine[Any, Any, None] | None:
    """Append `event` in the transaction of `conn` (await it on an `AsyncConnection` or
    `AsyncSession`) under its ordering key (`key`, or the event's own; None: none); a no-op
    if the outbox holds the same envelope and key under its id. `AppendError` if it
    cannot."""
    # Raised at the call, before any await.
    event_id, job, ordering_key = outbox.prepare(event, key=key)
    params = {"id": event_id, "job": job, "key": ordering_key}
    insert, compare = (
        text(sql) for sql in statements(outbox.table, ":", keyed=ordering_key is not None)
    )
    if isinstance(conn, AsyncConnection | AsyncSession):
        return _append_async(conn, insert, compare, params)
    for _ in range(INSERT_TRIES):
        if conn.execute(insert, params).first() is not None:
            return None
        if settle(event_id, conn.execute(compare, params).scalar()):
            return None
    raise vanished(event_id)


async def _append_async(
    conn: AsyncConnection | AsyncSession,
    insert: TextClause,
    compare: TextClause,
    params: dict[str, str | None],
) -> None:
    event_id = str(params["id"])
    for _ in range(INSERT_TRIES):
        if (await conn.execute(insert, params)).first() is not None:
            return
        if settle(event_id, (await conn.execute(compare, params)).scalar()):
            return
    raise vanished(event_id)
