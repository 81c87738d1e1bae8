"""The application side: build OJS envelopes and write them into the outbox in the caller's
transaction, together with the business change they announce.

    async with conn.transaction():
        await conn.execute("UPDATE orders SET paid = true WHERE id = $1", order_id)
        await enqueue(conn, new_job("order.fulfill", [{"order_id": order_id}], queue="orders"))
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

import asyncpg

from relayd.models import OutboxTable


def uuid7(now_s: float | None = None) -> str:
    """A new lowercase UUIDv7 (RFC 9562): 48-bit Unix milliseconds (of `now_s` if given, for
    a caller with its own clock), then 74 random bits."""
    millis = time.time_ns() // 1_000_000 if now_s is None else int(now_s * 1000)
    value = millis << 80 | int.from_bytes(os.urandom(10))
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    text = f"{value:032x}"  # str(uuid.UUID(int=value)), without building the object
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def new_job(
    job_type: str,
    args: list[Any],
    *,
    queue: str | None = None,
    meta: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    job_id: str | None = None,
) -> dict[str, Any]:
    """An OJS enqueue request with a fresh UUIDv7; routing goes under `options` (OJS binding)."""
    job: dict[str, Any] = {"id": job_id or uuid7(), "type": job_type, "args": args}
    if meta:
        job["meta"] = meta
    merged = dict(options or {})
    if queue is not None:
        merged["queue"] = queue
    if merged:
        job["options"] = merged
    return job


async def enqueue(
    conn: asyncpg.Connection, job: dict[str, Any], *, table: OutboxTable | str = "relayd.outbox"
) -> str:
    """Insert one envelope; call it inside the transaction that makes the business change."""
    await enqueue_many(conn, [job], table=table)
    return str(job["id"])


async def enqueue_many(
    conn: asyncpg.Connection,
    jobs: Iterable[dict[str, Any]],
    *,
    table: OutboxTable | str = "relayd.outbox",
) -> int:
    """Insert many envelopes in one round trip; returns how many."""
    outbox = table if isinstance(table, OutboxTable) else OutboxTable.parse(table)
    rows = [(job["id"], json.dumps(job)) for job in jobs]
    await conn.executemany(
        f"INSERT INTO {outbox.qualified} (event_id, job) VALUES ($1::uuid, $2::jsonb)", rows
    )
    return len(rows)
