"""The poison-storm guard: trips when most of the last settled rows were rejected by the
sink, once per storm, and only on a full window."""

from __future__ import annotations

from relayd.models import DeadLetter, DeadReason, NotStarted, Outcome, Published, RetryLater
from relayd.storm import StormGuard

REJECTED = DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400")
UNPROCESSABLE = DeadLetter(DeadReason.SINK_UNPROCESSABLE, "HTTP 422")
CONFLICT = DeadLetter(DeadReason.CONFLICT, "differs")
OK = Published("available")


def test_trips_past_the_threshold_of_a_full_window() -> None:
    """6 of the last 10 rejected (> 0.5): tripped; the verdict comes once."""
    guard = StormGuard(threshold=0.5, window=10)
    assert not guard.observe([OK] * 4 + [REJECTED] * 5, now=1.0)  # 9 rows: not a full window
    assert guard.observe([UNPROCESSABLE], now=2.0)
    assert (guard.tripped, guard.tripped_at) == (True, 2.0)
    assert guard.rejected_share() == (6, 10)
    assert not guard.observe([REJECTED] * 10, now=3.0)  # already tripped: no second verdict


def test_exactly_the_threshold_does_not_trip() -> None:
    """'More than' the threshold: 5 of 10 at 0.5 is not a storm."""
    guard = StormGuard(threshold=0.5, window=10)
    assert not guard.observe([OK] * 5 + [REJECTED] * 5, now=1.0)
    assert not guard.tripped


def test_only_the_sinks_rejections_count_and_released_rows_are_not_settled() -> None:
    """Conflicts, retries and our own dead letters are not the sink's verdicts; rows
    released unstarted were not settled and do not fill the window."""
    guard = StormGuard(threshold=0.5, window=4)
    outcomes: list[Outcome] = [CONFLICT, RetryLater("odd"), NotStarted(), NotStarted(), OK]
    assert not guard.observe(outcomes, now=1.0)
    assert guard.rejected_share() == (0, 3)


def test_reset_starts_a_new_window() -> None:
    """After the pause is lifted the guard starts over, so one old storm does not trip it."""
    guard = StormGuard(threshold=0.5, window=4)
    assert guard.observe([REJECTED] * 4, now=1.0)
    guard.reset()
    assert not guard.tripped
    assert guard.rejected_share() == (0, 0)
    assert not guard.observe([REJECTED] * 3, now=2.0)
