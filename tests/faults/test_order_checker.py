"""The ordering checker's verdicts, as a table: it must catch what it exists to catch."""

from __future__ import annotations

import pytest

from tests.faults.order_checker import check_order

ROWS = {"a1": ("a", 1), "a2": ("a", 2), "a3": ("a", 3), "b1": ("b", 1), "b2": ("b", 2)}


@pytest.mark.parametrize(
    ("arrivals", "dead", "violations", "lost", "repeats"),
    [
        (["a1", "b1", "a2", "b2", "a3"], (), 0, [], 0),  # in order, keys interleaved
        (["a1", "a1", "a2", "a3", "b1", "b2"], (), 0, [], 1),  # a head re-sent: allowed
        (["a1", "a2", "a1", "a3", "b1", "b2"], (), 1, [], 1),  # repeat after the successor
        (["a2", "a1", "a3", "b1", "b2"], (), 1, [], 0),  # first deliveries out of order
        (["a1", "a3", "b1", "b2"], (), 0, ["a2"], 0),  # a hole: a2 never arrived
        (["a1", "a3", "b1", "b2"], ("a2",), 0, [], 0),  # a2 dead-lettered: skipped
        (["a1", "x", "a2", "a3", "b1", "b2"], (), 0, [], 0),  # unordered rows ignored
    ],
)
def test_the_checker_finds_every_order_violation_and_hole(
    arrivals: list[str], dead: tuple[str, ...], violations: int, lost: list[str], repeats: int
) -> None:
    report = check_order(arrivals, ROWS, dead=set(dead))
    assert len(report.violations) == violations, report.violations
    assert report.lost == lost
    assert report.repeats == repeats
    assert report.clean == (violations == 0 and not lost)
    assert report.keys == 2
