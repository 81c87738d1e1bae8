"""A running relay as an operator watches it: its real `/metrics`, `/readyz` and `/v1/status`
endpoints through a sink outage, read over loopback."""

from __future__ import annotations

import aiohttp
import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from relayd.core import __version__
from relayd.testing.emulator import start_emulator
from relayd.testing.processes import free_port
from tests.support import Database, drained, eventually, produce, relay_settings, running

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# Every gauge of the backlog sampler, and the series an operator's alerts need.
EXPECTED = [
    ("relayd_outbox_rows", {"state": "ready"}),
    ("relayd_outbox_rows", {"state": "scheduled"}),
    ("relayd_outbox_rows", {"state": "leased"}),
    ("relayd_outbox_rows", {"state": "dead"}),
    ("relayd_outbox_oldest_claimable_age_seconds", {}),
    ("relayd_outbox_oldest_pending_age_seconds", {}),
    ("relayd_backlog_sampled_timestamp_seconds", {}),
    ("relayd_paused", {}),
    ("relayd_oldest_parked_age_seconds", {}),  # relayd_parked_keys{route}: only while parked
    ("relayd_build_info", {"version": __version__}),
    ("relayd_breaker_state", {}),
    # An HTTP sink has no connection to lose: the series is there, and stays 0.
    ("relayd_sink_reconnects_total", {"sink": "ojs"}),
    ("relayd_outcomes_total", {"outcome": "published"}),
    ("relayd_dead_lettered_total", {"reason": "conflict"}),
    ("relayd_claims_total", {}),
    ("relayd_database_errors_total", {}),
    ("process_resident_memory_bytes", {}),
    ("process_open_fds", {}),
    ("process_start_time_seconds", {}),
]


async def _scrape(http: aiohttp.ClientSession, port: int) -> Samples:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _dead(conn: asyncpg.Connection) -> int:
    count: int = await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL")
    return count


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_metrics_through_a_sink_outage(database: Database, conn: asyncpg.Connection) -> None:
    """1. /metrics shows every gauge, no *_created series; 2. sink stopped, new rows: the
    breaker opens (2), /readyz and /v1/status say why (the sink's host and port, refused),
    the oldest claimable age grows, nothing is dead-lettered; 3. the sink returns: every
    row is published, each created once, and the reason is gone."""
    sink = await start_emulator()
    sink_port = int(sink.url.rsplit(":", 1)[1])
    port = free_port()
    settings = relay_settings(
        database.dsn,
        sink.url,
        http={"enabled": True, "listen": f"127.0.0.1:{port}"},
        metrics={"sample_interval_s": 0.1},
        # Probes a second or two apart: the oldest claimable row waits between them.
        retry={"breaker_cooldown_s": 1.0, "cap_s": 2.0},
    )
    before = await produce(conn, 20)
    # The sink is stopped mid-test, and closed whatever happens.
    async with sink, running(settings), aiohttp.ClientSession() as http:
        await eventually(lambda: drained(conn))

        # 1. The sampled gauges appear with the sampler's first figures.
        async def every_series() -> bool:
            samples = await _scrape(http, port)
            return all((name, frozenset(labels.items())) in samples for name, labels in EXPECTED)

        await eventually(every_series)
        samples = await _scrape(http, port)
        assert not [name for name, _ in samples if name.endswith("_created")]
        assert _value(samples, "relayd_build_info", version=__version__) == 1
        posted = [
            value
            for (name, labels), value in samples.items()
            if name == "relayd_sink_requests_total" and ("operation", "POST") in labels
        ]
        assert sum(posted) >= 1
        # 2.
        await sink.stop()
        during = await produce(conn, 30)

        async def breaker_open() -> bool:
            return _value(await _scrape(http, port), "relayd_breaker_state") == 2

        await eventually(breaker_open)
        refused = f"cannot connect to 127.0.0.1:{sink_port}: connection refused"

        async def says_why() -> bool:
            # The failure that opened the breaker last: a probe's, on a new connection.
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                ready = await response.json()
            async with http.get(f"http://127.0.0.1:{port}/v1/status") as response:
                status = await response.json()
            [instance] = status["instances"]
            return (ready["reason"], instance["breaker_reason"]) == (
                f"sink circuit breaker open: {refused}",
                refused,
            )

        await eventually(says_why)
        first_age = _value(await _scrape(http, port), "relayd_outbox_oldest_claimable_age_seconds")

        async def age_grew() -> bool:
            samples = await _scrape(http, port)
            age = _value(samples, "relayd_outbox_oldest_claimable_age_seconds")
            return age >= first_age + 1.5

        await eventually(age_grew)
        samples = await _scrape(http, port)
        assert _value(samples, "relayd_breaker_state") == 2
        assert _value(samples, "relayd_outbox_rows", state="dead") == 0
        assert (
            _value(
                samples,
                "relayd_sink_requests_total",
                sink="ojs",
                operation="POST",
                code="error",
            )
            >= 1
        )
        assert await _dead(conn) == 0
        # 3.
        async with await start_emulator(port=sink_port) as back:
            await eventually(lambda: drained(conn))
            after = back.emulator.ledger()

            async def reason_gone() -> bool:
                async with http.get(f"http://127.0.0.1:{port}/v1/status") as response:
                    [instance] = (await response.json())["instances"]
                return instance["breaker_reason"] is None

            await eventually(reason_gone)
            assert (
                _value(await _scrape(http, port), "relayd_sink_reconnects_total", sink="ojs") == 0
            )
    assert await _dead(conn) == 0
    first = sink.emulator.ledger()
    assert set(first) == set(before)
    assert set(after) == set(during)
    assert {entry.created for entry in [*first.values(), *after.values()]} == {1}
