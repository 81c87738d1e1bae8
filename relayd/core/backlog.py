"""The backlog's counting rules and the relays' heartbeats: what the backlog sampler's gauges,
`relayd status` (the command and `GET /v1/status`) and the heartbeat rows are made of.

Every scan reads at most `BACKLOG_BOUND` rows of an index, and above that a state's count is
PostgreSQL's estimate (`Backlog.from_sample`, pure). The SQL is in `relayd/store/sql/sampling.sql`
(`backlog_sample`, `heartbeat`); `relayd/store/sampling.py` runs it.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# How many rows one scan of the sampler or of `relayd status` reads at most. Counting
# index entries costs about a microsecond each: the bound keeps a sample in the tens of
# milliseconds whatever the backlog (bench: `python -m bench sampler`).
BACKLOG_BOUND = 100_000


@dataclass(frozen=True, slots=True)
class Backlog:
    """The outbox's rows by state at one instant; `estimated` names the states whose count
    is PostgreSQL's estimate (their exact count exceeded `bound`)."""

    ready: int  # due and claimable: what the next claims would take
    paused: int  # due, but in a paused queue: not claimable until resumed
    scheduled: int  # waiting out a backoff
    leased: int  # claimed, in flight
    dead: int  # dead-lettered, not discarded
    estimated: frozenset[str]
    oldest_claimable_age_s: float | None  # None: no claimable row
    oldest_pending_age_s: float | None  # None: nothing pending
    any_pause: bool
    bound: int
    at: datetime | None = None  # the database's clock when sampled
    # Parked keys of ordered delivery, per route (the event type of the head that parked
    # each), and how long the key parked longest has been: a small table, counted whole.
    parked_keys: Mapping[str, int] = field(default_factory=dict)
    oldest_parked_age_s: float | None = None  # None: no key is parked

    @property
    def parked(self) -> int:
        """Parked keys, every route."""
        return sum(self.parked_keys.values())

    def by_state(self) -> dict[str, int]:
        """The gauge's states (a paused row is in none of them)."""
        return {
            "ready": self.ready,
            "scheduled": self.scheduled,
            "leased": self.leased,
            "dead": self.dead,
        }

    @classmethod
    def from_sample(cls, sample: Mapping[str, Any], bound: int) -> Backlog:
        """Turn the `backlog_sample` row (each scan limited to `bound + 1` rows) into counts.

        A scan that read `bound + 1` rows was cut: that count is replaced by an estimate.
        Pending rows have one estimate for all states (the claim index's reltuples), so a
        cut scan's states get what the estimate leaves after the other scan's exact count;
        if both scans were cut, the split is unknown: the rows not yet due are reported at
        the bound (a lower bound) and the rest of the estimate as due. Due rows are split
        between ready and paused in the proportion of the rows read. Leased rows are
        counted among the rows due within relay.lease_s (every lease ends by then); if more
        than `bound` rows are due in that window, the count is a lower bound.
        """
        due_n = int(sample["due_rows"])
        held_n = int(sample["held_rows"])
        future_n = int(sample["future_rows"])
        leased = int(sample["leased_rows"])
        lease_window = int(sample["lease_window_rows"])
        dead = int(sample["dead_rows"])
        pending_estimate = _estimate(sample.get("pending_estimate"))
        estimated: set[str] = set()

        scheduled = future_n - leased
        if future_n > bound and due_n <= bound:
            scheduled = max(round(pending_estimate) - due_n, future_n) - leased
            estimated.add("scheduled")
        elif future_n > bound:
            estimated.add("scheduled")  # the lower bound: see above
        ready, paused = due_n - held_n, held_n
        if due_n > bound:
            due = max(round(pending_estimate) - future_n, due_n)
            paused = round(due * held_n / due_n)
            ready = due - paused
            estimated.add("ready")
            if paused:
                estimated.add("paused")
        if lease_window > bound:
            estimated.add("leased")  # a lower bound: see above
        if dead > bound:
            dead = max(round(_estimate(sample.get("dead_estimate"))), dead)
            estimated.add("dead")
        return cls(
            ready=ready,
            paused=paused,
            scheduled=scheduled,
            leased=leased,
            dead=dead,
            estimated=frozenset(estimated),
            oldest_claimable_age_s=sample["oldest_claimable_age_s"],
            oldest_pending_age_s=sample["oldest_pending_age_s"],
            any_pause=bool(sample["paused"]),
            bound=bound,
            at=sample.get("sampled_at"),
            parked_keys=dict(
                zip(
                    sample.get("parked_routes") or (),
                    (int(n) for n in sample.get("parked_keys") or ()),
                    strict=True,
                )
            ),
            oldest_parked_age_s=sample.get("oldest_parked_age_s"),
        )


def _estimate(value: object) -> float:
    """reltuples: -1 (PostgreSQL 14+) or 0 until the first VACUUM or ANALYZE; None if the
    index is missing. Anything unusable counts as 0, so the exact lower bound wins."""
    if isinstance(value, int | float) and math.isfinite(value) and value > 0:
        return float(value)
    return 0.0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What a running relay writes to relayd_instances every sample interval."""

    instance_id: uuid.UUID
    host: str
    pid: int
    version: str
    started_at: datetime
    breaker_state: str  # closed, half_open, open
    in_flight: int  # rows claimed and not yet settled
    # Its housekeeping chores failing now (relayd/engine/chores.py): chore -> error, since.
    housekeeping: Mapping[str, Mapping[str, Any]]
    # Why its breaker is not closed, in the sink's words (None: closed).
    breaker_reason: str | None = None
