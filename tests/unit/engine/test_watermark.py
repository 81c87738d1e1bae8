"""The claim's watermark: min(head, the previous answer's writers), a full scan first and
then every interval (docs/performance.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from relayd.core.rows import ClaimBatch, ClaimedRow
from relayd.engine.watermark import BUSY_ROWS, MARKS_EVERY_S, Watermark

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _batch(head: datetime | None, writers_since: datetime) -> ClaimBatch:
    return ClaimBatch(rows=[], head=head, writers_since=writers_since)


def test_the_first_claim_scans_everything_and_the_second_still_does() -> None:
    """Nothing is known before an answer, and one answer alone lacks the writers' mark taken
    before its snapshot: the first two claims read the whole index."""
    mark = Watermark(full_scan_every_s=10.0)
    assert mark.for_claim(0.0) is None
    mark.advance(_batch(T0, T0 + timedelta(seconds=5)))
    assert mark.scan_from is None
    assert mark.for_claim(1.0) is None
    mark.advance(_batch(T0 + timedelta(seconds=3), T0 + timedelta(seconds=9)))
    assert mark.scan_from == T0 + timedelta(seconds=3)  # min(head, previous writers)


def test_an_open_writer_holds_the_watermark_back() -> None:
    """A transaction that started writing before the previous claim bounds the watermark,
    however far the head moved: its rows, once committed, are never below it."""
    mark = Watermark(full_scan_every_s=10.0)
    writer_start = T0 - timedelta(minutes=5)
    assert mark.for_claim(0.0) is None
    mark.advance(_batch(T0, writer_start))
    mark.advance(_batch(T0 + timedelta(minutes=1), T0 + timedelta(minutes=1)))
    assert mark.scan_from == writer_start
    assert mark.for_claim(1.0) == writer_start


def test_no_pending_row_leaves_the_writers_mark() -> None:
    """An empty answer (no pending row from the watermark on) moves it to the writers' mark."""
    mark = Watermark(full_scan_every_s=10.0)
    mark.advance(_batch(None, T0))
    mark.advance(_batch(None, T0 + timedelta(seconds=1)))
    assert mark.scan_from == T0


def test_a_full_scan_comes_back_every_interval() -> None:
    """Rows set below the watermark by hand wait at most one interval."""
    mark = Watermark(full_scan_every_s=10.0)
    assert mark.for_claim(100.0) is None
    mark.advance(_batch(T0, T0))
    mark.advance(_batch(T0, T0))
    assert mark.for_claim(105.0) == T0
    assert mark.for_claim(109.9) == T0
    assert mark.for_claim(110.0) is None
    assert mark.for_claim(111.0) == T0


def test_a_quiet_worker_asks_for_the_marks_at_most_every_interval() -> None:
    """A claim of a row or a few asks for the marks when MARKS_EVERY_S has passed since the
    last that did; in between, claims carry none and the watermark stays where it is."""
    unmarked = ClaimBatch(rows=[], head=None, writers_since=None, marked=False)
    mark = Watermark(full_scan_every_s=10.0)
    assert mark.for_claim(0.0) is None
    assert mark.wants_marks(0.0)
    mark.advance(_batch(T0, T0))
    assert not mark.wants_marks(MARKS_EVERY_S / 2)
    mark.advance(unmarked)
    assert mark.scan_from is None  # still no writers' mark from before a snapshot
    assert mark.wants_marks(MARKS_EVERY_S)
    mark.advance(_batch(T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)))
    assert mark.scan_from == T0
    # An answer without marks (None both, meaning nothing) moves nothing.
    assert not mark.wants_marks(MARKS_EVERY_S * 1.5)
    mark.advance(unmarked)
    assert mark.scan_from == T0
    assert mark.for_claim(1.0) == T0
    # The next marked answer uses the last marked writers' mark, taken before its snapshot.
    assert mark.wants_marks(MARKS_EVERY_S * 2)
    mark.advance(_batch(T0 + timedelta(seconds=5), T0 + timedelta(seconds=6)))
    assert mark.scan_from == T0 + timedelta(seconds=2)


def test_a_busy_worker_asks_on_every_claim() -> None:
    """A claim that carried BUSY_ROWS rows or more: the next asks too, however soon, since
    the watermark moves fastest then."""
    rows = [ClaimedRow(f"id-{n}", b"{}", 1, None, 0.0, redriven=False) for n in range(BUSY_ROWS)]
    mark = Watermark(full_scan_every_s=10.0)
    assert mark.wants_marks(0.0)
    mark.advance(ClaimBatch(rows=rows, head=T0, writers_since=T0))
    assert mark.wants_marks(0.001)
    mark.advance(ClaimBatch(rows=rows[:1], head=T0, writers_since=T0))
    assert not mark.wants_marks(0.002)
