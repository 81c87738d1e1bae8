"""A claim whose answer arrives after its lease expired must not publish (C4): the start-by
time counts from before the claim was sent, not from when its answer arrived."""

from __future__ import annotations

from typing import Any

import asyncpg

from relayd.testing.emulator import EmulatorConfig, start_emulator
from tests.faults.checker import assert_clean, check, install_history
from tests.support import Database, TcpProxy, drained, eventually, produce, relay_settings, running

LEASE_S = 2.0
# Longer than the lease: the claim's answer arrives after it expired. (Every statement of
# relay A costs two delayed round trips: its own, and the pool's reset on release.)
REPLY_DELAY_S = 2.5


async def test_a_claim_answered_after_its_lease_publishes_nothing(
    database: Database, conn: asyncpg.Connection, proxy: TcpProxy
) -> None:
    """1. relay A's replies from PostgreSQL are delayed 2.5 s, past its 2 s lease; 2. A claims
    50 rows (committed at once, answered late); 3. relay B takes them over when the lease
    expires and publishes them; 4. A's answer arrives: it must not POST them again. On a
    sink that overwrites a reused id, no job is created twice."""
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
            # 1.
            proxy.reply_delay_s = REPLY_DELAY_S
            # 2.
            ids = await produce(conn, 50)

            async def leased_to_a() -> bool:
                leased: int = await conn.fetchval(
                    "SELECT count(*) FROM relayd.outbox WHERE lease_owner IS NOT NULL"
                )
                return leased == len(ids)

            await eventually(leased_to_a)
            # 3.
            prompt = relay_settings(database.dsn, sink.url, **timing)
            async with running(prompt, seed=2):
                await eventually(lambda: drained(conn))

                # 4. A's claim is answered; whatever it does next is fenced and counted stale.
                async def a_gave_the_rows_up() -> bool:
                    stale = relay_a.metrics.registry.get_sample_value(
                        "relayd_outcomes_total", {"outcome": "stale"}
                    )
                    return (stale or 0) >= len(ids)

                await eventually(a_gave_the_rows_up, timeout_s=60)
            proxy.reply_delay_s = 0.0
        ledger = sink.emulator.ledger()
        assert_clean(await check(conn, sink.emulator.ledger_json()))
    assert set(ledger) == set(ids)
    assert {(entry.created, entry.overwrites) for entry in ledger.values()} == {(1, 0)}
    published_by_a = relay_a.metrics.registry.get_sample_value(
        "relayd_outcomes_total", {"outcome": "published"}
    )
    assert published_by_a == 0
