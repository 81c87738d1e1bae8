"""Ordered delivery per key on real PostgreSQL (migration 0011, `claim_ordered`): keys are
numbered in commit order, only heads are claimed, one row per key in flight, hot keys do
not crowd out quiet ones, parked keys wait."""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg
import pytest

from relayd.core.errors import MigrationError
from relayd.core.rows import ClaimBatch
from relayd.producer import new_job
from relayd.store import Store
from relayd.store.migrations import migrate
from tests.support import Database, eventually


async def insert_keyed(conn: asyncpg.Connection, key: str | None, n: int = 1) -> list[str]:
    """Commit `n` rows of `key` by plain SQL, one transaction; their ids in insert order."""
    ids = []
    async with conn.transaction():
        for i in range(n):
            job = new_job("test.echo", [{"n": i}])
            await conn.execute(
                "INSERT INTO relayd.outbox (event_id, job, ordering_key) VALUES ($1, $2, $3)",
                job["id"],
                json.dumps(job),
                key,
            )
            ids.append(str(job["id"]))
    return ids


async def claim(store: Store, limit: int = 100, walk_from: str | None = None) -> ClaimBatch:
    return await store.claim_from(
        limit, uuid.uuid4(), 30.0, None, walk_from=walk_from, ordered=True
    )


async def publish(store: Store, batch: ClaimBatch) -> None:
    ids = [row.event_id for row in batch.rows]
    await store._pool.execute(
        "UPDATE relayd.outbox SET published_at = now(), lease_owner = NULL "
        "WHERE event_id = ANY($1::uuid[])",
        ids,
    )


async def test_rows_of_a_key_are_numbered_and_wait_out_of_the_unordered_range(
    conn: asyncpg.Connection,
) -> None:
    a = await insert_keyed(conn, "order-1", 3)
    [plain] = await insert_keyed(conn, None)
    rows = await conn.fetch(
        "SELECT event_id::text, ordering_seq, available_at = 'infinity' AS waiting "
        "FROM relayd.outbox ORDER BY ordering_seq NULLS LAST"
    )
    assert [(r["event_id"], r["ordering_seq"], r["waiting"]) for r in rows] == [
        (a[0], 1, True),
        (a[1], 2, True),
        (a[2], 3, True),
        (plain, None, False),
    ]


async def test_only_the_head_of_a_key_is_claimed_and_its_successor_after_it_is_published(
    conn: asyncpg.Connection, store: Store
) -> None:
    a = await insert_keyed(conn, "a", 3)
    b = await insert_keyed(conn, "b", 2)
    [plain] = await insert_keyed(conn, None)
    first = await claim(store)
    assert sorted(r.event_id for r in first.rows) == sorted([a[0], b[0], plain])
    assert {r.event_id: r.ordering_key for r in first.rows} == {a[0]: "a", b[0]: "b", plain: None}
    # In flight: nothing more of either key.
    assert (await claim(store)).rows == []
    await publish(store, first)
    second = await claim(store)
    assert sorted(r.event_id for r in second.rows) == sorted([a[1], b[1]])
    await publish(store, second)
    third = await claim(store)
    assert [r.event_id for r in third.rows] == [a[2]]


async def test_a_head_whose_lease_expires_is_claimed_again_before_any_successor(
    conn: asyncpg.Connection, store: Store
) -> None:
    a = await insert_keyed(conn, "a", 2)
    first = await claim(store)
    assert [r.event_id for r in first.rows] == [a[0]]
    await conn.execute(
        "UPDATE relayd.outbox SET available_at = now() - interval '1 second' WHERE event_id = $1",
        a[0],
    )
    again = await claim(store)
    assert [(r.event_id, r.attempts, r.claimed_before) for r in again.rows] == [(a[0], 2, True)]


async def test_a_dead_lettered_head_lets_its_key_go_on(
    conn: asyncpg.Connection, store: Store
) -> None:
    a = await insert_keyed(conn, "a", 2)
    owner = uuid.uuid4()
    first = await store.claim_from(10, owner, 30.0, None, ordered=True)
    assert [r.event_id for r in first.rows] == [a[0]]
    await store.settle_dead(owner, [a[0]], ["max_attempts"], ["refused"])
    assert [r.event_id for r in (await claim(store)).rows] == [a[1]]


async def test_a_parked_key_waits_and_other_keys_flow(
    conn: asyncpg.Connection, store: Store
) -> None:
    a = await insert_keyed(conn, "a", 2)
    b = await insert_keyed(conn, "b", 1)
    await conn.execute(
        "INSERT INTO relayd.relayd_parked_keys "
        "(outbox_table, ordering_key, event_id, type, reason) "
        "VALUES ('relayd.outbox', 'a', $1, 'test.echo', 'max_attempts')",
        a[0],
    )
    assert [r.event_id for r in (await claim(store)).rows] == [b[0]]


async def test_a_hot_key_yields_one_row_per_claim_beside_quiet_keys(
    conn: asyncpg.Connection, store: Store
) -> None:
    await insert_keyed(conn, "hot", 500)
    quiet = [ids[0] for ids in [await insert_keyed(conn, f"q{i:03}") for i in range(20)]]
    batch = await claim(store, limit=100)
    keys = [r.ordering_key for r in batch.rows]
    assert keys.count("hot") == 1
    assert sorted(r.event_id for r in batch.rows if r.ordering_key != "hot") == sorted(quiet)
    assert batch.walked_to is None  # reached the last key


async def test_the_walk_resumes_where_the_last_claim_stopped(
    conn: asyncpg.Connection, store: Store
) -> None:
    for i in range(6):
        await insert_keyed(conn, f"k{i}")
    first = await claim(store, limit=4)
    assert [r.ordering_key for r in first.rows] == ["k0", "k1", "k2", "k3"]
    assert first.walked_to == "k3"
    second = await claim(store, limit=4, walk_from=first.walked_to)
    assert [r.ordering_key for r in second.rows] == ["k4", "k5"]
    assert second.walked_to is None


async def test_the_two_parts_share_the_limit_in_turn(
    conn: asyncpg.Connection, store: Store
) -> None:
    for i in range(4):
        await insert_keyed(conn, f"k{i}")
    await insert_keyed(conn, None, 4)
    batch = await claim(store, limit=4)
    assert sorted(r.ordering_key is None for r in batch.rows) == [False, False, True, True]


async def test_a_second_writer_of_a_key_is_numbered_after_the_first_commits(
    database: Database, conn: asyncpg.Connection, store: Store
) -> None:
    """The first writer inserts first but commits last: the second waits on the key until
    the first commits and takes the next number, so delivery follows commit order."""
    first = await asyncpg.connect(database.dsn)
    try:
        early = new_job("test.echo", [{"n": "inserted first, committed last"}])
        tx = first.transaction()
        await tx.start()
        await first.execute(
            "INSERT INTO relayd.outbox (event_id, job, ordering_key) VALUES ($1, $2, 'k')",
            early["id"],
            json.dumps(early),
        )
        second = asyncio.create_task(insert_keyed(conn, "k"))

        # The second writer waits on the key's row (a lock wait, seen in pg_stat_activity).
        async def waiting() -> bool:
            return bool(
                await first.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
            )

        await eventually(waiting, timeout_s=10)
        assert not second.done()
        await tx.commit()
        [late] = await second
    finally:
        await first.close()
    seqs = {
        r["event_id"]: r["ordering_seq"]
        for r in await conn.fetch("SELECT event_id::text, ordering_seq FROM relayd.outbox")
    }
    assert seqs == {str(early["id"]): 1, late: 2}
    assert [r.event_id for r in (await claim(store)).rows] == [str(early["id"])]


async def test_a_column_of_the_rows_own_can_hold_the_key(
    conn: asyncpg.Connection, store: Store
) -> None:
    """outbox.ordering_key_column (a Debezium-shaped table's aggregateid): `relayd migrate`
    gives the table a trigger that copies it into ordering_key, which numbers the rows; a
    row naming its own ordering_key keeps it; unset again, the trigger goes; a column the
    table lacks is refused, naming the key."""
    await conn.execute("ALTER TABLE relayd.outbox ADD COLUMN aggregateid text")
    await migrate(store, key_column="aggregateid")

    async def insert(aggregate: str | None, key: str | None = None) -> None:
        job = new_job("test.echo", [{}])
        await conn.execute(
            "INSERT INTO relayd.outbox (event_id, job, aggregateid, ordering_key) "
            "VALUES ($1, $2, $3, $4)",
            job["id"],
            json.dumps(job),
            aggregate,
            key,
        )

    await insert("order-1")
    await insert("order-1")
    await insert("order-2", key="chosen")
    await insert(None)
    rows = await conn.fetch(
        "SELECT aggregateid, ordering_key, ordering_seq FROM relayd.outbox ORDER BY created_at"
    )
    assert [tuple(r) for r in rows] == [
        ("order-1", "order-1", 1),
        ("order-1", "order-1", 2),
        ("order-2", "chosen", 1),
        (None, None, None),
    ]
    await migrate(store)  # the setting unset: the trigger goes
    await insert("order-1")
    unkeyed = await conn.fetchval(
        "SELECT count(*) FROM relayd.outbox WHERE aggregateid = 'order-1' AND ordering_key IS NULL"
    )
    assert unkeyed == 1
    with pytest.raises(MigrationError, match=r"outbox\.ordering_key_column: .* no column 'nope'"):
        await migrate(store, key_column="nope")
