"""A dead-letter action in bounded batches: what it selects, the request, the walk, the summary.

A redrive first looks for rows of ordered keys that later rows of their key overtook (those
rows were published while this one was dead): redriving one would deliver it out of its
key's order, so unless the request says `out_of_order` the whole action is refused, nothing
changed, and the summary names them (`ActionSummary.out_of_order`). Each batch looks again
once its rows are locked, and skips such a row (`RowOutcome.OUT_OF_ORDER`), for a later row
published in between.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from relayd.operator.dlq_filters import filters_json
from relayd.operator.render import iso
from relayd.store.records import (
    AUDIT_MAX_IDS,
    AuditEntry,
    DeadLetterBatch,
    DeadLetterFilter,
    DeadLetterPage,
    DlqAction,
    OutOfOrder,
    RowOutcome,
    RowResult,
)

if TYPE_CHECKING:
    from relayd.store import Store

# Rows per batch: one statement and one short transaction each.
DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 10_000
# How many out-of-order rows a refused redrive names (it counts them all).
OUT_OF_ORDER_SHOWN = 100


@dataclass(frozen=True, slots=True)
class Selection:
    """The rows an action is for: the named `ids`, or every dead letter (not discarded)
    matching `filters` and dead-lettered before `until`."""

    ids: list[str] | None
    filters: DeadLetterFilter
    until: datetime

    def audit_filters(self) -> dict[str, Any]:
        if self.ids is not None:
            return {"named_ids": len(self.ids)}
        return {"all": True} | filters_json(self.filters) | {"until": iso(self.until)}


@dataclass
class ActionSummary:
    """What an action did (or, dry, would do), batch after batch."""

    action: DlqAction
    dry_run: bool
    selection: dict[str, Any]
    counts: Counter[RowOutcome] = field(default_factory=Counter)
    changed_ids: list[str] = field(default_factory=list)  # the first AUDIT_MAX_IDS only
    skipped: list[RowResult] = field(default_factory=list)
    batches: int = 0
    audit_id: int | None = None
    # A redrive refused whole: the rows that later rows of their key overtook (the first
    # OUT_OF_ORDER_SHOWN), and how many there are.
    out_of_order: list[OutOfOrder] = field(default_factory=list)
    out_of_order_total: int = 0

    @property
    def refused(self) -> bool:
        """Nothing was done: the redrive would have delivered rows out of their key's order."""
        return self.out_of_order_total > 0

    @property
    def changed(self) -> int:
        return self.counts[RowOutcome.REDRIVEN] + self.counts[RowOutcome.DISCARDED]

    @property
    def matched(self) -> int:
        """Rows selected by the filters, or named."""
        return sum(self.counts.values())

    def add(self, results: Sequence[RowResult], audit_id: int | None, *, examined: int) -> None:
        if examined:  # the read that only finds the end of the index is no batch
            self.batches += 1
        self.audit_id = audit_id
        for result in results:
            self.counts[result.outcome] += 1
            if result.outcome.changed:
                if len(self.changed_ids) < AUDIT_MAX_IDS:
                    self.changed_ids.append(result.event_id)
            else:
                self.skipped.append(result)

    def as_json(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "dry_run": self.dry_run,
            "selection": self.selection,
            "matched": self.matched,
            "counts": {outcome.value: n for outcome, n in sorted(self.counts.items())},
            "changed_ids": self.changed_ids if self.changed <= AUDIT_MAX_IDS else None,
            "skipped": [
                {"event_id": r.event_id, "outcome": r.outcome.value, "reason": r.detail}
                for r in self.skipped
            ],
            "batches": self.batches,
            "audit_id": self.audit_id,
            "refused": "out_of_order" if self.refused else None,
            "out_of_order": [
                {"event_id": r.event_id, "key": r.key, "delivered_after": r.delivered_after}
                for r in self.out_of_order
            ],
            "out_of_order_total": self.out_of_order_total,
        }


@dataclass(frozen=True, slots=True)
class DlqRequest:
    """An operator's request to act on dead letters: what, on which rows, audited as whom."""

    action: DlqAction
    selection: Selection
    audit: AuditEntry
    batch_size: int = DEFAULT_BATCH_SIZE
    dry_run: bool = False
    # A redrive of rows that later rows of their key overtook, on purpose (--out-of-order).
    out_of_order: bool = False


async def act(
    store: Store, request: DlqRequest, on_batch: Callable[[ActionSummary], None] | None = None
) -> ActionSummary:
    """Redrive or discard the selected dead letters, `request.batch_size` rows per transaction.

    Each batch commits on its own (a dry run rolls each back) with its share of the audit
    row, so an interrupted action leaves every batch it finished done and audited. A row
    that cannot be acted on is skipped and reported, never failing its batch. A redrive that
    would deliver rows of ordered keys after later rows of their key is refused whole
    (`summary.refused`) unless `request.out_of_order`.
    """
    selection, size = request.selection, request.batch_size
    summary = ActionSummary(request.action, request.dry_run, selection.audit_filters())
    if request.out_of_order:
        summary.selection["out_of_order"] = True
    audit = dataclasses.replace(request.audit, filters=summary.selection)
    if request.action is DlqAction.REDRIVE and not request.out_of_order:
        summary.out_of_order, summary.out_of_order_total = await store.dead_letters_out_of_order(
            selection.ids,
            selection.filters,
            until=selection.until,
            limit=OUT_OF_ORDER_SHOWN,
        )
        if summary.refused:
            return summary

    async def one_batch(target: DeadLetterPage | list[str]) -> DeadLetterBatch:
        batch = await store.act_on_dead_letters(
            request.action,
            target,
            audit=audit,
            audit_id=summary.audit_id,
            dry_run=request.dry_run,
            out_of_order=request.out_of_order,
        )
        summary.add(batch.results, batch.audit_id, examined=batch.examined)
        if on_batch is not None:
            on_batch(summary)
        return batch

    if selection.ids is not None:
        for start in range(0, len(selection.ids), size):
            await one_batch(selection.ids[start : start + size])
        return summary
    page = DeadLetterPage(selection.filters, until=selection.until, limit=size)
    while True:
        batch = await one_batch(page)
        after = batch.next_after
        if batch.examined < size or after is None or _beyond(after[0], selection.until):
            return summary  # the index is read up to the walk's end
        page = dataclasses.replace(page, after=after)


def _beyond(dead_at: datetime, until: datetime) -> bool:
    if dead_at.tzinfo is None:  # asyncpg reads PostgreSQL's infinities as naive extremes
        return dead_at == datetime.max
    return dead_at >= until


def walk_end(filters: DeadLetterFilter, now: datetime) -> datetime:
    """Where a bulk walk stops: `--until`, and never past the command's start."""
    return now if filters.until is None else min(filters.until, now)
