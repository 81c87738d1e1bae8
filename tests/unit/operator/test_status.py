"""The backlog's counting rules (exact under the bound, PostgreSQL's estimate above it) and
the status report's renderings, without I/O."""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from relayd.core.backlog import Backlog
from relayd.operator.status import (
    Count,
    HeldByPause,
    Instance,
    Parked,
    StatusReport,
    render_text,
    report_json,
)
from relayd.store.records import Pause
from relayd.telemetry.metrics import RelayMetrics

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _sample(**values: Any) -> dict[str, Any]:
    """A `backlog_sample` row: nothing anywhere unless given."""
    row: dict[str, Any] = {
        "due_rows": 0,
        "held_rows": 0,
        "future_rows": 0,
        "leased_rows": 0,
        "lease_window_rows": 0,
        "dead_rows": 0,
        "pending_estimate": 0.0,
        "dead_estimate": 0.0,
        "oldest_claimable_age_s": None,
        "oldest_pending_age_s": None,
        "paused": False,
        "sampled_at": AT,
    }
    return row | values


@pytest.mark.parametrize(
    ("sample", "counts", "estimated"),
    [
        # Under the bound everything is exact; the estimate is ignored.
        (
            _sample(due_rows=7, held_rows=2, future_rows=5, leased_rows=3, dead_rows=4),
            (5, 2, 2, 3, 4),
            set(),
        ),
        (
            _sample(due_rows=7, future_rows=5, pending_estimate=1e6, dead_estimate=1e6),
            (7, 0, 5, 0, 0),
            set(),
        ),
        # Due rows cut at the bound: the estimate less the exact rows not yet due.
        (
            _sample(due_rows=11, future_rows=5, leased_rows=2, pending_estimate=1005.0),
            (1000, 0, 3, 2, 0),
            {"ready"},
        ),
        # ... split between ready and paused as in the rows read.
        (
            _sample(due_rows=11, held_rows=11, future_rows=0, pending_estimate=500.0),
            (0, 500, 0, 0, 0),
            {"ready", "paused"},
        ),
        # Rows not yet due cut at the bound: the estimate less the exact due rows.
        (
            _sample(due_rows=4, future_rows=11, leased_rows=1, pending_estimate=904.0),
            (4, 0, 899, 1, 0),
            {"scheduled"},
        ),
        # Both cut: the rows not yet due at the bound, the rest of the estimate due.
        (
            _sample(due_rows=11, future_rows=11, leased_rows=1, pending_estimate=100.0),
            (89, 0, 10, 1, 0),
            {"ready", "scheduled"},
        ),
        # No statistics yet (reltuples -1): the exact lower bound stands.
        (
            _sample(due_rows=11, pending_estimate=-1.0, dead_rows=11, dead_estimate=None),
            (11, 0, 0, 0, 11),
            {"ready", "dead"},
        ),
        (_sample(dead_rows=11, dead_estimate=250.0), (0, 0, 0, 0, 250), {"dead"}),
        # More rows due within a lease than the bound: the leases counted are a lower bound.
        (
            _sample(future_rows=11, leased_rows=4, lease_window_rows=11, pending_estimate=20.0),
            (0, 0, 16, 4, 0),
            {"scheduled", "leased"},
        ),
    ],
)
def test_counts_are_exact_under_the_bound_and_estimated_above(
    sample: dict[str, Any], counts: tuple[int, ...], estimated: set[str]
) -> None:
    """A scan cut at bound + 1 rows switches its states to PostgreSQL's estimate."""
    backlog = Backlog.from_sample(sample, bound=10)
    got = (backlog.ready, backlog.paused, backlog.scheduled, backlog.leased, backlog.dead)
    assert got == counts
    assert backlog.estimated == estimated


def test_gauges_follow_a_sample() -> None:
    """The sample sets every backlog gauge; an absent age is 0, an infinite one +Inf."""
    metrics = RelayMetrics()
    backlog = Backlog.from_sample(
        _sample(
            due_rows=3,
            future_rows=2,
            leased_rows=1,
            dead_rows=4,
            oldest_claimable_age_s=math.inf,
            paused=True,
        ),
        bound=10,
    )
    metrics.set_backlog(backlog, sampled_at=1234.5)
    value = metrics.registry.get_sample_value
    rows = {s: value("relayd_outbox_rows", {"state": s}) for s in ("ready", "scheduled", "leased")}
    assert rows == {"ready": 3, "scheduled": 1, "leased": 1}
    assert value("relayd_outbox_rows", {"state": "dead"}) == 4
    assert value("relayd_outbox_oldest_claimable_age_seconds") == math.inf
    assert value("relayd_outbox_oldest_pending_age_seconds") == 0
    assert value("relayd_paused") == 1
    assert value("relayd_backlog_sampled_timestamp_seconds") == 1234.5


def _report() -> StatusReport:
    backlog = Backlog.from_sample(
        _sample(
            due_rows=11,
            held_rows=1,
            future_rows=3,
            leased_rows=2,
            dead_rows=2,
            pending_estimate=1003.0,
            oldest_claimable_age_s=75.25,
            oldest_pending_age_s=-math.inf,
            paused=True,
        ),
        bound=10,
    )
    return StatusReport(
        outbox="relayd.outbox",
        backlog=backlog,
        dead_by_reason=[Count("conflict", 2)],
        dead_counted=2,
        top_queues=[Count("default", 9), Count("mail", 1)],
        top_types=[Count("test.echo", 10)],
        top_counted=10,
        pauses=[
            HeldByPause(Pause("mail", "*", "smtp migration", "alice", AT - timedelta(hours=1)), 1),
            HeldByPause(
                Pause(
                    "orders\x1b]52;c;cm0gLXJmIH4=\x07",
                    "order.fulfill",
                    "poison storm: forged\nRelays: none running",
                    "relayd@web-1",
                    AT - timedelta(minutes=30),
                ),
                0,
            ),
        ],
        instances=[
            Instance(
                instance_id=str(uuid.UUID(int=1)),
                host="web-1",
                pid=42,
                version="0.1.0",
                started_at=AT - timedelta(days=2),
                last_seen=AT,
                last_seen_age_s=1.25,
                breaker_state="closed",
                in_flight=3,
                stale=False,
                housekeeping={
                    "cleanup": {
                        "error": "delete_published: ForeignKeyViolationError: 23503: ...",
                        "since": "2026-01-02T03:00:00+00:00",
                        "failures": 4,
                    }
                },
            ),
            Instance(
                instance_id=str(uuid.UUID(int=2)),
                host="web-2",
                pid=7,
                version="0.1.0",
                started_at=AT - timedelta(hours=3),
                last_seen=AT - timedelta(minutes=2),
                last_seen_age_s=123.0,
                breaker_state="open",
                in_flight=0,
                stale=True,
                housekeeping={},
                breaker_reason="cannot connect to NATS at 10.0.0.5:4222: connection refused",
            ),
        ],
        stale_after_s=15.0,
    )


def test_json_shape_is_stable() -> None:
    """The documented JSON shape, in strict JSON (no NaN or Infinity)."""
    data = report_json(_report())
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["at"] == "2026-01-02T03:04:05+00:00"
    assert data["backlog"] == {
        "rows": {"ready": 909, "paused": 91, "scheduled": 1, "leased": 2, "dead": 2},
        "estimated": ["paused", "ready"],
        "counted_up_to": 10,
        "oldest_claimable_age_s": 75.25,
        "oldest_pending_age_s": 0.0,  # created_at = +infinity: ahead of the clock
    }
    assert data["dead_letters"] == {"by_reason": [{"reason": "conflict", "rows": 2}], "counted": 2}
    assert data["top"]["counted"] == 10
    assert data["top"]["queues"] == [{"name": "default", "rows": 9}, {"name": "mail", "rows": 1}]
    assert data["paused"] is True
    assert data["pauses"][0] == {
        "queue": "mail",
        "type": "*",
        "reason": "smtp migration",
        "paused_by": "alice",
        "paused_at": "2026-01-02T02:04:05+00:00",
        "held_rows": 1,
    }
    assert [i["stale"] for i in data["instances"]] == [False, True]
    assert set(data["instances"][0]) == {
        "instance_id",
        "host",
        "pid",
        "version",
        "started_at",
        "last_seen",
        "last_seen_age_s",
        "stale",
        "breaker_state",
        "breaker_reason",
        "in_flight",
        "housekeeping",
    }
    assert data["instances"][0]["housekeeping"]["cleanup"]["failures"] == 4
    assert [i["breaker_reason"] for i in data["instances"]] == [
        None,
        "cannot connect to NATS at 10.0.0.5:4222: connection refused",
    ]
    assert data["stale_after_s"] == 15.0


def test_human_output_marks_estimates_bounds_and_stale_relays() -> None:
    """The table says which counts are estimates, what the top lists cover, who is stale,
    and why a relay's breaker is open."""
    text = render_text(_report())
    assert text.startswith("relayd.outbox at 2026-01-02T03:04:05Z\n")
    lines = text.splitlines()
    assert "  ready              ~909  claimable now" in lines
    assert "  scheduled             1  waiting out a backoff" in lines
    assert "  oldest claimable  1m15s  since its available_at" in lines
    assert "  oldest pending     0.0s  since its created_at" in lines
    assert "(each state counted exactly up to 10 rows; ~ is PostgreSQL's estimate)" in text
    assert "Top queues, over the first 10 pending rows in claim order (the bound)" in text
    assert any(
        line.split() == ["mail", "*", "1", "smtp", "migration", "alice", "2026-01-02T02:04:05Z"]
        for line in lines
    )
    assert (
        f"  {uuid.UUID(int=1)}: housekeeping cleanup failing since 2026-01-02T03:00:00+00:00: "
        "delete_published: ForeignKeyViolationError: 23503: ..."
    ) in lines
    assert (
        f"  {uuid.UUID(int=2)}: breaker open: cannot connect to NATS at 10.0.0.5:4222: "
        "connection refused"
    ) in lines
    assert not any(f"{uuid.UUID(int=1)}: breaker" in line for line in lines)  # closed
    stale = [line for line in lines if "web-2" in line]
    assert stale[0].endswith("STALE")
    assert "2m03s ago" in stale[0]
    assert not next(line for line in lines if "web-1" in line).endswith("STALE")


def test_text_from_the_database_cannot_drive_the_terminal() -> None:
    """A queue name carrying an OSC 52 sequence (the clipboard) reaches the terminal as
    visible escapes; a pause reason carrying a newline and a forged line stays on its line."""
    text = render_text(_report())
    assert "\x1b" not in text
    assert "\x07" not in text
    assert "orders\\x1b]52;c;cm0gLXJmIH4=\\x07" in text
    assert "poison storm: forged Relays: none running" in text
    assert [line for line in text.splitlines() if line.startswith("Relays")] == [
        "Relays (stale: no heartbeat for more than 15.0s)"
    ]


def test_parked_keys_in_the_sample_the_gauges_and_the_report() -> None:
    """Parked keys per route and the oldest parked age: from the sample into the backlog,
    the gauges (a route whose last key is un-parked loses its series) and both renderings;
    a key carrying escapes cannot drive the terminal."""
    metrics = RelayMetrics()
    value = metrics.registry.get_sample_value
    backlog = Backlog.from_sample(
        _sample(
            parked_routes=["mail.send", "order.fulfill"],
            parked_keys=[1, 2],
            oldest_parked_age_s=7300.5,
        ),
        bound=10,
    )
    assert (backlog.parked_keys, backlog.parked) == ({"mail.send": 1, "order.fulfill": 2}, 3)
    metrics.set_backlog(backlog)
    assert value("relayd_parked_keys", {"route": "order.fulfill"}) == 2
    assert value("relayd_parked_keys", {"route": "mail.send"}) == 1
    assert value("relayd_oldest_parked_age_seconds") == 7300.5
    metrics.set_backlog(Backlog.from_sample(_sample(), bound=10))  # none parked any more
    assert value("relayd_parked_keys", {"route": "order.fulfill"}) is None
    assert value("relayd_oldest_parked_age_seconds") == 0

    report = dataclasses.replace(
        _report(),
        backlog=backlog,
        parked=[
            Parked(
                "order-\x1b[2J1", "order.fulfill", "max_attempts", AT - timedelta(hours=2), 7300.5
            )
        ],
    )
    assert report_json(report)["parked_keys"] == {
        "count": 3,
        "by_route": [{"route": "mail.send", "keys": 1}, {"route": "order.fulfill", "keys": 2}],
        "oldest_age_s": 7300.5,
        "oldest": [
            {
                "key": "order-\x1b[2J1",
                "route": "order.fulfill",
                "reason": "max_attempts",
                "parked_at": "2026-01-02T01:04:05+00:00",
                "age_s": 7300.5,
            }
        ],
    }
    lines = render_text(report).splitlines()
    at = lines.index("Parked keys: 3 ordered keys whose rows wait for an operator")
    assert lines[at + 2].split() == ["order-\\x1b[2J1", "order.fulfill", "2h01m", "max_attempts"]
    assert lines[at + 3].startswith("  (the 1 parked longest; `relayd keys list` shows every one")
    assert "Parked keys: none" in render_text(_report())
    assert report_json(_report())["parked_keys"]["count"] == 0
