"""The history checker (tests/faults/checker.py) on real PostgreSQL and the in-process
emulator: a clean run with a real relay is clean, and each kind of violation, made by hand
with relayd's own statements, SQL and direct POSTs to the sink, is reported with exactly its
ids and their timelines."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import asyncpg
import pytest

from relayd.producer import new_job, uuid7
from relayd.store import Store
from relayd.store.records import AuditEntry, DlqAction
from relayd.testing.emulator import EmulatorConfig, FaultRule, RunningEmulator, start_emulator
from tests.faults.checker import Kind, Report, assert_clean, check, install_history
from tests.support import Database, drained, eventually, produce, relay_settings, running

LEASE_S = 30.0
# What tests do instead of waiting for a lease to run out (as tests/faults/harness.py does).
EXPIRE_LEASES = """
UPDATE relayd.outbox SET available_at = now()
WHERE lease_owner IS NOT NULL AND published_at IS NULL AND dead_at IS NULL
  AND available_at > now()
"""
# relayd's settles as a relay would write them without `AND lease_owner = $owner`.
UNFENCED_PUBLISHED = """
UPDATE relayd.outbox SET published_at = now(), lease_owner = NULL, sink_state = 'available'
WHERE event_id = $1
"""
UNFENCED_DEAD = """
UPDATE relayd.outbox SET lease_owner = NULL, dead_at = now(), dead_reason = 'conflict',
                         last_error = 'the sink holds a different job under this id'
WHERE event_id = $1
"""
UNFENCED_RETRY = """
UPDATE relayd.outbox SET lease_owner = NULL, available_at = now() + interval '1 second',
                         attempts = greatest(attempts - 1, 0), last_error = 'HTTP 503'
WHERE event_id = $1
"""


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _envelope(conn: asyncpg.Connection, event_id: str) -> dict[str, Any]:
    text: str = await conn.fetchval(
        "SELECT job::text FROM relayd.outbox WHERE event_id = $1", event_id
    )
    envelope: dict[str, Any] = json.loads(text)
    return envelope


async def _post(http: aiohttp.ClientSession, sink_url: str, job: Mapping[str, Any]) -> int:
    """POST one job to the sink the way relayd does; the answer's status."""
    async with http.post(f"{sink_url}/ojs/v1/jobs", json=job) as answer:
        return answer.status


async def _claim(store: Store, owner: uuid.UUID, limit: int = 100) -> list[str]:
    """relayd's claim statement, for `owner`: the ids it leased."""
    return [row.event_id for row in await store.claim(limit, owner, LEASE_S)]


def _only(report: Report, kind: Kind, ids: set[str]) -> None:
    """The report found `ids` of `kind` and nothing else, each with its timeline in format()."""
    text = report.format()
    assert {(f.kind, f.event_id) for f in report.findings} == {(kind, i) for i in ids}, text
    for event_id in ids:
        assert report.timeline_text(event_id) in text


async def test_a_clean_run_is_clean(
    database: Database, conn: asyncpg.Connection, store: Store, emulator: RunningEmulator
) -> None:
    """1. a relay died right after claiming five rows, whose lease is ended by hand; 2. a
    real relay drains the outbox, the sink rejecting two rows once (dead letters); 3. an
    operator retries one dead letter and discards the other, and the relay publishes it;
    4. the check is clean, with the ledger given as JSON or as the emulator's URL."""
    await install_history(conn)
    await install_history(conn)  # idempotent
    ids = await produce(conn, 30, queue="orders", meta={"trace": "t-1"})
    # 1.
    assert len(await _claim(store, uuid.uuid4(), 5)) == 5
    assert await conn.execute(EXPIRE_LEASES) == "UPDATE 5"
    # 2.
    rejected = ids[-2:]
    for event_id in rejected:
        emulator.emulator.add_fault(
            FaultRule(
                action="status", method="POST", path="/ojs/v1/jobs", job_id=event_id, status=400
            )
        )
    async with running(relay_settings(database.dsn, emulator.url, sink={"batch": "off"})):
        await eventually(lambda: drained(conn))
        dead = await conn.fetch(
            "SELECT event_id::text FROM relayd.outbox WHERE dead_at IS NOT NULL"
        )
        assert {r[0] for r in dead} == set(rejected)
        # 3.
        for action, event_id in (
            (DlqAction.REDRIVE, rejected[0]),
            (DlqAction.DISCARD, rejected[1]),
        ):
            audit = AuditEntry("test", action.value, reason="checker test")
            batch = await store.act_on_dead_letters(action, [event_id], audit=audit, audit_id=None)
            assert [r.outcome.changed for r in batch.results] == [True]
        await eventually(lambda: drained(conn))
    # 4.
    report = await check(conn, emulator.emulator.ledger_json())
    assert report.ok, report.format()
    assert (report.rows, report.sink_jobs) == (30, 29)
    assert report.format().endswith(": clean")
    assert (await check(conn, emulator.url)).ok
    # The history saw every kind of change the rule knows.
    seen = await conn.fetchrow(
        """
        SELECT count(*) FILTER (WHERE op = 'INSERT') AS inserts,
               count(*) FILTER (WHERE old_lease_owner <> new_lease_owner) AS takeovers,
               count(*) FILTER (WHERE old_lease_owner = new_lease_owner) AS ended_by_hand,
               count(*) FILTER (WHERE old_published_at IS NULL AND new_published_at IS NOT NULL)
                   AS published,
               count(*) FILTER (WHERE old_dead_at IS NULL AND new_dead_at IS NOT NULL) AS dead,
               count(*) FILTER (WHERE old_dead_at IS NOT NULL AND new_dead_at IS NULL) AS redriven,
               count(*) FILTER (WHERE old_discarded_at IS NULL AND new_discarded_at IS NOT NULL)
                   AS discarded
        FROM relayd_test.transitions
        """
    )
    assert seen is not None
    assert dict(seen) == {
        "inserts": 30,
        "takeovers": 5,
        "ended_by_hand": 5,
        "published": 29,
        "dead": 2,
        "redriven": 1,
        "discarded": 1,
    }
    assert report.transitions > sum(seen.values())  # and every claim besides


async def test_lost_rows(
    conn: asyncpg.Connection, store: Store, emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    """Of four rows, one is published and one dead-lettered by relayd's statements; one is
    left pending and one deleted: those two are lost, and nothing else is wrong."""
    await install_history(conn)
    published, dead, pending, deleted = await produce(conn, 4)
    owner = uuid.uuid4()
    assert await _claim(store, owner, 2) == [published, dead]
    assert await _post(http, emulator.url, await _envelope(conn, published)) == 201
    assert await store.settle_published(owner, [published], ["available"]) == {published}
    assert await store.settle_dead(owner, [dead], ["sink_rejected"], ["HTTP 400"]) == {dead}
    await conn.execute("DELETE FROM relayd.outbox WHERE event_id = $1", deleted)

    report = await check(conn, emulator.emulator.ledger_json())
    assert report.lost == {pending, deleted}
    _only(report, Kind.LOST, {pending, deleted})
    details = {f.event_id: f.detail for f in report.findings}
    assert details[pending] == "pending: neither published nor dead"
    assert details[deleted].startswith("deleted by #")
    assert details[deleted].endswith("while pending")
    assert [t.effect for t in report.timelines[pending].transitions] == ["insert"]
    assert [t.effect for t in report.timelines[deleted].transitions] == ["insert", "delete"]
    text = report.timeline_text(deleted)
    assert text.startswith(f"--- {deleted} ---\n  lost: deleted by #")
    assert "outbox: no such row" in text
    assert "sink:   no ledger entry" in text
    assert " insert " in text
    assert " delete " in text
    with pytest.raises(AssertionError) as failed:
        assert_clean(report)
    message = str(failed.value)
    assert f"lost (2): {', '.join(sorted([pending, deleted]))}" in message
    assert report.timeline_text(pending) in message
    assert text in message


async def test_a_job_the_outbox_never_had_is_unexpected(
    conn: asyncpg.Connection, store: Store, emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    """A job POSTed to the sink under an id the outbox never had is unexpected; an id the
    sink was only asked about (a GET, 404) is not; a row published by relayd is fine."""
    await install_history(conn)
    [row] = await produce(conn, 1)
    owner = uuid.uuid4()
    assert await _claim(store, owner) == [row]
    assert await _post(http, emulator.url, await _envelope(conn, row)) == 201
    assert await store.settle_published(owner, [row], ["available"]) == {row}
    stray = new_job("test.stray", [{"n": 1}])
    assert await _post(http, emulator.url, stray) == 201
    unknown = uuid7()
    async with http.get(f"{emulator.url}/ojs/v1/jobs/{unknown}") as answer:
        assert answer.status == 404
    ledger = emulator.emulator.ledger_json()
    assert ledger["jobs"][unknown]["created"] == 0

    report = await check(conn, ledger)
    assert report.unexpected == {stray["id"]}
    _only(report, Kind.UNEXPECTED, {stray["id"]})
    text = report.timeline_text(stray["id"])
    assert "unexpected: created 1 time(s) on the sink; the outbox never had it" in text
    assert "outbox: no such row" in text
    assert "created 1, overwrites 0, posts 1, post_statuses [201]" in text
    assert '"type": "test.stray"' in text
    assert "history (0 transitions):" in text


async def test_a_job_created_twice_is_duplicated(
    conn: asyncpg.Connection, store: Store, http: aiohttp.ClientSession
) -> None:
    """On a sink that overwrites a reused id, a job POSTed twice is duplicated (the ledger
    read from the emulator's URL); one POSTed once is not."""
    await install_history(conn)
    twice, once = await produce(conn, 2)
    owner = uuid.uuid4()
    assert await _claim(store, owner) == [twice, once]
    async with await start_emulator(EmulatorConfig(duplicate_mode="overwrite")) as sink:
        for event_id, posts in ((twice, 2), (once, 1)):
            envelope = await _envelope(conn, event_id)
            for _ in range(posts):
                assert await _post(http, sink.url, envelope) == 201
        assert await store.settle_published(owner, [twice, once], ["available"] * 2) == {
            twice,
            once,
        }
        report = await check(conn, sink.url)
    assert report.duplicated == {twice}
    _only(report, Kind.DUPLICATED, {twice})
    text = report.timeline_text(twice)
    assert "duplicated: created 2 times, overwritten 1 times on the sink" in text
    assert "created 2, overwrites 1, posts 2, post_statuses [201, 201]" in text
    assert [t.effect for t in report.timelines[twice].transitions] == [
        "insert",
        "claim",
        "published",
    ]


async def test_rows_published_without_their_job_on_the_sink(
    conn: asyncpg.Connection, store: Store, emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    """Five rows claimed and settled as published by relayd's own (fenced) statements: one
    never POSTed, three POSTed with other args, another queue or other meta, and one as
    it is. The first four are falsely published, each naming what differs."""
    await install_history(conn)
    ids = await produce(conn, 5, queue="orders", meta={"trace": "t-1"})
    absent, other_args, other_queue, other_meta, faithful = ids
    owner = uuid.uuid4()
    assert await _claim(store, owner) == ids
    changes: dict[str, dict[str, Any]] = {
        other_args: {"args": [{"n": -1}]},
        other_queue: {"options": {"queue": "mail"}},
        other_meta: {"meta": {"trace": "t-2"}},
        faithful: {},
    }
    for event_id, change in changes.items():
        assert await _post(http, emulator.url, await _envelope(conn, event_id) | change) == 201
    assert await store.settle_published(owner, ids, ["available"] * 5) == set(ids)

    report = await check(conn, emulator.emulator.ledger_json())
    assert report.falsely_published == {absent, other_args, other_queue, other_meta}
    _only(report, Kind.FALSELY_PUBLISHED, {absent, other_args, other_queue, other_meta})
    details = {f.event_id: f.detail for f in report.findings}
    assert details == {
        absent: "published (sink_state available) but the sink never created it",
        other_args: "published (sink_state available) but the sink's job differs: args",
        other_queue: "published (sink_state available) but the sink's job differs: queue",
        other_meta: "published (sink_state available) but the sink's job differs: meta",
    }
    text = report.timeline_text(other_args)
    assert '"args": [{"n": -1}]' in text  # the sink's job
    assert '"args": [{"n": 1}]' in text  # the envelope
    assert [t.effect for t in report.timelines[absent].transitions] == [
        "insert",
        "claim",
        "published",
    ]


async def test_transitions_no_fenced_statement_makes_are_stale(
    conn: asyncpg.Connection, store: Store, emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    """Relay a claims a row, its lease runs out (ended by hand), relay b claims it again;
    then the owners settle as a relay without the owner predicate would:

    - x: b publishes (fenced); a then dead-letters it: flagged, no lease in force;
    - y: a publishes (on b's lease: by value, b's own settle); b's retry then finds no lease:
      flagged (one lease, two settles);
    - z: a's lease is handed to b by hand, not by a claim: flagged; b then settles it;
    - w: the fence at work: a's settle changes nothing, b's publishes. Not flagged.

    Every job is on the sink, so nothing else is wrong."""
    await install_history(conn)
    a, b = uuid.uuid4(), uuid.uuid4()

    async def fresh_row(*owners: uuid.UUID) -> str:
        """A new row claimed by each of `owners` in turn (each lease ended by hand before
        the next claim), its job on the sink."""
        [event_id] = await produce(conn, 1)
        for i, owner in enumerate(owners):
            if i:
                assert await conn.execute(EXPIRE_LEASES) == "UPDATE 1"
            assert await _claim(store, owner) == [event_id]
        assert await _post(http, emulator.url, await _envelope(conn, event_id)) == 201
        return event_id

    x = await fresh_row(a, b)
    assert await store.settle_published(b, [x], ["available"]) == {x}
    await conn.execute(UNFENCED_DEAD, x)
    y = await fresh_row(a, b)
    await conn.execute(UNFENCED_PUBLISHED, y)
    await conn.execute(UNFENCED_RETRY, y)
    z = await fresh_row(a)
    await conn.execute("UPDATE relayd.outbox SET lease_owner = $2 WHERE event_id = $1", z, b)
    assert await store.settle_published(b, [z], ["available"]) == {z}
    w = await fresh_row(a, b)
    assert await store.settle_published(a, [w], ["available"]) == set()
    assert await store.settle_published(b, [w], ["available"]) == {w}

    report = await check(conn, emulator.emulator.ledger_json())
    assert report.stale_token == {x, y, z}
    _only(report, Kind.STALE, {x, y, z})
    flagged = {f.event_id: f for f in report.findings}
    effects = {i: [t.effect for t in report.timelines[i].transitions] for i in (x, y, z)}
    assert effects == {
        x: ["insert", "claim", "update", "claim", "published", "dead"],
        y: ["insert", "claim", "update", "claim", "published", "update"],
        z: ["insert", "claim", "claim", "published"],
    }
    serials = {i: [t.serial for t in report.timelines[i].transitions] for i in (x, y, z)}
    assert {i: flagged[i].serial for i in (x, y, z)} == {
        x: serials[x][5],
        y: serials[y][5],
        z: serials[z][2],
    }
    a8, b8 = str(a)[:8], str(b)[:8]
    assert flagged[x].detail == (
        f"#{serials[x][5]} dead: changed dead_at with no lease in force: the lease of claim "
        f"#{serials[x][3]} ({b8}) was already ended by #{serials[x][4]} (published)"
    )
    assert flagged[y].detail == (
        f"#{serials[y][5]} update: changed attempts, available_at with no lease in "
        f"force: the lease of claim #{serials[y][3]} ({b8}) was already ended by "
        f"#{serials[y][4]} (published)"
    )
    assert flagged[z].detail.startswith(
        f"#{serials[z][2]} claim: token {b8} took the row although the lease of {a8} ran until "
    )
    assert flagged[z].detail.endswith("; attempts went 1 -> 1 (a claim adds one)")
    text = report.timeline_text(x)
    assert f"lease_owner - -> {a8}, attempts 0 -> 1, available_at " in text
    assert f"lease_owner {a8} -> {b8}, attempts 1 -> 2" in text
    assert f"      ^ stale token: {flagged[x].detail}" in text
    assert report.format().count("^ stale token: ") == 3


async def test_check_needs_the_history(conn: asyncpg.Connection) -> None:
    """Without install_history there is nothing to check fencing against: say so."""
    with pytest.raises(RuntimeError, match=r"run install_history\(\) before the scenario"):
        await check(conn, {"jobs": {}})
