"""A claim whose answer arrives after its lease expired must not publish (C4): the start-by
time counts from before the claim was sent, not from when its answer arrived."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from relayd.producer import enqueue_many, new_job
from relayd.testing.emulator import EmulatorConfig, start_emulator
from tests.faults.checker import assert_clean, check, install_history
from tests.support import Database, TcpProxy, drained, eventually, relay_settings, running

LEASE_S = 2.0


async def test_a_claim_answered_after_its_lease_publishes_nothing(
    database: Database, conn: asyncpg.Connection, proxy: TcpProxy
) -> None:
    """1. The answer from PostgreSQL that holds 50 rows' ids is held back from relay A;
    2. A claims them (committed at once, its answer held); 3. relay B takes them over when
    A's 2 s lease expires and publishes them; 4. A's answer is let through, after its lease:
    A must not POST them again. On a sink that overwrites a reused id, no job is created
    twice. (No clock is raced: B can claim only after the lease, so A's answer, let through
    once B has published, always arrives late.)"""
    timing: dict[str, dict[str, Any]] = {
        "relay": {"lease_s": LEASE_S, "batch_size": 100, "poll_interval_s": 0.1},
        "sink": {"timeout_s": 0.5, "batch": "off"},
    }
    await install_history(conn)
    async with await start_emulator(EmulatorConfig(duplicate_mode="overwrite")) as sink:
        late = relay_settings(
            proxy.dsn_through(database.dsn),
            sink.url,
            relay=timing["relay"] | {"workers": 1, "listen": False},
            sink=timing["sink"],
        )
        async with running(late, seed=1) as relay_a:
            # 1. (An id travels as its 16 bytes in asyncpg's binary format, or as text.)
            jobs = [new_job("test.echo", [{"n": i}]) for i in range(50)]
            ids = [str(job["id"]) for job in jobs]
            proxy.hold_replies_with(
                marker for i in ids for marker in (uuid.UUID(i).bytes, i.encode())
            )
            # 2.
            async with conn.transaction():
                await enqueue_many(conn, jobs)

            async def leased_to_a() -> list[str]:
                # A's one worker waits for the held answer: what it leased stays leased.
                rows = await conn.fetch(
                    "SELECT event_id::text FROM relayd.outbox "
                    "WHERE event_id = ANY($1::uuid[]) AND lease_owner IS NOT NULL",
                    ids,
                )
                return [row["event_id"] for row in rows]

            async def a_claimed() -> bool:
                return bool(await leased_to_a())

            await eventually(a_claimed)
            held_by_a = await leased_to_a()
            # 3.
            prompt = relay_settings(database.dsn, sink.url, **timing)
            async with running(prompt, seed=2):
                await eventually(lambda: drained(conn))
                # 4. A's claim is answered; whatever it does next is fenced and counted stale.
                proxy.release()

                async def a_gave_the_rows_up() -> bool:
                    stale = relay_a.metrics.registry.get_sample_value(
                        "relayd_outcomes_total", {"outcome": "stale"}
                    )
                    return (stale or 0) >= len(held_by_a)

                await eventually(a_gave_the_rows_up)
        ledger = sink.emulator.ledger()
        assert_clean(await check(conn, sink.emulator.ledger_json()))
    assert set(ledger) == set(ids)
    assert {(entry.created, entry.overwrites) for entry in ledger.values()} == {(1, 0)}
    published_by_a = relay_a.metrics.registry.get_sample_value(
        "relayd_outcomes_total", {"outcome": "published"}
    )
    assert published_by_a == 0
