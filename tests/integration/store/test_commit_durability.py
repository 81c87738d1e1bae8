"""Which commits wait for the disk (docs/contract.md, C1): a claim always does, whatever the
session's `synchronous_commit`, since a claim a crash forgot would be sent again with no GET
first; a settle never does, since a settle a crash forgot is redone after the lease.

Each statement sets `synchronous_commit` for its own transaction only. Run inside an
explicit transaction here, its setting stays visible until that transaction ends; the crash
tests (tests/faults/test_database_faults.py) show what the setting does to a real crash.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from relayd.store import load_queries
from tests.support import DEFAULT_TABLE, produce

QUERIES = load_queries(DEFAULT_TABLE)


async def _claim(conn: asyncpg.Connection, owner: uuid.UUID, statement: str = "claim") -> list[str]:
    args: tuple[object, ...] = (10, owner, 30.0, str(DEFAULT_TABLE), None, True)
    if statement == "claim_ordered":
        args += (None,)  # the walk over the keys from the first
    records = await conn.fetch(QUERIES[statement], *args)
    return [str(record[0]) for record in records if record[0] is not None]


@pytest.mark.parametrize(
    ("session", "during_the_claim"),
    [
        ("off", "on"),  # lifted: the one setting that would lose an acknowledged claim
        ("local", "local"),
        ("on", "on"),
        ("remote_write", "remote_write"),
        ("remote_apply", "remote_apply"),  # a stronger setting is never weakened
    ],
)
@pytest.mark.parametrize("statement", ["claim", "claim_ordered"])
async def test_a_claim_commits_durably_whatever_the_session_says(
    conn: asyncpg.Connection, session: str, during_the_claim: str, statement: str
) -> None:
    ids = await produce(conn, 3)
    outside = await conn.fetchval("SHOW synchronous_commit")  # the test server's own
    async with conn.transaction():
        await conn.execute(f"SET LOCAL synchronous_commit = {session}")
        assert sorted(await _claim(conn, uuid.uuid4(), statement)) == sorted(ids)
        assert await conn.fetchval("SHOW synchronous_commit") == during_the_claim
    assert await conn.fetchval("SHOW synchronous_commit") == outside  # nothing outlives it


def _settle_args(statement: str, ids: list[str]) -> tuple[Any, ...]:
    n = len(ids)
    return {
        "settle_published": (["ojs:available"] * n,),
        "settle_retry": ([0.5] * n, ["HTTP 503"] * n, [0] * n, [True] * n, [None] * n),
        "settle_dead": (["rejected"] * n, ["HTTP 400"] * n),
        "release": ([None] * n,),
    }[statement]


SETTLES = ("settle_published", "settle_retry", "settle_dead", "release")


@pytest.mark.parametrize("statement", SETTLES)
async def test_every_settle_commits_lazily(conn: asyncpg.Connection, statement: str) -> None:
    await produce(conn, 3)
    owner = uuid.uuid4()
    ids = await _claim(conn, owner)
    outside = await conn.fetchval("SHOW synchronous_commit")  # the test server's own
    async with conn.transaction():
        await conn.execute("SET LOCAL synchronous_commit = on")
        updated = await conn.fetchval(QUERIES[statement], owner, ids, *_settle_args(statement, ids))
        assert updated is None, "a settle left some of its owner's rows alone"  # None: all
        assert await conn.fetchval("SHOW synchronous_commit") == "off"
    assert await conn.fetchval("SHOW synchronous_commit") == outside  # nothing outlives it
