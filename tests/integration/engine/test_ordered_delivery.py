"""Ordered delivery end to end, in process, on the OJS emulator: every key's rows reach the
sink in commit order through transient failures and lost answers; a head refused for good
parks its key while the other keys flow; `on_exhausted = "skip"` dead-letters it instead;
a row of an ordered route without a key is dead-lettered."""

from __future__ import annotations

import json
import random
from typing import Any

import asyncpg
import pytest

from relayd.producer import new_job
from relayd.testing.emulator import EmulatorConfig, RunningEmulator, start_emulator
from relayd.testing.emulator.faults import FaultRule
from tests.faults.order_checker import check_order
from tests.support import (
    Database,
    drained,
    eventually,
    produce,
    relay_settings,
    run_until_idle,
    running,
)


async def insert_interleaved(
    conn: asyncpg.Connection, keys: list[str], per_key: int, *, seed: int = 7
) -> dict[str, tuple[str, int]]:
    """Commit `per_key` rows of each key, one transaction per row, the keys interleaved at
    random (seeded); each row's (key, ordering_seq) by event id."""
    order = [key for key in keys for _ in range(per_key)]
    random.Random(seed).shuffle(order)
    rows: dict[str, tuple[str, int]] = {}
    for key in order:
        job = new_job("test.echo", [{"key": key}])
        seq = await conn.fetchval(
            "INSERT INTO relayd.outbox (event_id, job, ordering_key) VALUES ($1, $2, $3) "
            "RETURNING ordering_seq",
            job["id"],
            json.dumps(job),
            key,
        )
        rows[str(job["id"])] = (key, seq)
    return rows


def head_of(rows: dict[str, tuple[str, int]], key: str, seq: int = 1) -> str:
    return next(i for i, (k, s) in rows.items() if (k, s) == (key, seq))


async def test_every_key_arrives_in_commit_order_through_failures(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    keys = [f"order-{i}" for i in range(20)]
    rows = await insert_interleaved(conn, keys, 10)
    chosen = random.Random(3).sample(sorted(rows), 30)
    for event_id in chosen[:15]:  # transient: refused twice, then stored
        emulator.emulator.add_fault(
            FaultRule(action="status", status=503, method="POST", job_id=event_id, times=2)
        )
    for event_id in chosen[15:]:  # stored, its answer lost: re-sent (overwritten)
        emulator.emulator.add_fault(
            FaultRule(action="store_then_drop", method="POST", job_id=event_id, times=1)
        )
    await run_until_idle(relay_settings(database.dsn, emulator.url, sink={"ordering": "key"}))
    assert await drained(conn)
    report = check_order(emulator.emulator.arrivals(), rows)
    assert report.clean, (report.violations, report.lost)
    assert report.delivered == 200


async def test_a_head_refused_for_good_parks_its_key_while_the_others_flow(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    rows = await insert_interleaved(conn, ["a", "b", "c"], 5)
    stuck = head_of(rows, "a", 2)
    emulator.emulator.add_fault(
        FaultRule(action="status", status=400, method="POST", job_id=stuck, times=None)
    )
    settings = relay_settings(database.dsn, emulator.url, sink={"ordering": "key"})
    async with running(settings):

        async def parked() -> bool:
            return bool(await conn.fetchval("SELECT count(*) FROM relayd.relayd_parked_keys"))

        await eventually(parked)

        async def others_done() -> bool:
            return not await conn.fetchval(
                "SELECT count(*) FROM relayd.outbox WHERE ordering_key <> 'a' "
                "AND published_at IS NULL"
            )

        await eventually(others_done)
        park: Any = await conn.fetchrow(
            "SELECT ordering_key, event_id::text, type, reason FROM relayd.relayd_parked_keys"
        )
        assert dict(park) == {
            "ordering_key": "a",
            "event_id": stuck,
            "type": "test.echo",
            "reason": "sink_rejected",
        }
        waiting = await conn.fetch(
            "SELECT ordering_seq, attempts, available_at = 'infinity' AS waiting, "
            "dead_at IS NULL AS alive FROM relayd.outbox WHERE ordering_key = 'a' "
            "AND published_at IS NULL ORDER BY ordering_seq"
        )
        assert [tuple(r) for r in waiting] == [
            (2, 1, True, True),  # the parked head: pending, tried once
            (3, 0, True, True),
            (4, 0, True, True),
            (5, 0, True, True),
        ]
        # Released by hand (as `relayd keys release` does), the fault gone: the key goes on.
        emulator.emulator.clear_faults()
        await conn.execute("DELETE FROM relayd.relayd_parked_keys")
        await conn.execute('NOTIFY "relayd.outbox"')
        await eventually(lambda: drained(conn))
    report = check_order(emulator.emulator.arrivals(), rows)
    assert report.clean, (report.violations, report.lost)


async def test_a_route_that_skips_dead_letters_the_head_and_the_key_goes_on(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    rows = await insert_interleaved(conn, ["a", "b"], 3)
    stuck = head_of(rows, "a", 1)
    emulator.emulator.add_fault(
        FaultRule(action="status", status=400, method="POST", job_id=stuck, times=None)
    )
    settings = relay_settings(
        database.dsn, emulator.url, sink={"ordering": "key", "on_exhausted": "skip"}
    )
    await run_until_idle(settings)
    assert await drained(conn)
    assert (
        await conn.fetchval("SELECT dead_reason FROM relayd.outbox WHERE event_id = $1", stuck)
        == "sink_rejected"
    )
    assert not await conn.fetchval("SELECT count(*) FROM relayd.relayd_parked_keys")
    report = check_order(emulator.emulator.arrivals(), rows, dead={stuck})
    assert report.clean, (report.violations, report.lost)


async def test_a_row_of_an_ordered_route_without_a_key_is_dead_lettered(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    job = new_job("test.echo", [{}])
    await conn.execute(
        "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2)", job["id"], json.dumps(job)
    )
    await run_until_idle(relay_settings(database.dsn, emulator.url, sink={"ordering": "key"}))
    dead: Any = await conn.fetchrow(
        "SELECT dead_reason, last_error FROM relayd.outbox WHERE event_id = $1", job["id"]
    )
    assert dead["dead_reason"] == "invalid_envelope"
    assert "no ordering key" in dead["last_error"]
    assert emulator.emulator.arrivals() == []


@pytest.mark.parametrize(
    ("duplicate_mode", "seen"),
    [
        # A destination that refuses a reused id (the OJS specification's 409; NATS within
        # its duplicate window; a receiver that deduplicates by webhook-id) never applies
        # the late copy: the key stays in order.
        ("reject", ["head", "next"]),
        # One that stores a reused id again (an OJS server that overwrites) applies the
        # late copy after the next row: the residual window.
        ("overwrite", ["head", "next", "head"]),
    ],
)
async def test_the_residual_window_a_request_applied_after_relayd_gave_up_on_it(
    database: Database, conn: asyncpg.Connection, duplicate_mode: str, seen: list[str]
) -> None:
    """docs/contract.md#c10: the destination holds the head's first request longer than
    relayd waits (3 s against a 0.5 s attempt deadline and a 2 s lease: a sink slower than
    the lease); relayd gives up, reconciles (the GET finds nothing yet), sends the head
    again, publishes it and sends the next row; then the destination applies the request it
    held, or refuses it as a duplicate."""
    rows = await insert_interleaved(conn, ["a"], 2)
    names = {head_of(rows, "a", 1): "head", head_of(rows, "a", 2): "next"}
    config = EmulatorConfig(duplicate_mode="overwrite") if duplicate_mode == "overwrite" else None
    async with await start_emulator(config or EmulatorConfig()) as emulator:
        emulator.emulator.add_fault(
            FaultRule(
                action="latency", delay_ms=3000, method="POST", job_id=head_of(rows, "a"), times=1
            )
        )
        settings = relay_settings(
            database.dsn,
            emulator.url,
            sink={"ordering": "key", "timeout_s": 0.5, "batch": "off"},
            relay={"lease_s": 2.0},
        )
        async with running(settings):
            await eventually(lambda: drained(conn))
            # The held request is answered 3 s after it arrived, stored or refused.
            await emulator.emulator.wait_until(
                lambda e: (
                    e.ledger()[head_of(rows, "a")].posts == 2
                    and len(e.ledger()[head_of(rows, "a")].post_statuses) == 2
                )
            )
        arrivals = emulator.emulator.arrivals()
    assert [names[i] for i in arrivals] == seen
    report = check_order(arrivals, rows)
    assert len(report.violations) == (duplicate_mode == "overwrite")
    assert not report.lost


async def test_rows_of_keys_after_a_quiet_spell_are_claimed_at_once(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """With no row of a key pending, workers claim with the unordered statement, which never
    takes a key's head. When keyed rows arrive, the notification's claim sees them and the
    worker claims their heads at once, in order, not at the next poll (an hour here)."""
    settings = relay_settings(
        database.dsn, emulator.url, sink={"ordering": "key"}, relay={"poll_interval_s": 3600}
    )
    async with running(settings):
        # A row without a key: dead-lettered on this route, and the last claim saw no key.
        [unkeyed] = await produce(conn, 1)
        await eventually(lambda: _settled(conn, [unkeyed], "dead_at"), timeout_s=10)
        async with conn.transaction():  # one notification
            rows = await insert_interleaved(conn, ["a", "b"], 3)
        await eventually(lambda: _settled(conn, list(rows), "published_at"), timeout_s=10)
    report = check_order(emulator.emulator.arrivals(), rows)
    assert report.clean, (report.violations, report.lost)


async def _settled(conn: asyncpg.Connection, ids: list[str], column: str) -> bool:
    settled: int = await conn.fetchval(
        f"SELECT count(*) FROM relayd.outbox WHERE event_id = ANY($1::uuid[]) "
        f"AND {column} IS NOT NULL",
        ids,
    )
    return settled == len(ids)
