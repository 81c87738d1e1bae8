"""When to try again: exponential backoff with full jitter, `Retry-After`, and the circuit
breaker that stops claiming while the sink is down (C5).

Pure code: the random source and the clock are injected, so tests are exact.

Backoff for the n-th attempt (n >= 1) is uniform over [0, min(cap_s, base_s * 2**(n-1))]
("full jitter"). A server's Retry-After replaces it, capped at cap_s.

The breaker: CLOSED -> OPEN after `threshold` consecutive sink-wide failures (or one severe
failure: 401/403, a wrong base URL) -> after a jittered cooldown, HALF_OPEN: one probe
permit -> CLOSED on a success, OPEN again (with a longer cooldown) on a failure.
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

from relayd import mutants

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
        if mutants.ACTIVE == "no_jitter":
            return ceiling
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
    PROBE = "probe"  # half-open: claim one row to test the sink


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
        self._failures = 0
        self._opens = 0  # consecutive openings, for the growing cooldown
        self._retry_at = 0.0
        self._probing = False

    def permit(self) -> Permit | float | None:
        """A permit, or seconds to wait before asking again (None: wait for a change)."""
        if self.state is BreakerState.CLOSED:
            return Permit.CLAIM
        if self._probing:
            return None
        remaining = self._retry_at - self._clock()
        if remaining > 0:
            return remaining
        self.state = BreakerState.HALF_OPEN
        self._probing = True
        return Permit.PROBE

    def end_probe(self) -> None:
        """The probe ended without telling anything (no row, no request): allow another."""
        self._probing = False

    def record_success(self) -> bool:
        """The sink answered sanely; returns True if this closed the breaker."""
        self._failures = 0
        self._probing = False
        if self.state is BreakerState.CLOSED:
            return False
        self.state = BreakerState.CLOSED
        self._opens = 0
        return True

    def record_failure(self, *, severe: bool = False) -> bool:
        """A sink-wide failure; returns True if this opened the breaker."""
        self._failures += 1
        self._probing = False
        if self.state is BreakerState.OPEN:
            return False
        if self.state is BreakerState.HALF_OPEN or severe or self._failures >= self._threshold:
            self._open()
            return True
        return False

    def _open(self) -> None:
        self._opens += 1
        ceiling = min(self._cap_s, self._cooldown_s * 2.0 ** min(self._opens - 1, 32))
        # Jitter (half to all of the ceiling) keeps replicas from probing in lockstep.
        self._retry_at = self._clock() + self._rng.uniform(ceiling / 2, ceiling)
        self.state = BreakerState.OPEN
