"""Where a worker's claim starts reading the claim index: the watermark (docs/performance.md).

The claim index lists pending rows by `available_at`. Publishing a row removes it from the
index only once vacuum runs, and vacuum cannot while any session holds an old snapshot (a
long report, a forgotten `BEGIN`, a standby's feedback): a claim reading from the start of
the index then steps over every row published since, and slows down without bound. So each
worker starts its scan at a watermark below which no claimable row can be, and the claim's
answer tells where the next one goes:

- `head`: the smallest `available_at` of the pending rows the claim saw from the watermark
  on (leased, scheduled and paused ones too: they become claimable in place);
- a row a claim could not see yet belongs to a transaction that had not committed. Its
  `available_at` default, `relayd_available_at()` (the due_once_writing migration), gives
  the transaction an xid before it reads the clock, so from that stamp on the transaction
  shows in `pg_stat_activity` as a writer, with a start no later than the stamp
  (`writers_since`, the oldest such start; the claim's own start when there is none).
  Whatever the INSERT does before or after (triggers, CHECKs, other defaults), a row is
  never stamped before its transaction is visible as a writer.
  `writers_since` is taken from the previous claim's answer, so a transaction that commits
  between one statement's snapshot and its reading of `pg_stat_activity` is still covered.

The marks cost the claim a read of `pg_stat_activity` (every server process's slot): a
worker claiming a row or a few at a time asks for them at most every MARKS_EVERY_S, and
keeps its watermark in between. A watermark older than it could be is still safe (the scan
starts lower, and steps over a few more published rows); `writers_since` is then the last
marked answer's, older still, so the argument above holds. A worker whose claims carry
BUSY_ROWS rows or more asks on every claim, where its watermark moves fastest.

Rows whose producer set `available_at` in the past by hand, or whose transaction was prepared
for two-phase commit (it leaves `pg_stat_activity` at PREPARE TRANSACTION and may commit much
later), can fall below the watermark: every `full_scan_every_s` the claim reads the whole
index again, so such a row waits at most that long (plus a poll interval for an idle worker).
Pure: the clock is passed in.
"""

from __future__ import annotations

from datetime import datetime

from relayd.core.rows import ClaimBatch

MARKS_EVERY_S = 0.05
BUSY_ROWS = 10


class Watermark:
    """One worker's scan start; None means the start of the index."""

    def __init__(self, *, full_scan_every_s: float) -> None:
        self._full_scan_every_s = full_scan_every_s
        self._next_full_scan = float("-inf")  # the first claim reads the whole index
        self.scan_from: datetime | None = None
        self._writers_before: datetime | None = None  # the previous answer's writers_since
        self._marks_due = float("-inf")  # when the next claim asks for the marks
        self._busy = False  # the last claim carried BUSY_ROWS rows or more

    def for_claim(self, now: float) -> datetime | None:
        """Where the next claim starts (None: a full scan, when one is due)."""
        if now >= self._next_full_scan:
            self._next_full_scan = now + self._full_scan_every_s
            return None
        return self.scan_from

    def wants_marks(self, now: float) -> bool:
        """Whether the next claim asks for the marks (the module docstring)."""
        if self._busy or now >= self._marks_due:
            self._marks_due = now + MARKS_EVERY_S
            return True
        return False

    def advance(self, batch: ClaimBatch) -> None:
        """Move to min(head, the writers' start before this claim's snapshot); stay where it
        is after a claim that carried no marks."""
        self._busy = len(batch.rows) >= BUSY_ROWS
        if not batch.marked:
            return
        writers = self._writers_before
        # Without the previous writers' mark (the first claim, or writers hidden from
        # relayd's role) nothing is known: the next claim reads the whole index.
        if writers is None:
            self.scan_from = None
        else:
            self.scan_from = writers if batch.head is None else min(batch.head, writers)
        self._writers_before = batch.writers_since
