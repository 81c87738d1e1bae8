"""The producer's database role: exactly what `relayd grants --role producer` prints lets
every driver append (and append again, a no-op), keyed events included, and `enqueue_many`
insert, on an outbox whose functions PUBLIC may not execute; each of those grants taken
away, an append fails (for the key numbers' table, a keyed append)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import asyncpg
import pytest
from pydantic import BaseModel

from relayd import producer
from relayd.store.privileges import Kind, Obj, Role, grant_script, role_privileges
from tests.integration.producer.drivers import DRIVERS, Driver
from tests.support import DEFAULT_TABLE, Database, dsn_as, relayd_env, run_relayd_blocking


class ShippedV1(BaseModel):
    order_id: int


Shipped = producer.define_event("order.shipped", 1, ShippedV1)
# The same event, ordered per order: its rows are numbered by the outbox's trigger, which
# runs as the inserting role.
KeyedShipped = producer.define_event(
    "order.shipped", 1, ShippedV1, key=lambda data: f"order-{data.order_id}"
)


@pytest.fixture(scope="module")
def producer_role(module_database: Database) -> Iterator[str]:
    """A login role holding exactly the producer's script (as `relayd grants` prints it), in
    a database where PUBLIC lost EXECUTE on relayd's functions (a hardened database): what
    the script grants is all the role has."""
    name = f"app_{uuid.uuid4().hex[:8]}"
    printed = run_relayd_blocking(
        "grants", "--role", "producer", "--to", name, env=relayd_env({"RELAYD_CONFIG": "/dev/null"})
    )
    assert printed.returncode == 0, printed.stderr
    asyncio.run(
        _as_admin(
            module_database,
            f'CREATE ROLE "{name}" LOGIN',
            "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA relayd FROM PUBLIC",
            printed.stdout,
        )
    )
    yield name
    asyncio.run(_as_admin(module_database, f'DROP OWNED BY "{name}"', f'DROP ROLE "{name}"'))


async def _as_admin(database: Database, *scripts: str) -> None:
    admin = await asyncpg.connect(database.dsn)
    try:
        for script in scripts:
            await admin.execute(script)
    finally:
        await admin.close()


async def _stored(dsn: str, event_id: str) -> int:
    admin = await asyncpg.connect(dsn)
    try:
        count: int = await admin.fetchval(
            "SELECT count(*) FROM relayd.outbox WHERE event_id = $1", event_id
        )
    finally:
        await admin.close()
    return count


@pytest.mark.parametrize("driver", DRIVERS, ids=[driver.name for driver in DRIVERS])
async def test_every_driver_appends_under_the_producer_role(
    module_database: Database, producer_role: str, driver: Driver
) -> None:
    """Under the producer's grants alone: an event and a keyed event appended and committed,
    then appended again in a new transaction (the retried callback: compared, nothing
    written)."""
    dsn = dsn_as(module_database.dsn, producer_role)
    event = Shipped.new(ShippedV1(order_id=7))
    keyed = KeyedShipped.new(ShippedV1(order_id=7))
    for _ in range(2):
        tx = await driver.open(dsn)
        try:
            await tx.append(event)
            await tx.append(keyed)
            await tx.commit()
        finally:
            await tx.close()
    assert await _stored(module_database.dsn, event.id) == 1
    assert await _stored(module_database.dsn, keyed.id) == 1


async def test_plain_jobs_insert_under_the_producer_role(
    module_database: Database, producer_role: str
) -> None:
    """`enqueue` and `enqueue_many` (asyncpg), with keys or without, need nothing more than
    `append`."""
    conn = await asyncpg.connect(dsn_as(module_database.dsn, producer_role))
    try:
        jobs = [producer.new_job("order.shipped", [{"order_id": n}]) for n in range(5)]
        async with conn.transaction():
            await producer.enqueue(conn, jobs[0])
            await producer.enqueue(conn, jobs[1], key=f"order-{jobs[1]['id']}")
            assert await producer.enqueue_many(conn, jobs[2:3]) == 1
            assert await producer.enqueue_many(conn, jobs[3:], keys=["order-a", None]) == 2
    finally:
        await conn.close()
    for job in jobs:
        assert await _stored(module_database.dsn, job["id"]) == 1


async def test_each_grant_of_the_producer_is_needed(database: Database) -> None:
    """For each privilege of the producer's list in turn, taken away (from PUBLIC too, for
    a function): appending a new event, a new keyed event, or the same event again, is
    refused for want of it; granted back, all work. The key numbers' table is needed by
    keyed events only: without it, an event without a key is still appended."""
    name = f"app_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(database.dsn)
    try:
        await admin.execute(f'CREATE ROLE "{name}" LOGIN')
        await admin.execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA relayd FROM PUBLIC")
        for statement in grant_script(Role.PRODUCER, DEFAULT_TABLE, name, cleanup=True).statements:
            await admin.execute(statement)
        dsn = dsn_as(database.dsn, name)
        appended = Shipped.new(ShippedV1(order_id=1))
        await _append(dsn, appended)
        wanted_by_keys = 0
        for wanted in role_privileges(Role.PRODUCER, cleanup=True):
            target = "SCHEMA relayd" if wanted.obj.kind is Kind.SCHEMA else None
            grant = (
                f'GRANT {wanted.privilege} ON {target or wanted.obj.sql(DEFAULT_TABLE)} TO "{name}"'
            )
            await admin.execute(grant.replace("GRANT", "REVOKE", 1).replace(" TO ", " FROM "))
            if wanted.obj is Obj.KEY_SEQS:
                wanted_by_keys += 1
                await _append(dsn, Shipped.new(ShippedV1(order_id=2)), appended)
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                # A new event needs the insert's privileges, a keyed one the numbering's
                # too; the same again, the comparison's (the insert finds its id taken).
                await _append(
                    dsn,
                    Shipped.new(ShippedV1(order_id=2)),
                    KeyedShipped.new(ShippedV1(order_id=2)),
                    appended,
                )
            await admin.execute(grant)
            await _append(
                dsn,
                Shipped.new(ShippedV1(order_id=3)),
                KeyedShipped.new(ShippedV1(order_id=3)),
                appended,
            )
        # SELECT, INSERT and UPDATE: the trigger's upsert of the key's last number.
        assert wanted_by_keys == 3
    finally:
        await admin.execute(f'DROP OWNED BY "{name}"')
        await admin.execute(f'DROP ROLE "{name}"')
        await admin.close()


async def _append(dsn: str, *events: producer.Event) -> None:
    """Each event appended in one transaction of its own, in order."""
    conn = await asyncpg.connect(dsn)
    try:
        for event in events:
            async with conn.transaction():
                await producer.append(conn, event)
    finally:
        await conn.close()
