"""Appending events from every driver the producer supports, on PostgreSQL: in the caller's
transaction (committed and rolled back with the business change), idempotent by id, and a
different envelope under a taken id refused, also when two transactions race
(docs/producers.md)."""

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
