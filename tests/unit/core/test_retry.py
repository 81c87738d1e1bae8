"""Backoff, Retry-After and the circuit breaker (relayd/core/retry.py), with a seeded RNG and a
fake clock."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import pytest
import structlog

from relayd.core.retry import Backoff, BreakerState, CircuitBreaker, Permit, parse_retry_after
from relayd.engine.breaker import BreakerGate
from relayd.telemetry.metrics import RelayMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_is_full_jitter_under_an_exponential_ceiling() -> None:
    """Attempt n waits uniformly in [0, min(cap, base * 2^(n-1))]."""
    backoff = Backoff(base_s=0.5, cap_s=8.0, rng=random.Random(7))
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (30, 8.0)]:
        delays = [backoff.delay_s(attempt) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.9  # the whole range is used


def test_backoff_is_reproducible_with_a_seed() -> None:
    """The same seed gives the same delays (tests and benchmarks rely on it)."""
    first = Backoff(1.0, 60.0, random.Random(42))
    second = Backoff(1.0, 60.0, random.Random(42))
    assert [first.delay_s(n) for n in range(1, 10)] == [second.delay_s(n) for n in range(1, 10)]


def test_retry_after_replaces_backoff_and_is_capped() -> None:
    """A server's Retry-After wins over the computed backoff, capped at cap_s (C5)."""
    backoff = Backoff(1.0, 30.0, random.Random(1))
    assert backoff.delay_s(1, retry_after_s=12.0) == 12.0
    assert backoff.delay_s(1, retry_after_s=3600.0) == 30.0
    assert backoff.delay_s(1, retry_after_s=-5.0) == 0.0


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("120", 120.0),
        (" 7 ", 7.0),
        ("Wed, 21 Oct 2026 07:28:30 GMT", 30.0),
        ("Wed, 21 Oct 2026 07:27:00 GMT", 0.0),  # in the past
        ("soon", None),
        ("-3", None),
        # Digits that are not ASCII: str.isdigit() accepts them, float() refuses them.
        ("\u00b2", None),
        ("\u0663", None),
        ("1\u00b2", None),
        ("12.5", None),
        ("", None),
        ("9" * 5000, float("inf")),  # more digits than int() reads: still no exception
        ("Fri, 31 Dec 9999 23:59:59 GMT", 251_609_733_119.0),  # capped later, by Backoff
        ("Mon, 00 Xyz 0000 99:99:99 GMT", None),
        ("\x00\xff", None),
    ],
)
def test_parse_retry_after(header: str | None, expected: float | None) -> None:
    """Retry-After is ASCII delta-seconds or an HTTP date; anything else is ignored and
    no value raises."""
    now = datetime(2026, 10, 21, 7, 28, 0, tzinfo=UTC)
    assert parse_retry_after(header, now) == expected


def _state(breaker: CircuitBreaker) -> BreakerState:
    """The breaker's state read afresh: mypy keeps narrowing `breaker.state` from one assert
    to the next, across the calls that change it."""
    return breaker.state


def _breaker(clock: FakeClock, threshold: int = 3) -> CircuitBreaker:
    return CircuitBreaker(
        threshold=threshold, cooldown_s=10.0, cap_s=60.0, rng=random.Random(3), clock=clock
    )


def test_breaker_opens_after_consecutive_failures_only() -> None:
    """A stored row between failures resets the count; `threshold` in a row opens it."""
    clock = FakeClock()
    breaker = _breaker(clock)
    assert not breaker.record_failure()
    assert not breaker.record_failure()
    breaker.record_accepted()
    assert not breaker.record_failure()
    assert not breaker.record_failure()
    assert breaker.record_failure()
    assert breaker.state is BreakerState.OPEN


def test_breaker_opens_at_once_on_a_severe_failure() -> None:
    """401/403 or a wrong URL fail every request: no need to wait for a streak."""
    breaker = _breaker(FakeClock())
    assert breaker.record_failure(severe=True)
    assert breaker.state is BreakerState.OPEN


def test_breaker_probes_once_after_a_jittered_cooldown() -> None:
    """Open: wait; after the cooldown one probe permit; others wait for its verdict."""
    clock = FakeClock()
    breaker = _breaker(clock, threshold=1)
    breaker.record_failure()
    wait = breaker.permit()
    assert isinstance(wait, float)
    assert 5.0 <= wait <= 10.0  # half to all of the first cooldown
    clock.now += wait
    assert breaker.permit() is Permit.PROBE
    assert _state(breaker) is BreakerState.HALF_OPEN
    assert breaker.permit() is None  # the probe is out: wait for it
    assert breaker.record_accepted()
    assert _state(breaker) is BreakerState.CLOSED
    assert breaker.permit() is Permit.CLAIM


def test_failed_probe_reopens_with_a_longer_cooldown() -> None:
    """Each reopening doubles the cooldown ceiling, up to the cap."""
    clock = FakeClock()
    breaker = _breaker(clock, threshold=1)
    breaker.record_failure()
    waits = []
    for _ in range(5):
        wait = breaker.permit()
        assert isinstance(wait, float)
        waits.append(wait)
        clock.now += wait
        assert breaker.permit() is Permit.PROBE
        assert breaker.record_failure()
    ceilings = [10.0, 20.0, 40.0, 60.0, 60.0]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True))


def _opened(breaker: CircuitBreaker, clock: FakeClock) -> None:
    """Open the breaker (a severe failure) and let its cooldown pass."""
    breaker.record_failure(severe=True)
    clock.now += 100


_H, _C, _O = BreakerState.HALF_OPEN, BreakerState.CLOSED, BreakerState.OPEN


@pytest.mark.parametrize(
    ("steps", "state", "permit"),
    [
        # A verdict on the probe row stores nothing: still half-open, the probe still out...
        (["probe", "answered"], _H, None),
        # ... and once it ends, the next row probes.
        (["probe", "answered", "end"], _H, Permit.PROBE),
        # A stored row closes it: full claims.
        (["probe", "accepted"], _C, Permit.CLAIM),
        # No row to probe with, the sink answered its health request: closed, but unproven,
        # so claims stay one row at a time...
        (["probe", "alive"], _C, Permit.PROBE),
        (["probe", "alive", "probe"], _C, None),
        (["probe", "alive", "probe", "end"], _C, Permit.PROBE),
        (["probe", "alive", "probe", "answered", "end"], _C, Permit.PROBE),
        # ... until a row is stored...
        (["probe", "alive", "probe", "accepted"], _C, Permit.CLAIM),
        # ... and one failure opens it again, with no streak needed.
        (["probe", "alive", "fail"], _O, float),
        # A health answer cannot close an open breaker (a probe's failure came first).
        (["probe", "fail", "alive"], _O, float),
    ],
)
def test_what_each_report_does_to_an_opened_breaker(
    steps: list[str], state: BreakerState, permit: Permit | type[float] | None
) -> None:
    """C5, as a table: after an opening and its cooldown, only a stored row closes the
    breaker for full claims; a health answer closes it unproven."""
    clock = FakeClock()
    breaker = _breaker(clock, threshold=3)
    _opened(breaker, clock)
    for step in steps:
        if step == "probe":
            assert breaker.permit() is Permit.PROBE
        elif step == "end":
            breaker.end_probe()
        elif step == "fail":
            breaker.record_failure()
        else:
            getattr(breaker, f"record_{step}")()
    assert _state(breaker) is state
    granted = breaker.permit()
    assert isinstance(granted, float) if permit is float else granted is permit


def test_answered_writes_end_a_streak_of_failures() -> None:
    """A verdict on a row shows the write path answers: the count of consecutive failures
    starts again."""
    breaker = _breaker(FakeClock(), threshold=3)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_answered()
    breaker.record_failure()
    assert not breaker.record_failure()
    assert breaker.record_failure()


def test_the_cooldown_grows_until_a_row_is_stored() -> None:
    """Reopenings after closes on a health answer keep doubling the cooldown's ceiling; a
    stored row brings it back to its first length."""
    clock = FakeClock()
    breaker = _breaker(clock, threshold=1)
    breaker.record_failure()
    for ceiling in [10.0, 20.0, 40.0, 60.0, 60.0]:
        assert ceiling / 2 <= breaker.cooldown_s <= ceiling
        clock.now += breaker.cooldown_s
        assert breaker.permit() is Permit.PROBE
        assert breaker.record_alive()
        assert breaker.permit() is Permit.PROBE
        assert breaker.record_failure()
    assert breaker.openings == 6
    clock.now += breaker.cooldown_s
    assert breaker.permit() is Permit.PROBE
    assert breaker.record_accepted()
    assert breaker.openings == 0
    assert breaker.record_failure()
    assert 5.0 <= breaker.cooldown_s <= 10.0


def test_probe_that_told_nothing_can_be_retried() -> None:
    """A probe that found no row ends without a verdict; the next asker gets the probe."""
    clock = FakeClock()
    breaker = _breaker(clock, threshold=1)
    breaker.record_failure()
    clock.now += 100
    assert breaker.permit() is Permit.PROBE
    breaker.end_probe()
    assert breaker.permit() is Permit.PROBE


async def test_breaker_logs_opening_as_a_warning_and_recovery_as_info() -> None:
    """`breaker.opened` is a warning; `breaker.probing` and `breaker.closed` are recovery
    (info), so `journalctl -p warning` shows only what needs attention."""
    clock = FakeClock()
    breaker = CircuitBreaker(
        threshold=1, cooldown_s=10.0, cap_s=60.0, rng=random.Random(3), clock=clock
    )
    gate = BreakerGate(breaker, RelayMetrics(), asyncio.Event(), kind="ojs")
    with structlog.testing.capture_logs() as logs:
        gate.sink_failed(severe=False, reason="HTTP 503")
        clock.now += 60
        assert await gate.acquire() is Permit.PROBE
        gate.sink_accepted()
    assert [(entry["event"], entry["log_level"]) for entry in logs] == [
        ("breaker.opened", "warning"),
        ("breaker.probing", "info"),
        ("breaker.closed", "info"),
    ]


async def test_breaker_logs_state_changes_not_probes() -> None:
    """Probes that tell nothing (no row, a row that proved nothing) follow one another
    without a log line each: `breaker.probing` once per cooldown, and nothing for a stored
    row while the breaker is closed."""
    clock = FakeClock()
    breaker = CircuitBreaker(
        threshold=1, cooldown_s=10.0, cap_s=60.0, rng=random.Random(3), clock=clock
    )
    gate = BreakerGate(breaker, RelayMetrics(), asyncio.Event(), kind="ojs")
    with structlog.testing.capture_logs() as logs:
        gate.sink_failed(severe=False, reason="HTTP 503")
        clock.now += 60
        for _ in range(5):
            assert await gate.acquire() is Permit.PROBE
            gate.sink_answered()
            gate.end_probe()
        gate.sink_accepted()
        gate.sink_accepted()
    assert [entry["event"] for entry in logs] == [
        "breaker.opened",
        "breaker.probing",
        "breaker.closed",
    ]
    assert logs[0]["openings"] == 1
    assert logs[-1]["proof"] == "publish"


@pytest.mark.parametrize(
    ("steps", "cut_short", "state", "permit"),
    [
        # Open, its cooldown running: the reconnect ends it, the next asker probes.
        (["open"], True, _O, Permit.PROBE),
        # The probe a reconnect allowed failed: open again; the next reconnect ends that
        # cooldown too.
        (["open", "reconnected", "probe", "fail"], True, _O, Permit.PROBE),
        # Half-open with its probe out: nothing to cut short, no second probe.
        (["open", "wait", "probe"], False, _H, None),
        # Open, but the cooldown is over already: the next asker probes anyway.
        (["open", "wait"], False, _O, Permit.PROBE),
        # Closed: a reconnect changes nothing.
        ([], False, _C, Permit.CLAIM),
        # Closed on a health answer, unproven: still one row at a time.
        (["open", "wait", "probe", "alive"], False, _C, Permit.PROBE),
    ],
)
def test_a_reconnect_ends_an_open_breakers_cooldown(
    steps: list[str], cut_short: bool, state: BreakerState, permit: Permit | type[float] | None
) -> None:
    """The sink's client made its connection again: an open breaker probes at once instead
    of waiting out its cooldown (up to cap_s); nothing else changes, and the reconnect
    proves nothing (only a stored row closes the breaker for full claims)."""
    clock = FakeClock()
    breaker = _breaker(clock, threshold=1)
    for step in steps:
        if step == "open":
            assert breaker.record_failure()
        elif step == "wait":
            clock.now += 100
        elif step == "probe":
            assert breaker.permit() is Permit.PROBE
        elif step == "fail":
            breaker.record_failure()
        else:
            getattr(breaker, f"record_{step}")()
    openings = breaker.openings
    assert breaker.record_reconnected() is cut_short
    assert _state(breaker) is state
    assert breaker.openings == openings
    granted = breaker.permit()
    assert isinstance(granted, float) if permit is float else granted is permit


def test_a_failed_probe_after_a_reconnect_waits_the_next_longer_cooldown() -> None:
    """Openings are kept across a reconnect: the probe it allowed fails, and the breaker
    waits the next step of its cooldown (its ceiling doubled), not the first again."""
    clock = FakeClock()
    breaker = _breaker(clock, threshold=1)
    breaker.record_failure()
    assert breaker.record_reconnected()
    assert breaker.permit() is Permit.PROBE
    assert breaker.record_failure()
    assert breaker.openings == 2
    assert 10.0 <= breaker.cooldown_s <= 20.0


def _reconnects(metrics: RelayMetrics) -> float | None:
    return metrics.registry.get_sample_value("relayd_sink_reconnects_total", {"sink": "nats"})


async def test_a_reconnect_wakes_a_worker_waiting_out_the_cooldown() -> None:
    """A worker waiting for the breaker's cooldown gets the probe as soon as the sink says
    its client reconnected; the reconnect is counted, and logged as what ended the wait."""
    clock = FakeClock()
    breaker = CircuitBreaker(
        threshold=1, cooldown_s=10.0, cap_s=60.0, rng=random.Random(3), clock=clock
    )
    metrics = RelayMetrics()
    gate = BreakerGate(breaker, metrics, asyncio.Event(), kind="nats")
    assert _reconnects(metrics) == 0.0  # the series exists before the first reconnect
    with structlog.testing.capture_logs() as logs:
        gate.sink_failed(severe=False, reason="not connected to NATS at 127.0.0.1:4222")
        waiting = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)  # it waits: the cooldown has not passed on the fake clock
        assert not waiting.done()
        gate.sink_reconnected()
        async with asyncio.timeout(5):
            assert await waiting is Permit.PROBE
        gate.sink_reconnected()  # half-open already: counted, nothing to cut short
    assert _reconnects(metrics) == 2.0
    assert [entry["event"] for entry in logs] == [
        "breaker.opened",
        "breaker.cooldown_ended",
        "breaker.probing",
    ]


@pytest.mark.parametrize(
    ("steps", "reason"),
    [
        # The failure that opened it, as the sink said it.
        (["fail:A"], "A"),
        # Failures while it is open change nothing: the outage is the one that opened it.
        (["fail:A", "fail:B"], "A"),
        # A probe that fails reopens it: its failure is the reason now.
        (["fail:A", "wait", "probe", "fail:B"], "B"),
        # Half-open: still the reason it opened for.
        (["fail:A", "wait", "probe"], "A"),
        # Closed by a stored row, or on a health answer: no reason.
        (["fail:A", "wait", "probe", "accepted"], None),
        (["fail:A", "wait", "probe", "alive"], None),
        # Never opened.
        ([], None),
    ],
)
async def test_the_breaker_keeps_the_reason_it_opened_for(
    steps: list[str], reason: str | None
) -> None:
    """`BreakerGate.reason`: the sink's failure that opened the breaker last, while it is
    not closed; what `/readyz` and the heartbeat show."""
    clock = FakeClock()
    breaker = CircuitBreaker(
        threshold=1, cooldown_s=10.0, cap_s=60.0, rng=random.Random(3), clock=clock
    )
    gate = BreakerGate(breaker, RelayMetrics(), asyncio.Event(), kind="ojs")
    for step in steps:
        if step.startswith("fail:"):
            gate.sink_failed(severe=False, reason=step.removeprefix("fail:"))
        elif step == "wait":
            clock.now += 100
        elif step == "probe":
            assert await gate.acquire() is Permit.PROBE
        elif step == "accepted":
            gate.sink_accepted()
        else:
            breaker.record_alive()
    assert gate.reason == reason


async def test_breaker_opened_names_the_sinks_error_cleaned() -> None:
    """`breaker.opened` carries the failure as `error`, control characters made spaces and
    bounded as `last_error` is."""
    breaker = CircuitBreaker(threshold=1, cooldown_s=10.0, cap_s=60.0, rng=random.Random(3))
    gate = BreakerGate(breaker, RelayMetrics(), asyncio.Event(), kind="ojs")
    with structlog.testing.capture_logs() as logs:
        gate.sink_failed(severe=True, reason="HTTP 401\nunauthorized" + "x" * 600)
    [opened] = logs
    assert opened["event"] == "breaker.opened"
    assert opened["severe"] is True
    assert opened["error"].startswith("HTTP 401 unauthorized")
    assert len(opened["error"].encode()) <= 512
    assert gate.reason == opened["error"]
