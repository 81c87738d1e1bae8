"""The poison-storm guard: when the sink rejects most rows as invalid (400, 413, 422), the
cause is almost never the rows. A schema or configuration change on the sink's side makes
every row look like poison, and dead-lettering the whole backlog would turn one mistake into
an operator's afternoon of redrives. So past a threshold relayd stops dead-lettering for
those reasons: it pauses the outbox with the reason "poison storm", logs it, lets the alert
fire, and retries (refunded) what it was about to dead-let.

Pure: the caller feeds each claim's outcomes and acts on the verdict.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from relayd.models import DeadLetter, DeadReason, NotStarted, Outcome

# The sink's verdicts that say "this row is invalid": the ones a misconfigured sink gives for
# every row. Our own checks (invalid_envelope, too_large) and a conflict are not its verdicts.
SINK_REJECTIONS = frozenset(
    {DeadReason.SINK_REJECTED, DeadReason.SINK_TOO_LARGE, DeadReason.SINK_UNPROCESSABLE}
)


def sink_rejected(outcome: Outcome) -> bool:
    return isinstance(outcome, DeadLetter) and outcome.reason in SINK_REJECTIONS


class StormGuard:
    """Trips when more than `threshold` of the last `window` settled rows were rejected by
    the sink; stays tripped until `reset()` (the relay resets it once claims come back after
    the pause was lifted)."""

    def __init__(self, *, threshold: float, window: int) -> None:
        self._threshold = threshold
        self._recent: deque[bool] = deque(maxlen=window)
        self.tripped = False
        self.tripped_at = 0.0  # loop time, for the relay's reset rule

    def observe(self, outcomes: Iterable[Outcome], now: float) -> bool:
        """Record a claim's outcomes; True if this trips the guard (only once per storm)."""
        self._recent.extend(
            sink_rejected(outcome) for outcome in outcomes if not isinstance(outcome, NotStarted)
        )
        if self.tripped or len(self._recent) < (self._recent.maxlen or 0):
            return False
        if sum(self._recent) > self._threshold * len(self._recent):
            self.tripped, self.tripped_at = True, now
            return True
        return False

    def rejected_share(self) -> tuple[int, int]:
        """(rejected, settled) over the window, for the log and the pause reason."""
        return sum(self._recent), len(self._recent)

    def reset(self) -> None:
        self.tripped = False
        self._recent.clear()
