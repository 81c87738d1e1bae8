"""The settle plan: which fenced UPDATE records each outcome, and the refund and
max-attempts rules (docs/contract.md#c5, #c6)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from relayd.core.outcomes import (
    DeadLetter,
    DeadReason,
    Held,
    NotStarted,
    Outcome,
    Published,
    RetryLater,
    Settled,
    SinkDown,
)
from relayd.core.retry import Backoff
from relayd.core.rows import ClaimedRow
from relayd.engine.settle import Plan, plan
from tests.support import claimed

MAX_ATTEMPTS = 3
RESET = SinkDown("connection reset mid-request")  # reached the sink, not severe
REFUSED = SinkDown("cannot connect: Connection refused", reached=False)
FORBIDDEN = SinkDown("HTTP 403: forbidden", severe=True)
ODD = RetryLater("HTTP 418")


def _row(attempts: int) -> ClaimedRow:
    return dataclasses.replace(claimed(), attempts=attempts)


def _sorted(row: ClaimedRow, outcome: Outcome | None, *, sink_wide: bool = False) -> Plan:
    outcomes = {} if outcome is None else {row.event_id: outcome}
    backoff = Backoff(base_s=1.0, cap_s=30.0, rng=random.Random(7))
    return plan([row], outcomes, max_attempts=MAX_ATTEMPTS, backoff=backoff, sink_wide=sink_wide)


def _where(settlement: Plan) -> str:
    """The one group holding the single planned row."""
    groups = {
        "published": settlement.published,
        "retried": settlement.retried,
        "dead": settlement.dead,
        "released": settlement.released,
    }
    [name] = [name for name, rows in groups.items() if rows]
    return name


@pytest.mark.parametrize(
    ("attempts", "outcome", "sink_wide", "group", "refund", "reason"),
    [
        # Settled at once, whatever the attempt count.
        (1, Published("available"), False, "published", None, None),
        (9, Published("completed", reconciled=True), False, "published", None, None),
        (1, DeadLetter(DeadReason.CONFLICT, "differs"), False, "dead", None, "conflict"),
        (1, NotStarted(), False, "released", None, None),
        (1, None, False, "released", None, None),  # no outcome: never sent
        # The row's own failures count, and exhaust it at max_attempts (C5, C6).
        (1, ODD, False, "retried", 0, None),
        (2, ODD, True, "retried", 0, None),  # a RetryLater is never refunded
        (3, ODD, False, "dead", None, "max_attempts"),
        (3, ODD, True, "dead", None, "max_attempts"),
        (1, RESET, False, "retried", 0, None),
        (3, RESET, False, "dead", None, "max_attempts"),
        # The sink's failures are refunded: they never exhaust a row (C5).
        (3, RESET, True, "retried", 1, None),  # breaker not closed, or stopping
        (3, REFUSED, False, "retried", 1, None),  # the request never left
        (7, FORBIDDEN, False, "retried", 1, None),  # every row fails alike until fixed
    ],
)
def test_each_outcome_lands_in_one_fenced_update(
    attempts: int,
    outcome: Outcome | None,
    sink_wide: bool,
    group: str,
    refund: int | None,
    reason: str | None,
) -> None:
    """Published, dead, released and retried rows go to their own settle statement; the
    refund and max-attempts rules decide between retry and dead letter."""
    settlement = _sorted(_row(attempts), outcome, sink_wide=sink_wide)
    assert _where(settlement) == group
    if refund is not None:
        assert [r.refund for r in settlement.retried] == [bool(refund)]
    if reason is not None:
        assert [d.reason.value for d in settlement.dead] == [reason]


def _delays(settlement: Plan) -> list[float]:
    return [r.delay_s for r in settlement.retried]


def test_retry_after_is_honoured_and_capped() -> None:
    """A server's Retry-After sets the delay (capped at cap_s); otherwise full jitter."""
    row = _row(1)
    assert _delays(_sorted(row, RetryLater("HTTP 409: queue_paused", 12.0))) == [12.0]
    assert _delays(_sorted(row, SinkDown("HTTP 429", retry_after_s=1e9))) == [30.0]
    [jittered] = _delays(_sorted(row, ODD))
    assert 0.0 <= jittered <= 1.0


def test_errors_are_cleaned_for_last_error() -> None:
    """Control characters become spaces and the text is bounded to 512 bytes."""
    settlement = _sorted(_row(1), RetryLater("line\nbreak\x00" + "é" * 600))
    [error] = [r.error for r in settlement.retried]
    assert "\n" not in error
    assert "\x00" not in error
    assert len(error.encode()) <= 512


def test_groups_keep_row_order_across_a_claim() -> None:
    """Each group holds its rows, each with what its statement writes, in claim order."""
    rows = [_row(1) for _ in range(6)]
    outcomes: dict[str, Outcome] = {
        rows[0].event_id: Published("available"),
        rows[1].event_id: ODD,
        rows[2].event_id: Published("scheduled"),
        rows[3].event_id: DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400"),
        rows[4].event_id: NotStarted(),
    }
    backoff = Backoff(base_s=1.0, cap_s=30.0, rng=random.Random(1))
    settlement = plan(rows, outcomes, max_attempts=3, backoff=backoff, sink_wide=False)
    assert [(p.row, p.answer.sink_state) for p in settlement.published] == [
        (rows[0], "available"),
        (rows[2], "scheduled"),
    ]
    assert [r.row for r in settlement.retried] == [rows[1]]
    assert [(d.row, d.reason) for d in settlement.dead] == [(rows[3], DeadReason.SINK_REJECTED)]
    assert settlement.released == [rows[4], rows[5]]


def test_settled_outcomes_name_metrics_labels_and_log_events() -> None:
    """One enum serves the outcome label and the log event name of every settled row."""
    assert [s.value for s in Settled] == [
        "published",
        "reconciled",
        "retried",
        "dead",
        "parked",
        "released",
        "stale",
    ]
    assert Settled.DEAD.event == "relay.dead_lettered"
    assert Settled.RETRIED.event == "relay.retry_scheduled"


@pytest.mark.parametrize(
    ("reason", "group"),
    [
        (DeadReason.SINK_REJECTED, "retried"),
        (DeadReason.SINK_TOO_LARGE, "retried"),
        (DeadReason.SINK_UNPROCESSABLE, "retried"),
        (DeadReason.CONFLICT, "dead"),  # never the sink's configuration: still dead
        (DeadReason.INVALID_ENVELOPE, "dead"),  # our own check
    ],
)
def test_a_poison_storm_retries_the_sinks_rejections(reason: DeadReason, group: str) -> None:
    """During a poison storm of a row's queue and type a 400/413/422 is retried with its
    attempt refunded, never dead-lettered; other dead letters stay dead; a row of another
    queue and type (not among the storm's rows) is dead-lettered as ever."""
    row, other = _row(3), _row(3)
    backoff = Backoff(base_s=1.0, cap_s=30.0, rng=random.Random(7))
    rejected = DeadLetter(reason, "HTTP 400: invalid_request: m")
    settlement = plan(
        [row, other],
        {row.event_id: rejected, other.event_id: rejected},
        max_attempts=MAX_ATTEMPTS,
        backoff=backoff,
        sink_wide=False,
        storm_rows={row.event_id},
    )
    assert row in [entry.row for entry in getattr(settlement, group)]
    assert settlement.dead[-1].row is other
    if group == "retried":
        [retry] = settlement.retried
        assert retry.refund
        assert retry.error.startswith("poison storm, not dead-lettered: HTTP 400")


def test_a_row_the_storm_guard_held_is_retried_refunded_after_its_delay() -> None:
    """`Held` (never sent: its queue and type are held): retried after the hold's delay,
    its attempt given back, whatever attempts it used."""
    row = _row(MAX_ATTEMPTS)
    settlement = plan(
        [row],
        {row.event_id: Held("poison storm: queue q, type t held by relayd", 60.0)},
        max_attempts=MAX_ATTEMPTS,
        backoff=Backoff(base_s=1.0, cap_s=30.0, rng=random.Random(7)),
        sink_wide=False,
    )
    assert _where(settlement) == "retried"
    assert [(r.delay_s, r.refund) for r in settlement.retried] == [(60.0, True)]


@pytest.mark.parametrize(
    ("outcome", "sent"),
    [
        (REFUSED, False),  # refused before any byte left: nothing was sent
        (SinkDown("not connected to NATS at h:4222 (reconnecting)", reached=False), False),
        (RESET, True),  # may have reached the sink
        (FORBIDDEN, True),
        (SinkDown("no answer within the attempt deadline (1.0s)"), True),
        (ODD, True),  # answered: a verdict, whatever it stored
        (Held("slowed down: HTTP 429", 5.0), True),
    ],
)
def test_a_retry_says_whether_anything_was_sent(outcome: Outcome, sent: bool) -> None:
    """Only a failure that certainly sent nothing (`SinkDown.reached` False) is retried as
    unsent: its settle restores the previous attempt time, so the next claim does not take
    it for a row an earlier attempt may have delivered (a re-send)."""
    [retry] = _sorted(_row(1), outcome, sink_wide=True).retried
    assert retry.sent is sent


def test_a_row_held_for_a_stored_sink_pause_is_due_at_once() -> None:
    """A row that met a 410 (`Held` asking for a pause): due again at once when that pause
    is in force, so that it is claimed as soon as an operator lifts it; after the hold's
    delay when the pause could not be stored. Its attempt is given back either way."""
    paused, unstored = _row(1), _row(1)
    gone = Held("https://r.example/gone answered HTTP 410", 60.0, pause=("*", "order.lost"))
    elsewhere = Held("https://r.example/x answered HTTP 410", 60.0, pause=("*", "order.x"))
    settlement = plan(
        [paused, unstored],
        {paused.event_id: gone, unstored.event_id: elsewhere},
        max_attempts=MAX_ATTEMPTS,
        backoff=Backoff(base_s=1.0, cap_s=30.0, rng=random.Random(7)),
        sink_wide=False,
        sink_paused={("*", "order.lost")},
    )
    assert [(r.row, r.delay_s, r.refund) for r in settlement.retried] == [
        (paused, 0.0, True),
        (unstored, 60.0, True),
    ]


@pytest.mark.parametrize(
    ("attempts", "outcome", "group"),
    [
        # A head that can never be delivered parks its key instead of being dead-lettered.
        (1, DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400"), "parked"),
        (1, DeadLetter(DeadReason.INVALID_ENVELOPE, "bad"), "parked"),
        (MAX_ATTEMPTS, ODD, "parked"),
        # Anything else is as for any row: a retry, a refund, a publish, a release.
        (1, ODD, "retried"),
        (MAX_ATTEMPTS, SinkDown("down", reached=False), "retried"),
        (1, Published("available"), "published"),
        (1, None, "released"),
    ],
)
def test_a_parking_row_that_fails_for_good_parks_its_key(
    attempts: int, outcome: Outcome | None, group: str
) -> None:
    row = _row(attempts)
    outcomes = {} if outcome is None else {row.event_id: outcome}
    backoff = Backoff(base_s=1.0, cap_s=30.0, rng=random.Random(7))
    settlement = plan(
        [row],
        outcomes,
        max_attempts=MAX_ATTEMPTS,
        backoff=backoff,
        sink_wide=False,
        parking={row.event_id},
    )
    groups = {
        name: len(getattr(settlement, name))
        for name in ("published", "retried", "dead", "released", "parked")
    }
    assert groups == {name: int(name == group) for name in groups}
    # Without parking, the same failures are dead letters.
    if group == "parked":
        assert len(_sorted(row, outcome).dead) == 1
