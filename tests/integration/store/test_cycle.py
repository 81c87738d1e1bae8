"""The relay cycle's statements (relayd/store/sql/cycle.sql) on real PostgreSQL: what a
retry's settle writes of the attempt it records."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

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


async def test_a_claim_tells_when_the_first_row_it_left_is_due(
    conn: asyncpg.Connection, store: Store
) -> None:
    """The claim's answer carries what `next_due_s` would say once its rows are settled: the
    seconds until the first pending row it did not take is due, none when there is none, a
    paused row left out, so that a worker whose claim came back short sleeps without asking."""
    for ordered in (False, True):
        [due_now] = await produce(conn, 1)
        [later] = await produce(conn, 1)
        await conn.execute(
            "UPDATE relayd.outbox SET available_at = now() + interval '40 seconds' "
            "WHERE event_id = $1",
            later,
        )
        owner = uuid.uuid4()
        batch = await store.claim_from(10, owner, 30.0, None, ordered=ordered)
        assert [row.event_id for row in batch.rows] == [due_now]
        assert batch.next_due_s is not None
        assert 35 < batch.next_due_s <= 40  # the row it left, not its own (leased for 30 s)
        await store.settle_published(owner, [due_now], ["completed"])
        assert batch.next_due_s == pytest.approx(await store.next_due_s(), abs=1.0)
        await conn.execute("UPDATE relayd.outbox SET published_at = now()")
        empty = await store.claim_from(10, uuid.uuid4(), 30.0, None, ordered=ordered)
        assert (empty.rows, empty.next_due_s) == ([], None)


async def test_a_claim_tells_whether_rows_of_keys_are_pending(
    conn: asyncpg.Connection, store: Store
) -> None:
    """Without rows of ordered keys pending, a worker claims with the smaller statement: each
    claim says whether there are any. The unordered claim never takes a row of a key before
    it was its key's head (claimed once by the ordered claim)."""
    await produce(conn, 1)
    plain = await store.claim_from(10, uuid.uuid4(), 30.0, None)
    assert (len(plain.rows), plain.keyed) == (1, False)
    await conn.execute(
        "INSERT INTO relayd.outbox (event_id, job, ordering_key) "
        'SELECT relayd.relayd_uuidv7(), \'{"type": "t.x", "args": []}\', \'k\''
    )
    plain = await store.claim_from(10, uuid.uuid4(), 30.0, None)
    assert (plain.rows, plain.keyed) == ([], True)
    ordered = await store.claim_from(10, uuid.uuid4(), 30.0, None, ordered=True)
    assert [row.ordering_key for row in ordered.rows] == ["k"]
    assert ordered.keyed  # leased, still pending
    await conn.execute("UPDATE relayd.outbox SET published_at = now()")
    assert not (await store.claim_from(10, uuid.uuid4(), 30.0, None, ordered=True)).keyed
