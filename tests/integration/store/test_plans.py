"""How PostgreSQL plans the statements of `relayd run`'s sessions: once per connection, not at
every execution, whatever the batch's size (docs/performance.md#what-a-row-costs-the-server)."""

from __future__ import annotations

import uuid

import asyncpg

from relayd.store import Store
from tests.support import Database, produce

CYCLES = 12  # PostgreSQL's plan cache decides after five executions with values


async def _plans(store: Store) -> dict[str, tuple[int, int]]:
    """Generic and custom plans so far of the store's one session, by statement name."""
    records = await store._pool.fetch(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
    )
    found: dict[str, tuple[int, int]] = {}
    for name in ("claim_ordered", "settle_published"):
        text = store._q[name]
        [counts] = [(r["generic_plans"], r["custom_plans"]) for r in records if r[0] == text]
        found[name] = counts
    return found


async def _one_row_cycles(conn: asyncpg.Connection, store: Store) -> None:
    """Claims and settles of one row each, as a quiet outbox sees them."""
    for _ in range(CYCLES):
        await produce(conn, 1)
        owner = uuid.uuid4()
        batch = await store.claim_from(100, owner, 30.0, None, ordered=True)
        [row] = batch.rows
        assert await store.settle_published(owner, [row.event_id], ["completed"]) == {row.event_id}


async def test_the_daemon_plans_its_cycle_once(
    conn: asyncpg.Connection, database: Database
) -> None:
    """With PostgreSQL's default plan cache mode, a daemon session (sequential scans priced
    out) plans a settle of one row for its values at every execution: the short array makes
    that plan look cheaper than the generic one. `relayd run`'s sessions plan the claim and
    the settle once."""
    daemon = await Store.connect(database.dsn, database.table, max_size=1, daemon=True)
    default = await Store.connect(database.dsn, database.table, max_size=1, daemon=True)
    try:
        await default._pool.execute("SET plan_cache_mode = auto")
        await _one_row_cycles(conn, default)
        custom = await _plans(default)
        await _one_row_cycles(conn, daemon)
        generic = await _plans(daemon)
    finally:
        await daemon.close()
        await default.close()
    assert custom["settle_published"] == (0, CYCLES)  # what the setting is for
    assert generic == {"claim_ordered": (CYCLES, 0), "settle_published": (CYCLES, 0)}
