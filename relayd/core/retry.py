"""When to try again: exponential backoff with full jitter, `Retry-After`, and the circuit
breaker that stops claiming while the sink is down (C5).

Pure code: the random source and the clock are injected, so tests are exact.

Backoff for the n-th attempt (n >= 1) is uniform over [0, min(cap_s, base_s * 2**(n-1))]
("full jitter"). A server's Retry-After replaces it, capped at cap_s.

The breaker: CLOSED -> OPEN after `threshold` consecutive sink-wide failures (or one severe
failure: 401/403, a wrong base URL) -> after a jittered cooldown, HALF_OPEN: one probe
permit, to send one row -> CLOSED once the sink stores a row we sent, OPEN again (with a
longer cooldown) on a failure. Only a stored row is proof: a read that found or missed a job
shows that the sink reads, not that it writes, and a verdict on a row stores nothing.

A probe that found no row to send asks the sink's health instead; an answer moves the
breaker to CLOSED, *unproven*: the gauge and `/readyz` read closed, but claims stay one row
at a time (a probe permit), a failure reopens it at once, and the cooldown keeps growing,
until a row is stored. An idle relay so learns the sink is back, and a sink that answers
but does not store never gets full batches.

A sink whose client keeps a connection says when that connection is made again (NATS
reconnected): an open breaker's cooldown then ends at once, and the next permit is the probe.
The reconnect proves nothing (the probe still has to store a row), so the openings are kept:
a probe that fails reopens the breaker with the next, longer cooldown.
"""

from __future__ import annotations

import enum
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

# RFC 9110 delta-seconds: ASCII digits only (str.isdigit() also accepts "²" and "٣").
_DELTA_SECONDS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Backoff:
    base_s: float
    cap_s: float
    rng: random.Random

    def delay_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before attempt `attempt + 1`, honouring a server's Retry-After."""
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.cap_s)
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(max(attempt - 1, 0), 64))
        return self.rng.uniform(0.0, ceiling)


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP date; None if absent or
    not one of those. Never raises: a header is the sink's text, not ours."""
    if value is None:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)  # float(), not int(): any number of digits, inf at worst
    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        now = datetime.now(UTC) if now is None else now
        return max((when - now).total_seconds(), 0.0)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class BreakerState(enum.IntEnum):
    """The value is the `relayd_breaker_state` gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Permit(enum.Enum):
    CLAIM = "claim"  # closed: claim a full batch
    PROBE = "probe"  # half-open, or closed but unproven: claim one row to test the sink


class CircuitBreaker:
    """The sink's health as seen by every worker of this process."""

    def __init__(
        self,
        *,
        threshold: int,
        cooldown_s: float,
        cap_s: float,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._cap_s = max(cap_s, cooldown_s)
        self._rng = rng
        self._clock = clock
        self.state = BreakerState.CLOSED
        # Closed by a stored row (or never opened), not only by a health answer.
        self.proven = True
        self._failures = 0
        # Openings since the sink last stored a row: the cooldown's exponent.
        self.openings = 0
        self.cooldown_s = 0.0  # the last cooldown drawn
        self._retry_at = 0.0
        self._probing = False

    def permit(self) -> Permit | float | None:
        """A permit, or seconds to wait before asking again (None: wait for a change)."""
        if self.state is BreakerState.CLOSED and self.proven:
            return Permit.CLAIM
        if self._probing:
            return None
        if self.state is BreakerState.OPEN:
            remaining = self._retry_at - self._clock()
            if remaining > 0:
                return remaining
            self.state = BreakerState.HALF_OPEN
        self._probing = True
        return Permit.PROBE

    def end_probe(self) -> None:
        """The probe ended without a verdict (no row, or a row that proved nothing): allow
        another."""
        self._probing = False

    def record_alive(self) -> bool:
        """A half-open probe found no row, and the sink answered its health request: closed,
        unproven. Returns True if this closed the breaker."""
        if self.state is not BreakerState.HALF_OPEN:
            return False  # reopened meanwhile, or closed by a stored row
        self.state = BreakerState.CLOSED
        self.proven = False
        self._failures = 0
        self._probing = False
        return True

    def record_accepted(self) -> bool:
        """The sink stored a row we sent, the one proof that it works: closed, proven, the
        cooldown back to its first length. Returns True if this changed anything."""
        if self.state is BreakerState.CLOSED and self.proven:
            self._failures = 0
            return False
        self.state = BreakerState.CLOSED
        self.proven = True
        self._failures = 0
        self.openings = 0
        self._probing = False
        return True

    def record_reconnected(self) -> bool:
        """The sink's client made its connection again: an open breaker's cooldown ends now,
        so that the next permit is a probe instead of a wait of up to `cap_s`. Nothing else
        changes (a reconnect is no proof that rows are stored). Returns True if a cooldown
        was cut short."""
        if self.state is not BreakerState.OPEN:
            return False  # closed, or half-open with its probe under way
        now = self._clock()
        if self._retry_at <= now:
            return False  # over already: the next asker probes anyway
        self._retry_at = now
        return True

    def record_answered(self) -> None:
        """The sink answered a write with a verdict on the row, storing nothing (400, 409, a
        paused queue): its write path answers, so a streak of failures ends; closes nothing."""
        if self.state is BreakerState.CLOSED:
            self._failures = 0

    def record_failure(self, *, severe: bool = False) -> bool:
        """A sink-wide failure; returns True if this opened the breaker."""
        self._failures += 1
        self._probing = False
        if self.state is BreakerState.OPEN:
            return False
        if (
            self.state is BreakerState.HALF_OPEN
            or not self.proven
            or severe
            or self._failures >= self._threshold
        ):
            self._open()
            return True
        return False

    def _open(self) -> None:
        self.openings += 1
        ceiling = min(self._cap_s, self._cooldown_s * 2.0 ** min(self.openings - 1, 32))
        # Jitter (half to all of the ceiling) keeps replicas from probing in lockstep.
        self.cooldown_s = self._rng.uniform(ceiling / 2, ceiling)
        self._retry_at = self._clock() + self.cooldown_s
        self.state = BreakerState.OPEN
        self.proven = False


def retry_horizon_s(
    *, base_s: float, cap_s: float, max_attempts: int, lease_s: float, timeout_s: float
) -> float:
    """The longest time from a row's first attempt to its last while the sink answers:
    every backoff at its ceiling, and each attempt ending no later than its lease (a relay
    that dies mid-attempt leaves the row until the lease expires). A breaker outage adds
    its own length, which has no bound: rows wait, attempts refunded."""
    total = 0.0
    for attempt in range(1, max_attempts):
        total += min(cap_s, base_s * 2.0 ** min(attempt - 1, 64)) + max(lease_s, timeout_s)
    return total
