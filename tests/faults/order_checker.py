"""The ordering checker: did a destination see each key's rows in commit order?

Given what the destination saw (event ids in arrival order, repeats included) and each
row's key and number (`ordering_seq`, commit order within the key), it reports per key:

- an **order violation** when a row arrives after a later row of its key has arrived: a
  first delivery out of order, or a repeat of a row after its successor's first delivery
  (a repeat is allowed only before the successor's first delivery: an at-least-once
  re-send of the head);
- a **lost** row: a row that should have been delivered (not dead-lettered) and never
  arrived;
- a **skipped** row that arrived anyway is not an error (a dead letter may have been
  delivered by an attempt whose answer was lost).

Pure: no I/O. The fault suite feeds it the emulator's arrivals, a NATS stream's messages
in stream order, or a webhook receiver's deliveries.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class OrderReport:
    keys: int = 0
    delivered: int = 0  # distinct rows that arrived
    repeats: int = 0  # arrivals of a row that had arrived before
    violations: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.violations and not self.lost


def check_order(
    arrivals: Iterable[str],
    rows: Mapping[str, tuple[str, int]],
    *,
    dead: Collection[str] = frozenset(),
) -> OrderReport:
    """Check `arrivals` (event ids, in the order the destination saw them) against `rows`
    (event id -> (key, seq)); `dead`: rows dead-lettered, which need not arrive. Arrivals
    of ids not in `rows` (unordered rows) are ignored."""
    report = OrderReport(keys=len({key for key, _ in rows.values()}))
    highest: dict[str, int] = {}  # per key, the highest seq that has arrived
    seen: set[str] = set()
    for event_id in arrivals:
        row = rows.get(event_id)
        if row is None:
            continue
        key, seq = row
        if event_id in seen:
            report.repeats += 1
        else:
            seen.add(event_id)
            report.delivered += 1
        top = highest.get(key)
        if top is not None and seq < top:
            report.violations.append(
                f"key {key!r}: row {seq} ({event_id}) arrived after row {top} had"
            )
        else:
            highest[key] = seq
    report.lost = sorted(i for i in rows if i not in seen and i not in dead)
    return report
