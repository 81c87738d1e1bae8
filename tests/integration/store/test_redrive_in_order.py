"""Redriving dead letters of ordered keys on real PostgreSQL: a redriven row goes back to its
place in its key; one whose key moved on (later rows delivered) is refused, the whole
action with it, unless the operator says --out-of-order; each batch looks again once its
rows are locked."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg

from relayd.core.rows import ClaimBatch
from relayd.operator.dlq_actions import DlqRequest, Selection, act
from relayd.store import Store
from relayd.store.records import AuditEntry, DeadLetterFilter, DlqAction, OutOfOrder, RowOutcome
from tests.support import insert_keyed, produce

AUDIT = AuditEntry(actor="test-operator", action=DlqAction.REDRIVE.value)
FAR = datetime(2999, 1, 1, tzinfo=UTC)  # a walk's end past every row


async def _claim(store: Store) -> ClaimBatch:
    return await store.claim_from(100, uuid.uuid4(), 30.0, None, ordered=True)


async def _kill_head(store: Store) -> str:
    """Claim the key's head and dead-letter it, as the relay does on a route that skips."""
    owner = uuid.uuid4()
    [head] = (await store.claim_from(10, owner, 30.0, None, ordered=True)).rows
    await store.settle_dead(owner, [head.event_id], ["sink_rejected"], ["400 bad order"])
    return head.event_id


async def _publish_head(store: Store) -> str:
    owner = uuid.uuid4()
    [head] = (await store.claim_from(10, owner, 30.0, None, ordered=True)).rows
    await store.settle_published(owner, [head.event_id], ["stored"])
    return head.event_id


def _request(ids: list[str] | None, *, out_of_order: bool = False) -> DlqRequest:
    selection = Selection(ids, DeadLetterFilter(), FAR)
    return DlqRequest(DlqAction.REDRIVE, selection, AUDIT, out_of_order=out_of_order)


async def test_a_dead_letter_whose_key_moved_on_is_refused_unless_out_of_order(
    conn: asyncpg.Connection, store: Store
) -> None:
    """Key k: its first row dead, its second published, its third pending. Redriving the
    first is refused, by id and with --all alike, naming the row and how many later rows
    were delivered, and nothing changes (an unordered dead letter in the same --all is not
    redriven either); --out-of-order redrives it, back to its place: the key's head."""
    first, second, _third = await insert_keyed(conn, "k", 3)
    assert await _kill_head(store) == first
    assert await _publish_head(store) == second
    [plain] = await produce(conn, 1)
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now(), dead_reason = 'max_attempts' "
        "WHERE event_id = $1",
        plain,
    )
    refused = OutOfOrder(first, "k", 1)
    for ids in ([first], None):
        summary = await act(store, _request(ids))
        assert summary.refused
        assert (summary.out_of_order, summary.out_of_order_total) == ([refused], 1)
        assert (summary.matched, summary.audit_id) == (0, None)
        assert summary.as_json()["refused"] == "out_of_order"
    dead = await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL")
    assert dead == 2
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_audit") == 0

    summary = await act(store, _request([first], out_of_order=True))
    assert (summary.refused, summary.counts[RowOutcome.REDRIVEN]) == (False, 1)
    assert summary.selection == {"named_ids": 1, "out_of_order": True}
    waiting = await conn.fetchval(
        "SELECT available_at = 'infinity' FROM relayd.outbox WHERE event_id = $1", first
    )
    assert waiting  # where the ordered claim finds a key's head
    assert [r.event_id for r in (await _claim(store)).rows] == [first]  # not the third row yet


async def test_a_redriven_row_whose_later_rows_still_wait_goes_first(
    conn: asyncpg.Connection, store: Store
) -> None:
    """Nothing of the key was delivered after it: no refusal, and the redriven row is the
    key's head again, sent before the rows that waited behind it."""
    first, second = await insert_keyed(conn, "k", 2)
    assert await _kill_head(store) == first
    summary = await act(store, _request(None))
    assert (summary.refused, summary.counts[RowOutcome.REDRIVEN]) == (False, 1)
    assert [r.event_id for r in (await _claim(store)).rows] == [first]
    assert second  # behind it, still pending


async def test_a_batch_looks_again_once_its_rows_are_locked(
    conn: asyncpg.Connection, store: Store
) -> None:
    """A later row published after the command looked: the batch skips the row as out of
    order instead of redriving it."""
    first, second = await insert_keyed(conn, "k", 2)
    await _kill_head(store)
    await _publish_head(store)
    [plain] = await produce(conn, 1)
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now(), dead_reason = 'conflict' WHERE event_id = $1",
        plain,
    )
    batch = await store.act_on_dead_letters(
        DlqAction.REDRIVE, [first, plain], audit=AUDIT, audit_id=None
    )
    assert [(r.event_id, r.outcome) for r in batch.results] == [
        (first, RowOutcome.OUT_OF_ORDER),
        (plain, RowOutcome.REDRIVEN),
    ]
    assert batch.results[0].detail == (
        "out of order: 1 later row of its key was delivered (key 'k'); "
        "--out-of-order redrives it all the same"
    )
    assert second
