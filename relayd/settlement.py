"""How a claim ends: its rows' attempt outcomes turned into the (at most four) fenced UPDATEs
that record them, and the rules that choose between publishing, retrying, refunding,
dead-lettering and releasing (docs/contract.md#c5, #c6).

Pure: `sort_outcomes()` does no I/O and reads no clock; the backoff's random source is
injected. Each group maps one to one onto a `Store` settle method.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from relayd.models import (
    ClaimedRow,
    DeadLetter,
    DeadReason,
    Held,
    NotStarted,
    Outcome,
    Published,
    SinkDown,
    clean_error,
)
from relayd.retry import Backoff
from relayd.storm import SINK_REJECTIONS


class Settled(enum.StrEnum):
    """How a claimed row's attempt was recorded: the `outcome` label of
    `relayd_outcomes_total`, and (through `event`) the name of its log event."""

    PUBLISHED = "published"
    RECONCILED = "reconciled"  # published, proven by a GET rather than a 2xx to our POST
    RETRIED = "retried"
    DEAD = "dead"
    RELEASED = "released"  # handed back unstarted, attempt refunded
    STALE = "stale"  # the settle found another owner's lease: nothing changed (C3)

    @property
    def event(self) -> str:
        return _EVENTS[self]


_EVENTS = {
    Settled.PUBLISHED: "relay.published",
    Settled.RECONCILED: "relay.reconciled",
    Settled.RETRIED: "relay.retry_scheduled",
    Settled.DEAD: "relay.dead_lettered",
    Settled.RELEASED: "relay.released",
    Settled.STALE: "relay.stale_settle",
}


@dataclass(slots=True)
class PublishedRows:
    """For `Store.settle_published`: the sink accepted these rows."""

    rows: list[ClaimedRow] = field(default_factory=list)
    sink_states: list[str] = field(default_factory=list)
    answers: list[Published] = field(default_factory=list)

    def add(self, row: ClaimedRow, answer: Published) -> None:
        self.rows.append(row)
        self.sink_states.append(answer.sink_state)
        self.answers.append(answer)


@dataclass(slots=True)
class RetriedRows:
    """For `Store.settle_retry`: due again after `delays_s`; `refunds` (0 or 1) gives the
    attempt back when the failure was the sink's, not the row's."""

    rows: list[ClaimedRow] = field(default_factory=list)
    delays_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    refunds: list[int] = field(default_factory=list)

    def add(self, row: ClaimedRow, delay_s: float, error: str, *, refund: bool) -> None:
        self.rows.append(row)
        self.delays_s.append(delay_s)
        self.errors.append(error)
        self.refunds.append(int(refund))


@dataclass(slots=True)
class DeadRows:
    """For `Store.settle_dead`: these rows can never succeed, or used up their attempts."""

    rows: list[ClaimedRow] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, row: ClaimedRow, reason: DeadReason, error: str) -> None:
        self.rows.append(row)
        self.reasons.append(reason.value)
        self.errors.append(error)


@dataclass(slots=True)
class ReleasedRows:
    """For `Store.release`: never sent; due at once for anyone, attempt and previous
    attempt time restored."""

    rows: list[ClaimedRow] = field(default_factory=list)

    def add(self, row: ClaimedRow) -> None:
        self.rows.append(row)

    @property
    def previous_attempt_at(self) -> list[datetime | None]:
        return [row.previous_attempt_at for row in self.rows]


@dataclass(slots=True)
class SettleGroups:
    """A claim's rows sorted by the fenced UPDATE that records them (at most four)."""

    published: PublishedRows = field(default_factory=PublishedRows)
    retried: RetriedRows = field(default_factory=RetriedRows)
    dead: DeadRows = field(default_factory=DeadRows)
    released: ReleasedRows = field(default_factory=ReleasedRows)


def event_ids(rows: Sequence[ClaimedRow]) -> list[str]:
    return [row.event_id for row in rows]


def sort_outcomes(
    rows: Sequence[ClaimedRow],
    outcomes: Mapping[str, Outcome],
    *,
    max_attempts: int,
    backoff: Backoff,
    sink_wide: bool,
    storm_rows: Collection[str] = frozenset(),
) -> SettleGroups:
    """Group each row by what its outcome asks for.

    `sink_wide` says the sink is failing for every row right now (the breaker is not
    closed) or the daemon is stopping: a `SinkDown` is then refunded, so an outage of any
    length, or our own shutdown, never uses up a row's attempts (C5). `storm_rows` are the
    rows of a queue and type the poison-storm guard holds (relayd/storm.py): the sink's
    rejections of them are retried, refunded, instead of dead-lettered; a row the guard kept
    from being sent (`Held`) is retried refunded too. A row with no outcome was never sent
    and is released.
    """
    groups = SettleGroups()
    for row in rows:
        outcome = outcomes.get(row.event_id, NotStarted())
        if isinstance(outcome, Published):
            groups.published.add(row, outcome)
        elif (
            isinstance(outcome, DeadLetter)
            and outcome.reason in SINK_REJECTIONS
            and row.event_id in storm_rows
        ):
            error = clean_error(f"poison storm, not dead-lettered: {outcome.error}")
            groups.retried.add(row, backoff.delay_s(row.attempts), error, refund=True)
        elif isinstance(outcome, Held):
            groups.retried.add(row, outcome.retry_after_s, clean_error(outcome.error), refund=True)
        elif isinstance(outcome, DeadLetter):
            groups.dead.add(row, outcome.reason, clean_error(outcome.error))
        elif isinstance(outcome, NotStarted):
            groups.released.add(row)
        else:
            error = clean_error(outcome.error)
            refund = isinstance(outcome, SinkDown) and refunded(outcome, sink_wide=sink_wide)
            if not refund and row.attempts >= max_attempts:
                groups.dead.add(row, DeadReason.MAX_ATTEMPTS, error)
            else:
                delay_s = backoff.delay_s(row.attempts, outcome.retry_after_s)
                groups.retried.add(row, delay_s, error, refund=refund)
    return groups


def refunded(outcome: SinkDown, *, sink_wide: bool) -> bool:
    """Whether a sink failure gives the row its attempt back: the request never left, the
    credentials or the URL are wrong (every row fails alike), or the failure is sink-wide."""
    return not outcome.reached or outcome.severe or sink_wide
