"""What a worker's settle statements did, told to the metrics and the log: one event per
settled row (a summary for released rows), and the rows another owner held by then (C3),
which are only counted. `updated` is the set of event ids a fenced statement changed, or
None when the statement did not run (the database was lost: nothing is told).
"""

from __future__ import annotations

from collections.abc import Sequence

from structlog.typing import FilteringBoundLogger

from relayd.metrics import RelayMetrics
from relayd.models import ClaimedRow
from relayd.settlement import DeadRows, PublishedRows, ReleasedRows, RetriedRows, Settled


class SettleAccounts:
    """Metrics and log events for one worker's settles."""

    def __init__(self, metrics: RelayMetrics, log: FilteringBoundLogger) -> None:
        self._metrics = metrics
        self._log = log

    def _stale(self, kind: Settled, rows: Sequence[ClaimedRow], updated: set[str]) -> None:
        """Rows another owner held by the time we settled are only counted (C3)."""
        stale = len(rows) - len(updated)
        if stale:
            self._metrics.settled[Settled.STALE].inc(stale)
            self._log.warning(Settled.STALE.event, kind=kind.value, rows=len(rows), stale=stale)

    def published(
        self, published: PublishedRows, updated: set[str] | None, *, since_claim_s: float
    ) -> None:
        """`since_claim_s`: seconds since the claim's answer, added to each row's age then."""
        if updated is None:
            return
        self._stale(Settled.PUBLISHED, published.rows, updated)
        metrics = self._metrics
        lag = metrics.commit_to_publish
        reconciled = 0
        for row, answer in zip(published.rows, published.answers, strict=True):
            if row.event_id not in updated:
                continue
            lag.observe(max(row.age_s + since_claim_s, 0.0))
            reconciled += answer.reconciled
            settled = Settled.RECONCILED if answer.reconciled else Settled.PUBLISHED
            # A lost answer found again, or a unique policy's choice, is worth an info line.
            (self._log.info if answer.reconciled or answer.sink_job_id else self._log.debug)(
                settled.event,
                event_id=row.event_id,
                attempt=row.attempts,
                sink_state=answer.sink_state,
                sink_job_id=answer.sink_job_id,
            )
        metrics.settled[Settled.RECONCILED].inc(reconciled)
        metrics.settled[Settled.PUBLISHED].inc(len(updated) - reconciled)

    def retried(self, retried: RetriedRows, updated: set[str] | None) -> None:
        if updated is None:
            return
        self._stale(Settled.RETRIED, retried.rows, updated)
        self._metrics.settled[Settled.RETRIED].inc(len(updated))
        for row, delay_s, error, refund in zip(
            retried.rows, retried.delays_s, retried.errors, retried.refunds, strict=True
        ):
            if row.event_id in updated:
                self._log.info(
                    Settled.RETRIED.event,
                    event_id=row.event_id,
                    attempt=row.attempts,
                    retry_in_s=round(delay_s, 3),
                    refunded=bool(refund),
                    error=error,
                )

    def dead(self, dead: DeadRows, updated: set[str] | None) -> None:
        if updated is None:
            return
        self._stale(Settled.DEAD, dead.rows, updated)
        metrics = self._metrics
        metrics.settled[Settled.DEAD].inc(len(updated))
        for row, reason, error in zip(dead.rows, dead.reasons, dead.errors, strict=True):
            if row.event_id in updated:
                metrics.dead_by_reason[reason].inc()
                self._log.warning(
                    Settled.DEAD.event,
                    event_id=row.event_id,
                    attempt=row.attempts,
                    reason=reason,
                    error=error,
                )

    def released(self, released: ReleasedRows, updated: set[str] | None) -> int:
        """The rows handed back unstarted (0 if the statement did not run)."""
        if updated is None:
            return 0
        self._stale(Settled.RELEASED, released.rows, updated)
        self._metrics.settled[Settled.RELEASED].inc(len(updated))
        self._log.debug(Settled.RELEASED.event, rows=len(updated))
        return len(updated)
