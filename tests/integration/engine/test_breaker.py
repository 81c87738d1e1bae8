"""The circuit breaker against the emulator and real PostgreSQL (docs/contract.md C5): only a
row the sink stored closes it, and a relay with nothing to send still learns that the sink is
back."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import MutableMapping
from datetime import UTC, datetime
from typing import Any

import asyncpg
import structlog

from relayd.core.envelope import Envelope
from relayd.core.outcomes import SinkDown
from relayd.core.retry import BreakerState, CircuitBreaker, Permit
from relayd.engine.breaker import BreakerGate
from relayd.sinks import SendWindow
from relayd.sinks.ojs.settings import OjsSettings
from relayd.sinks.ojs.sink import OjsSink
from relayd.telemetry.metrics import RelayMetrics
from relayd.testing.emulator import RunningEmulator
from relayd.testing.emulator.faults import FaultRule
from tests.support import Database, claimed, eventually, produce, relay_settings, running

# Every POST (one job or a batch) fails; GETs are served: a read-only backend.
WRITES_FAIL = FaultRule(
    action="status", method="POST", path_prefix="/ojs/v1/jobs", status=503, times=None
)
# Every request fails, the manifest included: the sink is down.
ALL_FAIL = FaultRule(action="status", status=503, times=None)


def _gauge(metrics: RelayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {})
    return 0.0 if value is None else value


def _breaker_events(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"].startswith("breaker.")]


async def test_a_read_does_not_close_a_half_open_breaker(emulator: RunningEmulator) -> None:
    """C5: a probe row's reconciliation GET is answered (404) but its POST fails: the breaker
    opens again, because a read proves that the sink reads, not that it writes."""
    emulator.emulator.add_fault(WRITES_FAIL)
    now = [1000.0]
    breaker = CircuitBreaker(
        threshold=5, cooldown_s=10.0, cap_s=60.0, rng=random.Random(1), clock=lambda: now[0]
    )
    gate = BreakerGate(breaker, RelayMetrics(), asyncio.Event(), kind="ojs")
    exchanges: list[tuple[str, str]] = []
    settings = OjsSettings(url=emulator.url, batch="off")
    sink = OjsSink(settings, gate, observe=lambda method, code: exchanges.append((method, code)))
    await sink.start()
    try:
        for _ in range(5):
            gate.sink_failed(severe=False, reason="HTTP 503")
        assert gate.state is BreakerState.OPEN
        now[0] += 60
        assert await gate.acquire() is Permit.PROBE
        # Claimed before: its previous attempt may have landed, so it is reconciled first.
        row = dataclasses.replace(claimed(), attempts=2, previous_attempt_at=datetime.now(UTC))
        envelopes = {row.event_id: Envelope.parse(row.job, row.event_id)}
        window = SendWindow(asyncio.get_running_loop().time() + 60)
        outcomes = await sink.publish([row], envelopes, window=window)
    finally:
        await sink.close()
    assert exchanges == [("GET", "404"), ("POST", "503")]
    assert isinstance(outcomes[row.event_id], SinkDown)
    assert gate.state is BreakerState.OPEN


async def test_reads_do_not_break_a_streak_of_failed_writes(emulator: RunningEmulator) -> None:
    """C5: rows retried one by one (GET 404, then POST 503) open the breaker after
    `breaker_threshold` failed POSTs: the GETs between them do not reset the count."""
    emulator.emulator.add_fault(WRITES_FAIL)
    breaker = CircuitBreaker(threshold=3, cooldown_s=10.0, cap_s=60.0, rng=random.Random(1))
    gate = BreakerGate(breaker, RelayMetrics(), asyncio.Event(), kind="ojs")
    sink = OjsSink(OjsSettings(url=emulator.url, batch="off"), gate)
    await sink.start()
    try:
        for _ in range(3):
            row = dataclasses.replace(claimed(), attempts=2, previous_attempt_at=datetime.now(UTC))
            envelopes = {row.event_id: Envelope.parse(row.job, row.event_id)}
            window = SendWindow(asyncio.get_running_loop().time() + 60)
            await sink.publish([row], envelopes, window=window)
    finally:
        await sink.close()
    assert gate.state is BreakerState.OPEN


async def test_an_idle_probe_asks_the_manifest_once_and_the_next_row_proves_it(
    emulator: RunningEmulator,
) -> None:
    """C5: with no row to send, a probe GETs the manifest: its answer closes the breaker
    (the gauge reads closed), and the probes after it, still one row at a time, ask nothing
    and log nothing. When a row comes, a failed POST opens the breaker again at once, with
    the next, longer cooldown: a sink that answers reads but fails writes never gets a full
    batch."""
    emulator.emulator.add_fault(WRITES_FAIL)
    now = [1000.0]
    breaker = CircuitBreaker(
        threshold=5, cooldown_s=10.0, cap_s=60.0, rng=random.Random(1), clock=lambda: now[0]
    )
    metrics = RelayMetrics()
    gate = BreakerGate(breaker, metrics, asyncio.Event(), kind="ojs")
    exchanges: list[tuple[str, str]] = []
    settings = OjsSettings(url=emulator.url, batch="off")
    sink = OjsSink(settings, gate, observe=lambda method, code: exchanges.append((method, code)))
    await sink.start()
    try:
        with structlog.testing.capture_logs() as logs:
            gate.sink_failed(severe=True, reason="HTTP 401")
            now[0] += 60
            for _ in range(3):  # three idle cycles: no row to send
                assert await gate.acquire() is Permit.PROBE
                await gate.ask_sink(sink, 5.0)
                gate.end_probe()
                assert _gauge(metrics, "relayd_breaker_state") == BreakerState.CLOSED
            assert exchanges == [("GET", "200")]
            assert await gate.acquire() is Permit.PROBE  # a row comes: it goes alone
            row = claimed()
            envelopes = {row.event_id: Envelope.parse(row.job, row.event_id)}
            window = SendWindow(asyncio.get_running_loop().time() + 60)
            await sink.publish([row], envelopes, window=window)
            gate.end_probe()
    finally:
        await sink.close()
    assert exchanges[1:] == [("POST", "503")]
    assert gate.state is BreakerState.OPEN
    assert [(e["event"], e.get("openings"), e.get("proof")) for e in logs] == [
        ("breaker.opened", 1, None),
        ("breaker.probing", None, None),
        ("breaker.closed", None, "health_check"),
        ("breaker.opened", 2, None),
    ]


async def test_a_write_outage_keeps_the_breaker_open_and_its_cooldown_growing(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """C5: the sink serves GETs and fails every POST. After the first opening the breaker
    stays open between probes (each probe sends one row and reopens it), each reopening
    doubles the cooldown's ceiling, and the rows left waiting show in the claimable-age
    gauge. No row is dead-lettered."""
    emulator.emulator.add_fault(WRITES_FAIL)
    await produce(conn, 200)
    cooldown_s, cap_s = 0.05, 0.8
    settings = relay_settings(
        database.dsn,
        emulator.url,
        retry={"base_s": 0.02, "cap_s": cap_s, "breaker_cooldown_s": cooldown_s},
        metrics={"sample_interval_s": 0.1},
    )
    with structlog.testing.capture_logs() as logs:
        async with running(settings) as daemon:

            def count(event: str) -> int:
                return sum(1 for entry in logs if entry["event"] == event)

            async def reopened() -> bool:
                return count("breaker.opened") >= 4

            # By then every claim sent before the first opening has come back.
            await eventually(reopened)
            claimed_before = _gauge(daemon.metrics, "relayd_claimed_rows_total")
            probes_before = count("breaker.probing")

            async def rows_wait() -> bool:
                age = _gauge(daemon.metrics, "relayd_outbox_oldest_claimable_age_seconds")
                # Far above what backoffs alone leave (each at most retry.cap_s): claims of
                # full batches every cooldown would keep it below a second.
                return age > 3.0

            await eventually(rows_wait)
            assert _gauge(daemon.metrics, "relayd_breaker_state") != BreakerState.CLOSED
            claimed = _gauge(daemon.metrics, "relayd_claimed_rows_total") - claimed_before
            probes = count("breaker.probing") - probes_before
    # Each probe claims one row, no more.
    assert 0 < claimed <= probes
    events = _breaker_events(logs)
    first = next(i for i, entry in enumerate(events) if entry["event"] == "breaker.opened")
    after = [entry["event"] for entry in events[first:]]
    # Open, probe (one row, which fails), open again: never closed in between.
    assert len(after) >= 10
    assert after[0::2] == ["breaker.opened"] * len(after[0::2])
    assert after[1::2] == ["breaker.probing"] * len(after[1::2])
    opened = [entry for entry in events if entry["event"] == "breaker.opened"]
    assert [entry["openings"] for entry in opened] == list(range(1, len(opened) + 1))
    for entry in opened:
        ceiling = min(cap_s, cooldown_s * 2 ** (entry["openings"] - 1))
        assert ceiling / 2 - 0.001 <= entry["cooldown_s"] <= ceiling + 0.001
    dead: int = await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL")
    assert dead == 0


async def test_an_idle_relay_closes_its_breaker_at_its_first_probe_once_the_sink_is_back(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """C5: a relay whose breaker opened, and which then has no row to probe with (another
    replica published them), asks the sink's manifest instead: while the sink is down the
    breaker opens again; once it is back, the next probe closes it (within one cooldown),
    the gauge reads closed, and nothing more is logged while the relay stays idle. The
    next row is sent alone and, once accepted, full claims resume."""
    failing = emulator.emulator.add_fault(ALL_FAIL)
    await produce(conn, 20)
    settings = relay_settings(
        database.dsn,
        emulator.url,
        retry={"breaker_cooldown_s": 0.1, "cap_s": 0.4},
        relay={"poll_interval_s": 0.1},
    )
    with structlog.testing.capture_logs() as logs:
        async with running(settings) as daemon:

            def count(event: str) -> int:
                return sum(1 for entry in logs if entry["event"] == event)

            async def opened(times: int) -> bool:
                return count("breaker.opened") >= times

            await eventually(lambda: opened(1))
            # Another replica publishes the rows: nothing is left for this one to probe with.
            await conn.execute("DELETE FROM relayd.outbox")
            before = count("breaker.opened")
            # Down still: an idle probe finds out, and the breaker opens again.
            await eventually(lambda: opened(before + 2))
            assert emulator.emulator.fault_fired(failing) > 0
            idle = [e for e in logs if e["event"] == "breaker.opened"][before:]
            assert any("HTTP 503" in str(e.get("error")) for e in idle), idle
            emulator.emulator.clear_faults()
            back = len(logs)

            async def closed() -> bool:
                return _gauge(daemon.metrics, "relayd_breaker_state") == BreakerState.CLOSED

            await eventually(closed, timeout_s=10)
            since = [entry["event"] for entry in _breaker_events(logs[back:])]
            # A probe under way when the sink came back closes it, or may still have failed;
            # then the next one, at most one cooldown later, closes it.
            assert since in (
                ["breaker.closed"],
                ["breaker.probing", "breaker.closed"],
                ["breaker.opened", "breaker.probing", "breaker.closed"],
            ), since
            [closing] = [e for e in logs[back:] if e["event"] == "breaker.closed"]
            assert closing["proof"] == "health_check"
            claims = _gauge(daemon.metrics, "relayd_claims_total")

            async def idled() -> bool:
                return _gauge(daemon.metrics, "relayd_claims_total") >= claims + 20

            await eventually(idled)
            assert _breaker_events(logs[back:])[-1]["event"] == "breaker.closed"
            # The first row after the outage goes alone; its acceptance confirms the sink.
            ids = await produce(conn, 60)

            async def published() -> bool:
                return set(emulator.emulator.ledger()) >= set(ids)

            await eventually(published)
    assert [entry["event"] for entry in _breaker_events(logs)][-2:] == [
        "breaker.closed",
        "breaker.confirmed",
    ]
