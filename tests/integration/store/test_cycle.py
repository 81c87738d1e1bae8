"""The relay cycle's statements (relayd/store/sql/cycle.sql) on real PostgreSQL: what a
retry's settle writes of the attempt it records."""

from __future__ import annotations

import uuid

import asyncpg

from relayd.core.rows import ClaimedRow
from relayd.store import Store
from tests.support import produce


async def _claim(store: Store) -> tuple[uuid.UUID, dict[str, ClaimedRow]]:
    owner = uuid.uuid4()
    rows = await store.claim(10, owner, 30.0)
    return owner, {row.event_id: row for row in rows}


async def test_a_retry_that_sent_nothing_restores_the_previous_attempt_time(
    conn: asyncpg.Connection, store: Store
) -> None:
    """A row whose attempt certainly sent nothing (refused before any byte left) is not
    claimed next as one an earlier attempt may have delivered: its previous attempt time
    comes back (none, or an earlier ambiguous attempt's), as a release restores it. A row
    whose attempt may have reached the sink keeps this attempt's time."""
    fresh, unsent, sent = await produce(conn, 3)
    # An earlier attempt, an hour ago, that may have delivered `unsent`.
    earlier = await conn.fetchval(
        "UPDATE relayd.outbox SET attempts = 1, last_attempt_at = now() - interval '1 hour' "
        "WHERE event_id = $1 RETURNING last_attempt_at",
        unsent,
    )
    owner, rows = await _claim(store)
    assert {i: r.claimed_before for i, r in rows.items()} == {
        fresh: False,
        unsent: True,
        sent: False,
    }
    ordered = [rows[fresh], rows[unsent], rows[sent]]
    await store.settle_retry(
        owner,
        [r.event_id for r in ordered],
        [0.0] * 3,
        ["not connected", "not connected", "no answer in time"],
        [1, 1, 1],
        [False, False, True],
        [r.previous_attempt_at for r in ordered],
    )
    _, again = await _claim(store)
    assert {i: r.claimed_before for i, r in again.items()} == {
        fresh: False,  # never sent: not a re-send
        unsent: True,  # the hour-old attempt still may have delivered it
        sent: True,  # this attempt may have
    }
    assert again[unsent].previous_attempt_at == earlier
    assert [again[i].attempts for i in (fresh, unsent, sent)] == [1, 2, 1]  # refunded
