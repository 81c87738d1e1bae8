"""`append` for psycopg 3: the event written in the caller's transaction on a `Connection`,
or awaited on an `AsyncConnection`; the same checks, idempotence and errors as every driver
(relayd/producer/__init__.py, docs/producers.md). Needs the `psycopg` extra.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any, overload

import psycopg
from psycopg.pq import TransactionStatus

from relayd.producer import (
    DEFAULT_OUTBOX,
    INSERT_TRIES,
    NO_TRANSACTION,
    Event,
    NotInTransaction,
    Outbox,
    settle,
    statements,
    vanished,
)


@overload
def append(
    conn: psycopg.AsyncConnection[Any],
    event: Event | Mapping[str, Any],
    *,
    outbox: Outbox = ...,
    key: str | None = ...,
) -> Coroutine[Any, Any, None]: ...


@overload
def append(
    conn: psycopg.Connection[Any],
    event: Event | Mapping[str, Any],
    *,
    outbox: Outbox = ...,
    key: str | None = ...,
) -> None: ...


def append(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    event: Event | Mapping[str, Any],
    *,
    outbox: Outbox = DEFAULT_OUTBOX,
    key: str | None = None,
) -> Coroutine[Any, Any, None] | None:
    """Append `event` in `conn`'s transaction (await it on an `AsyncConnection`) under its
    ordering key (`key`, or the event's own; None: none); a no-op if the outbox holds the
    same envelope and key under its id. `AppendError` if it cannot."""
    # Raised at the call, before any await.
    event_id, job, ordering_key = outbox.prepare(event, key=key)
    # Without autocommit, psycopg opens a transaction at the first statement.
    if conn.autocommit and conn.info.transaction_status != TransactionStatus.INTRANS:
        raise NotInTransaction(NO_TRANSACTION)
    params = {"id": event_id, "job": job, "key": ordering_key}
    insert, compare = statements(outbox.table, "%s", keyed=ordering_key is not None)
    if isinstance(conn, psycopg.AsyncConnection):
        return _append_async(conn, insert, compare, params)
    for _ in range(INSERT_TRIES):
        if conn.execute(insert, params).fetchone() is not None:
            return None
        row = conn.execute(compare, params).fetchone()
        if settle(event_id, None if row is None else row[0]):
            return None
    raise vanished(event_id)


async def _append_async(
    conn: psycopg.AsyncConnection[Any], insert: str, compare: str, params: dict[str, str | None]
) -> None:
    event_id = str(params["id"])
    for _ in range(INSERT_TRIES):
        if await (await conn.execute(insert, params)).fetchone() is not None:
            return
        row = await (await conn.execute(compare, params)).fetchone()
        if settle(event_id, None if row is None else row[0]):
            return
    raise vanished(event_id)
