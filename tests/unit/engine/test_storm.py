"""The poison-storm guard: trips a queue and type when most of its last settled rows were
rejected by the sink, once per storm, only on a full window of that key, and holds it until
a claim sent after its pause was stored brings its rows back."""

from __future__ import annotations

from collections.abc import Sequence

from relayd.core.outcomes import DeadLetter, DeadReason, NotStarted, Outcome, Published, RetryLater
from relayd.engine.storm import Key, StormGuard, settled_by_key

REJECTED = DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400")
UNPROCESSABLE = DeadLetter(DeadReason.SINK_UNPROCESSABLE, "HTTP 422")
CONFLICT = DeadLetter(DeadReason.CONFLICT, "differs")
OK = Published("available")
ORDERS: Key = ("orders", "order.fulfill")
MAIL: Key = ("mail", "mail.send")


def _of(key: Key, outcomes: Sequence[Outcome]) -> list[tuple[Key, Outcome]]:
    return [(key, outcome) for outcome in outcomes]


def _observe(guard: StormGuard, rows: Sequence[tuple[Key, Outcome]], now: float) -> list[Key]:
    """One claim's rows through the guard, as the relay feeds them (`settled_by_key`)."""
    ids = [f"row{n}" for n in range(len(rows))]
    outcomes = {event_id: outcome for event_id, (_key, outcome) in zip(ids, rows, strict=True)}
    keys = {event_id: key for event_id, (key, _outcome) in zip(ids, rows, strict=True)}
    settled, _rejected = settled_by_key(outcomes, keys)
    return guard.record(settled, now)


def test_trips_past_the_threshold_of_a_full_window() -> None:
    """6 of the last 10 rejected (> 0.5): tripped; the verdict comes once."""
    guard = StormGuard(threshold=0.5, window=10)
    assert _observe(guard, _of(ORDERS, [OK] * 4 + [REJECTED] * 5), now=1.0) == []  # 9: not full
    assert _observe(guard, _of(ORDERS, [UNPROCESSABLE]), now=2.0) == [ORDERS]
    trip = guard.trips[ORDERS]
    assert (trip.rejected, trip.settled, trip.at, trip.stored_at) == (6, 10, 2.0, None)
    assert trip.reason(ORDERS) == (
        "poison storm: the sink rejected 6 of the last 10 rows of queue orders, type order.fulfill"
    )
    assert _observe(guard, _of(ORDERS, [REJECTED] * 10), now=3.0) == []  # no second verdict


def test_exactly_the_threshold_does_not_trip() -> None:
    """'More than' the threshold: 5 of 10 at 0.5 is not a storm."""
    guard = StormGuard(threshold=0.5, window=10)
    assert _observe(guard, _of(ORDERS, [OK] * 5 + [REJECTED] * 5), now=1.0) == []
    assert guard.trips == {}


def test_each_queue_and_type_has_its_own_window() -> None:
    """One key's rejections never trip another key, nor fill its window: the healthy key
    beside a rejected one keeps flowing."""
    guard = StormGuard(threshold=0.5, window=4)
    mixed = _of(ORDERS, [REJECTED] * 4) + _of(MAIL, [OK] * 4)
    assert _observe(guard, mixed, now=1.0) == [ORDERS]
    assert guard.holds(ORDERS, claimed_at=2.0)
    assert not guard.holds(MAIL, claimed_at=2.0)
    assert _observe(guard, _of(MAIL, [REJECTED] * 2 + [OK] * 2), now=3.0) == []  # 2 of 4


def test_only_the_sinks_rejections_count_and_released_rows_are_not_settled() -> None:
    """Conflicts, retries and our own dead letters are not the sink's verdicts; rows
    released unstarted were not settled and do not fill the window."""
    guard = StormGuard(threshold=0.5, window=4)
    outcomes: list[Outcome] = [CONFLICT, RetryLater("odd"), NotStarted(), NotStarted(), OK]
    assert _observe(guard, _of(ORDERS, outcomes), now=1.0) == []
    assert _observe(guard, _of(ORDERS, [REJECTED]), now=2.0) == []  # 1 of the last 4


def test_a_trip_holds_until_a_claim_sent_after_its_pause_was_stored() -> None:
    """Unstored: held locally, whatever the claim's time. Stored at t=5: a claim sent before
    may still hold its rows (held); one sent after can only have them if an operator resumed:
    the trip ends and a fresh window starts."""
    guard = StormGuard(threshold=0.5, window=4)
    assert _observe(guard, _of(ORDERS, [REJECTED] * 4), now=1.0) == [ORDERS]
    assert guard.unstored() == [ORDERS]
    assert guard.holds(ORDERS, claimed_at=100.0)
    guard.stored(ORDERS, now=5.0)
    assert guard.unstored() == []
    assert guard.holds(ORDERS, claimed_at=4.0)
    assert not guard.holds(ORDERS, claimed_at=6.0)
    assert guard.trips == {}
    assert _observe(guard, _of(ORDERS, [REJECTED] * 3), now=7.0) == []  # a fresh window


def test_the_keys_remembered_are_bounded() -> None:
    """A producer inventing types cannot grow the guard's memory: the least recently seen
    key's window is forgotten first."""
    guard = StormGuard(threshold=0.5, window=2, max_keys=3)
    for n in range(5):
        _observe(guard, [(("q", f"t{n}"), REJECTED)], now=float(n))
    # t0 and t1 were forgotten: one more rejection each does not complete their windows.
    assert _observe(guard, [(("q", "t0"), REJECTED), (("q", "t1"), REJECTED)], now=9.0) == []
    assert _observe(guard, [(("q", "t4"), REJECTED)], now=10.0) == [("q", "t4")]


def test_rows_are_grouped_by_key_and_the_rejected_named() -> None:
    """Each key's settled rows in claim order; released rows and rows without a key (their
    envelope did not parse) left out; the ids of the sink's rejections listed."""
    outcomes: dict[str, Outcome] = {
        "a": OK,
        "b": REJECTED,
        "c": NotStarted(),
        "d": UNPROCESSABLE,
        "e": CONFLICT,
        "f": REJECTED,
    }
    keys = {"a": ORDERS, "b": ORDERS, "c": ORDERS, "d": MAIL, "e": MAIL}
    assert settled_by_key(outcomes, keys) == (
        {ORDERS: [False, True], MAIL: [True, False]},
        ["b", "d"],
    )
