"""Appending events from every driver the producer supports, on PostgreSQL: in the caller's
transaction (committed and rolled back with the business change), idempotent by id, and a
different envelope under a taken id refused, also when two transactions race; ordering keys
stored and numbered in commit order, a second writer of a key waiting for the first, and an
event without a key refused on an ordered route (docs/producers.md)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import psycopg
import pytest
from pydantic import BaseModel

from relayd import producer
from relayd.producer import (
    AppendError,
    Event,
    EventIdConflict,
    EventTooLarge,
    InvalidEvent,
    MissingKey,
    NotInTransaction,
    Outbox,
    define_event,
    new_job,
)
from relayd.producer import psycopg as producer_psycopg
from relayd.testing.emulator import RunningEmulator
from tests.integration.producer.drivers import DRIVERS, Driver, Tx
from tests.support import Database, eventually, relay_settings, run_until_idle


class OrderUpdatedV1(BaseModel):
    order_id: int
    status: str


OrderUpdated = define_event("order.updated", 1, OrderUpdatedV1)


class OrderChangedV1(BaseModel):
    order_ref: str
    status: str


# Events ordered per order: the key is the order's reference.
OrderChanged = define_event("order.changed", 1, OrderChangedV1, key=lambda data: data.order_ref)


@pytest.fixture(params=DRIVERS, ids=[driver.name for driver in DRIVERS])
def driver(request: pytest.FixtureRequest) -> Driver:
    """Each driver the producer supports."""
    chosen: Driver = request.param
    return chosen


@dataclass(frozen=True)
class Shop:
    """One test's corner of the shared database: its business table (`orders`), under a
    name of its own, and a connection that inspects it and the test's outbox rows."""

    dsn: str
    orders: str
    conn: asyncpg.Connection

    async def stored(self, *event_ids: str) -> dict[str, Any]:
        """The envelopes stored under `event_ids`, by id, and the orders."""
        rows = await self.conn.fetch(
            "SELECT event_id::text AS id, job::text AS job FROM relayd.outbox "
            "WHERE event_id = ANY($1::uuid[])",
            list(event_ids),
        )
        found = await self.conn.fetch(f"SELECT id FROM {self.orders} ORDER BY id")
        return {
            "outbox": {row["id"]: json.loads(row["job"]) for row in rows},
            "orders": [row["id"] for row in found],
        }

    async def keyed(self, key: str) -> list[tuple[str, int, bool]]:
        """The rows of `key`, in its order: each one's id, number, and whether it is out of
        the unordered claim's reach (available_at 'infinity', for the ordered claim)."""
        rows = await self.conn.fetch(
            "SELECT event_id::text AS id, ordering_seq AS seq, "
            "available_at = 'infinity' AS for_the_ordered_claim "
            "FROM relayd.outbox WHERE ordering_key = $1 ORDER BY ordering_seq",
            key,
        )
        return [(row["id"], row["seq"], row["for_the_ordered_claim"]) for row in rows]


@pytest.fixture
async def shop(module_database: Database) -> AsyncIterator[Shop]:
    """A business table of the test's own in the module's database."""
    conn = await asyncpg.connect(module_database.dsn)
    orders = f"orders_{uuid.uuid4().hex[:12]}"
    await conn.execute(f"CREATE TABLE {orders} (id integer PRIMARY KEY)")
    yield Shop(module_database.dsn, orders, conn)
    await conn.close()


async def _opened(driver: Driver, shop: Shop) -> Tx:
    tx: Tx = await driver.open(shop.dsn)
    return tx


def _event(status: str = "paid", **kwargs: Any) -> Event:
    return OrderUpdated.new(OrderUpdatedV1(order_id=1, status=status), **kwargs)


async def test_append_commits_with_the_business_change(driver: Driver, shop: Shop) -> None:
    """An appended event and the business change are committed together."""
    event = _event()
    tx = await _opened(driver, shop)
    try:
        await tx.execute(f"INSERT INTO {shop.orders} VALUES (1)")
        await tx.append(event)
        assert await shop.stored(event.id) == {"outbox": {}, "orders": []}
        await tx.commit()
    finally:
        await tx.close()
    assert await shop.stored(event.id) == {"outbox": {event.id: event.envelope}, "orders": [1]}


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _bad(**fields: Any) -> dict[str, Any]:
    job = new_job("order.updated", [{"order_id": 1}], meta={"version": 1})
    job.update(fields)
    return job


# What an application may hand `append` that can never be appended, by the error it raises.
BAD_INPUTS: dict[str, tuple[Any, type[AppendError]]] = {
    "uuidv4": (_bad(id="0190a0e4-7d3a-4b5c-8d6e-0123456789ab"), InvalidEvent),
    "args-object": (_bad(args={"order_id": 1}), InvalidEvent),
    "nul": (_bad(args=["a\x00b"]), InvalidEvent),
    "surrogate": (_bad(args=["\ud800"]), InvalidEvent),
    "nan": (_bad(args=[float("nan")]), InvalidEvent),
    "infinity": (_bad(args=[float("-inf")]), InvalidEvent),
    "unserializable": (_bad(args=[object()]), InvalidEvent),
    "deep": (_bad(args=_nested(300)), InvalidEvent),
    "too-deep-for-json": (_bad(args=_nested(100_000)), InvalidEvent),
    "not-a-mapping": (["id", "type"], InvalidEvent),
    "too-large": (_bad(args=["x" * (2 * 1024 * 1024)]), EventTooLarge),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
async def test_every_bad_input_is_an_append_error(driver: Driver, shop: Shop, bad: str) -> None:
    """Each bad input of the table raises its `AppendError` through the driver, inside the
    caller's transaction, and nothing reaches the outbox."""
    envelope, error = BAD_INPUTS[bad]
    before = await shop.conn.fetchval("SELECT count(*) FROM relayd.outbox")
    tx = await _opened(driver, shop)
    try:
        with pytest.raises(error) as raised:
            await tx.append(envelope)
        assert isinstance(raised.value, AppendError)
        await tx.rollback()
    finally:
        await tx.close()
    assert await shop.conn.fetchval("SELECT count(*) FROM relayd.outbox") == before


async def test_append_rolls_back_with_the_business_change(driver: Driver, shop: Shop) -> None:
    """A rolled-back transaction leaves neither the business change nor the event."""
    event = _event()
    tx = await _opened(driver, shop)
    try:
        await tx.execute(f"INSERT INTO {shop.orders} VALUES (1)")
        await tx.append(event)
        await tx.rollback()
    finally:
        await tx.close()
    assert await shop.stored(event.id) == {"outbox": {}, "orders": []}


async def test_append_is_idempotent_and_refuses_another_envelope(
    driver: Driver, shop: Shop
) -> None:
    """The same envelope again is a no-op; another under its id is `EventIdConflict`, and
    the caller's transaction stays usable."""
    event = _event()
    other = _event(status="refunded", event_id=event.id)
    # 1. The event, committed.
    tx = await _opened(driver, shop)
    try:
        await tx.append(event)
        await tx.commit()
    finally:
        await tx.close()
    # 2. Appended again (a retried callback): nothing changes, nothing fails.
    tx = await _opened(driver, shop)
    try:
        await tx.append(event)
        # 3. Another envelope under the same id: refused, naming the id.
        with pytest.raises(EventIdConflict, match=event.id) as raised:
            await tx.append(other)
        assert raised.value.event_id == event.id
        # 4. The transaction goes on: the caller decides.
        await tx.execute(f"INSERT INTO {shop.orders} VALUES (2)")
        await tx.commit()
    finally:
        await tx.close()
    assert await shop.stored(event.id) == {"outbox": {event.id: event.envelope}, "orders": [2]}


async def _waiting_on_a_lock(observer: asyncpg.Connection, pid: int) -> bool:
    """Whether the backend `pid` is blocked on a lock (the other's transaction)."""
    waiting = await observer.fetchval(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
    )
    return bool(waiting)


@pytest.mark.parametrize("differ", [False, True], ids=["same", "different"])
async def test_concurrent_appends_of_one_id_leave_one_row(
    driver: Driver, shop: Shop, differ: bool
) -> None:
    """Two transactions appending one id at once: the second waits for the first, then
    finds its row: one row, and `EventIdConflict` if the envelopes differ."""
    first_event = _event()
    second_event = _event(status="refunded", event_id=first_event.id) if differ else first_event
    first = await _opened(driver, shop)
    second = await _opened(driver, shop)
    try:
        # 1. The first appends and holds its transaction open.
        await first.append(first_event)
        # 2. The second's append blocks on the first's uncommitted row.
        appending = asyncio.create_task(second.append(second_event))
        await eventually(lambda: _waiting_on_a_lock(shop.conn, second.pid), timeout_s=10)
        assert not appending.done()
        # 3. The first commits; the second's append ends.
        await first.commit()
        if differ:
            with pytest.raises(EventIdConflict, match=first_event.id):
                await appending
        else:
            await appending
        await second.commit()
    finally:
        await first.close()
        await second.close()
    assert await shop.stored(first_event.id) == {
        "outbox": {first_event.id: first_event.envelope},
        "orders": [],
    }


async def test_the_bound_is_the_size_the_relay_reads(shop: Shop) -> None:
    """`max_envelope_bytes` holds for the stored text as the relay measures it (jsonb's
    printing, UTF-8), non-ASCII data included."""
    event = OrderUpdated.new(OrderUpdatedV1(order_id=1, status="payé ✓ " * 200))
    async with shop.conn.transaction():
        await producer.append(shop.conn, event)
    size = await shop.conn.fetchval(
        "SELECT octet_length(convert_to(job::text, 'UTF8')) FROM relayd.outbox WHERE event_id = $1",
        event.id,
    )
    other = OrderUpdated.new(OrderUpdatedV1(order_id=1, status="payé ✓ " * 200))
    assert len(other.job.encode()) == len(event.job.encode())
    async with shop.conn.transaction():
        with pytest.raises(EventTooLarge, match=f"{size} bytes"):
            await producer.append(
                shop.conn, other, outbox=Outbox.from_sink({"max_envelope_bytes": size - 1})
            )
        await producer.append(
            shop.conn, other, outbox=Outbox.from_sink({"max_envelope_bytes": size})
        )
    assert (await shop.stored(event.id, other.id))["outbox"] == {
        event.id: event.envelope,
        other.id: other.envelope,
    }


async def test_an_application_jsonb_codec_changes_nothing(shop: Shop) -> None:
    """An asyncpg connection with its own jsonb codec (dicts in and out) appends the same
    envelope, not a JSON string of it."""
    event = _event()
    conn = await asyncpg.connect(shop.dsn)
    try:
        await conn.set_type_codec(
            "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )
        for _ in range(2):
            async with conn.transaction():
                await producer.append(conn, event)
    finally:
        await conn.close()
    assert (await shop.stored(event.id))["outbox"] == {event.id: event.envelope}


async def test_plain_jobs_append_idempotently(shop: Shop) -> None:
    """An OJS job from `new_job` appends like an event: once, then a no-op."""
    job = new_job("order.fulfill", [{"order_id": 1}], queue="orders")
    for _ in range(2):
        async with shop.conn.transaction():
            await producer.append(shop.conn, job)
    assert (await shop.stored(job["id"]))["outbox"] == {job["id"]: job}


async def test_enqueue_many_is_one_statement(shop: Shop) -> None:
    """`enqueue_many` inserts every job with one statement (the rows share one command id:
    the outbox's CHECK constraints are prepared and its trigger fired once, not per row),
    in order, as the jobs' own JSON (an application's jsonb codec changes nothing), and
    all or nothing: a taken id fails the whole call."""
    jobs = [new_job("order.fulfill", [{"order_id": n}], queue="orders") for n in range(10)]
    conn = await asyncpg.connect(shop.dsn)
    try:
        await conn.set_type_codec(
            "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )
        async with conn.transaction():
            assert await producer.enqueue_many(conn, jobs) == 10
            assert await producer.enqueue_many(conn, []) == 0
        with pytest.raises(asyncpg.UniqueViolationError):
            await producer.enqueue_many(conn, [new_job("order.fulfill", [{}]), jobs[3]])
    finally:
        await conn.close()
    ids = [job["id"] for job in jobs]
    rows = await shop.conn.fetch(
        "SELECT event_id::text AS id, cmin::text::int AS command FROM relayd.outbox "
        "WHERE event_id = ANY($1::uuid[]) ORDER BY available_at, event_id",
        ids,
    )
    assert [row["id"] for row in rows] == ids
    assert {row["command"] for row in rows} == {rows[0]["command"]}
    assert (await shop.stored(*ids))["outbox"] == {job["id"]: job for job in jobs}
    assert (
        await shop.conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE job -> 'args' = '[{}]'")
        == 0
    )


async def test_repeatable_read_refuses_the_racing_append(shop: Shop) -> None:
    """Under REPEATABLE READ the second of two racing appends fails with a serialization
    failure (40001); its retried transaction sees the row and gets `EventIdConflict`."""
    event = _event()
    other = _event(status="refunded", event_id=event.id)
    first = await asyncpg.connect(shop.dsn)
    second = await asyncpg.connect(shop.dsn)
    try:
        # 1. The first appends and holds its transaction open.
        first_tx = first.transaction(isolation="repeatable_read")
        await first_tx.start()
        await producer.append(first, event)
        # 2. The second's append waits for it; the first commits.
        second_tx = second.transaction(isolation="repeatable_read")
        await second_tx.start()
        appending = asyncio.create_task(producer.append(second, other))
        await eventually(
            lambda: _waiting_on_a_lock(shop.conn, second.get_server_pid()), timeout_s=10
        )
        await first_tx.commit()
        # 3. The row is not in the second's snapshot: PostgreSQL refuses to go on.
        with pytest.raises(asyncpg.SerializationError):
            await appending
        await second_tx.rollback()
        # 4. The caller's retry, in a new transaction, sees the row.
        async with second.transaction(isolation="repeatable_read"):
            with pytest.raises(EventIdConflict):
                await producer.append(second, other)
    finally:
        await first.close()
        await second.close()
    assert await shop.stored(event.id) == {"outbox": {event.id: event.envelope}, "orders": []}


async def test_append_outside_a_transaction_is_refused(shop: Shop) -> None:
    """On a connection in no transaction (asyncpg outside `transaction()`, psycopg in
    autocommit), `append` refuses rather than commit the event alone."""
    event = _event()
    with pytest.raises(NotInTransaction, match="in none"):
        await producer.append(shop.conn, event)
    sync = await asyncio.to_thread(lambda: psycopg.connect(shop.dsn, autocommit=True))
    try:
        with pytest.raises(NotInTransaction):
            producer_psycopg.append(sync, event)
        with sync.transaction():
            producer_psycopg.append(sync, event)
    finally:
        sync.close()
    async with await psycopg.AsyncConnection.connect(shop.dsn, autocommit=True) as aconn:
        with pytest.raises(NotInTransaction):
            await producer_psycopg.append(aconn, event)
    assert (await shop.stored(event.id))["outbox"] == {event.id: event.envelope}


async def test_an_appended_event_is_the_job_the_ojs_sink_enqueues(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """The relay publishes an appended event unchanged: the OJS server holds its type,
    `args = [data]` and meta, on its queue, once."""
    shipped = define_event("order.shipped", 1, OrderUpdatedV1, queue="orders")
    event = shipped.new(OrderUpdatedV1(order_id=7, status="shipped"))
    async with conn.transaction():
        await producer.append(conn, event)
    await run_until_idle(relay_settings(database.dsn, emulator.url))
    entry = emulator.emulator.ledger()[event.id]
    assert entry.created == 1
    assert entry.queue == "orders"
    assert entry.job is not None
    assert {key: entry.job[key] for key in ("id", "type", "args", "meta")} == {
        key: event.envelope[key] for key in ("id", "type", "args", "meta")
    }


def _key() -> str:
    """A key of the test's own: the module's tests share one database and its numbering."""
    return f"order-{uuid.uuid4().hex[:12]}"


async def test_keyed_appends_are_numbered_in_commit_order(driver: Driver, shop: Shop) -> None:
    """A key's rows, each appended in a transaction of its own, by a key function, by `key=`
    for a plain job and for an event without one, are stored under the key and numbered
    1, 2, 3 by the outbox's trigger, out of the unordered claim's reach. Appended again,
    under the same key, a row is a no-op; under no key or another key, a conflict."""
    key = _key()
    changed = OrderChanged.new(OrderChangedV1(order_ref=key, status="paid"))
    job = new_job("order.fulfill", [{"order_ref": key}], queue="orders")
    updated = _event()
    for event, given in ((changed, None), (job, key), (updated, key)):
        tx = await _opened(driver, shop)
        try:
            await tx.append(event, key=given)
            await tx.commit()
        finally:
            await tx.close()
    ids = [changed.id, job["id"], updated.id]
    assert await shop.keyed(key) == [(ids[0], 1, True), (ids[1], 2, True), (ids[2], 3, True)]
    tx = await _opened(driver, shop)
    try:
        await tx.append(changed)
        await tx.append(job, key=key)
        with pytest.raises(EventIdConflict, match=job["id"]):
            await tx.append(job)
        with pytest.raises(EventIdConflict, match=updated.id):
            await tx.append(updated, key=_key())
        await tx.commit()
    finally:
        await tx.close()
    assert [row[0] for row in await shop.keyed(key)] == ids
    assert (await shop.stored(*ids))["outbox"] == {
        changed.id: changed.envelope,
        job["id"]: job,
        updated.id: updated.envelope,
    }


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
async def test_a_second_writer_of_a_key_waits_for_the_first(
    driver: Driver, shop: Shop, first_ends: str
) -> None:
    """Two transactions appending events of one key: the second waits on the first's lock
    of the key until the first ends, then takes the next number (after a commit) or the
    first (after a rollback): the numbers follow the commits."""
    key = _key()
    first_event, second_event = (
        OrderChanged.new(OrderChangedV1(order_ref=key, status=status))
        for status in ("paid", "shipped")
    )
    first = await _opened(driver, shop)
    second = await _opened(driver, shop)
    try:
        # 1. The first appends and holds its transaction open.
        await first.append(first_event)
        # 2. The second's append of another event of the key blocks on the first.
        appending = asyncio.create_task(second.append(second_event))
        await eventually(lambda: _waiting_on_a_lock(shop.conn, second.pid), timeout_s=10)
        assert not appending.done()
        # 3. The first ends; the second's append goes on, numbered after what committed.
        await (first.commit() if first_ends == "commit" else first.rollback())
        await appending
        await second.commit()
    finally:
        await first.close()
        await second.close()
    expected = [(second_event.id, 1, True)]
    if first_ends == "commit":
        expected = [(first_event.id, 1, True), (second_event.id, 2, True)]
    assert await shop.keyed(key) == expected


# A webhook sink whose route of order.changed is ordered, and whose other events go
# unordered to its default URL.
ORDERED = Outbox.from_sink(
    {
        "kind": "webhook",
        "url": "https://hooks.example.com/all",
        "routes": [
            {"type": "order.changed", "url": "https://hooks.example.com/o", "ordering": "key"}
        ],
    }
)


async def test_an_ordered_route_refuses_an_event_without_a_key(driver: Driver, shop: Shop) -> None:
    """On an ordered route, an event without a key is `MissingKey` and nothing is written;
    the same transaction goes on and appends it with a key. An unordered route's event
    stores the key it is given."""
    key = _key()
    unkeyed = define_event("order.changed", 1, OrderChangedV1).new(
        OrderChangedV1(order_ref=key, status="paid")
    )
    updated = _event()
    tx = await _opened(driver, shop)
    try:
        with pytest.raises(MissingKey, match=unkeyed.id):
            await tx.append(unkeyed, outbox=ORDERED)
        await tx.append(unkeyed, outbox=ORDERED, key=key)
        await tx.append(updated, outbox=ORDERED, key=key)
        await tx.commit()
    finally:
        await tx.close()
    assert await shop.keyed(key) == [(unkeyed.id, 1, True), (updated.id, 2, True)]


async def test_enqueue_numbers_a_keys_jobs_in_their_order(shop: Shop) -> None:
    """`enqueue_many(keys=...)` stores each job's key (None: none, due at once as before)
    and numbers a key's jobs in the list's order, in one statement; `enqueue(key=...)`
    takes the key's next number. A bad key, or a key too few, is `InvalidEvent` and nothing
    is written."""
    first, second = _key(), _key()
    jobs = [new_job("order.fulfill", [{"n": n}]) for n in range(5)]
    ids = [job["id"] for job in jobs]
    alone = new_job("order.fulfill", [{"n": 5}])
    async with shop.conn.transaction():
        keys = [first, None, first, second, first]
        assert await producer.enqueue_many(shop.conn, jobs, keys=iter(keys)) == 5
        assert await producer.enqueue(shop.conn, alone, key=second) == alone["id"]
        with pytest.raises(InvalidEvent, match="2 jobs and 1 keys"):
            await producer.enqueue_many(
                shop.conn, [new_job("x.y", []), new_job("x.y", [])], keys=[first]
            )
        with pytest.raises(InvalidEvent, match="job 1: the ordering key is empty"):
            await producer.enqueue_many(
                shop.conn, [new_job("x.y", []), new_job("x.y", [])], keys=[first, ""]
            )
    assert await shop.keyed(first) == [(ids[0], 1, True), (ids[2], 2, True), (ids[4], 3, True)]
    assert await shop.keyed(second) == [(ids[3], 1, True), (alone["id"], 2, True)]
    unkeyed = await shop.conn.fetchrow(
        "SELECT ordering_key, ordering_seq, available_at < 'infinity' AS due "
        "FROM relayd.outbox WHERE event_id = $1",
        ids[1],
    )
    assert unkeyed is not None
    assert dict(unkeyed) == {"ordering_key": None, "ordering_seq": None, "due": True}
    assert (
        await shop.conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE job ->> 'type' = 'x.y'")
        == 0
    )


async def test_repeatable_read_refuses_the_second_writer_of_a_key(shop: Shop) -> None:
    """Under REPEATABLE READ the second of two transactions appending events of one key
    fails with a serialization failure (40001) once the first commits: the key's number was
    taken after its snapshot. Its retried transaction takes the next number."""
    key = _key()
    first_event, second_event = (
        OrderChanged.new(OrderChangedV1(order_ref=key, status=status))
        for status in ("paid", "shipped")
    )
    first = await asyncpg.connect(shop.dsn)
    second = await asyncpg.connect(shop.dsn)
    try:
        # 1. The first appends and holds its transaction open.
        first_tx = first.transaction(isolation="repeatable_read")
        await first_tx.start()
        await producer.append(first, first_event)
        # 2. The second's append waits for it; the first commits.
        second_tx = second.transaction(isolation="repeatable_read")
        await second_tx.start()
        appending = asyncio.create_task(producer.append(second, second_event))
        await eventually(
            lambda: _waiting_on_a_lock(shop.conn, second.get_server_pid()), timeout_s=10
        )
        await first_tx.commit()
        # 3. The key's number changed after the second's snapshot: PostgreSQL refuses.
        with pytest.raises(asyncpg.SerializationError):
            await appending
        await second_tx.rollback()
        # 4. The caller's retry, in a new transaction, is numbered after the first.
        async with second.transaction(isolation="repeatable_read"):
            await producer.append(second, second_event)
    finally:
        await first.close()
        await second.close()
    assert await shop.keyed(key) == [(first_event.id, 1, True), (second_event.id, 2, True)]
