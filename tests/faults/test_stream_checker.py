"""The stream checker's negative controls: each way a stream can break the contract is
reported (tests/faults/stream_checker.py), and a clean stream is not."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from relayd.testing.nats import Stored, read_stream
from tests.faults.nats_stage import NatsStage
from tests.faults.stream_checker import (
    Expected,
    body_of,
    late_stores,
    ledger_of,
    marker_problems,
    split_markers,
    stream_problems,
)

EXPECTED = Expected("EVENTS", "/src", {"order.updated": "events.orders"})
WHEN = "2024-05-01T12:00:00Z"
NOW = datetime(2024, 5, 1, tzinfo=UTC)


def row(event_id: str, *, published: bool = True, dead: str | None = None) -> dict[str, Any]:
    job = {
        "id": event_id,
        "type": "order.updated",
        "args": [{"b": 2, "a": event_id}],
        "meta": {"version": 3, "occurred_at": WHEN},
    }
    return {
        "event_id": event_id,
        "job": json.dumps(job),
        "published_at": NOW if published else None,
        "dead_reason": dead,
    }


def message(event_id: str, seq: int = 1, **changes: Any) -> Stored:
    headers = {
        "Nats-Msg-Id": event_id,
        "Message-Id": event_id,
        "Nats-Expected-Stream": "EVENTS",
        "ce-specversion": "1.0",
        "ce-id": event_id,
        "ce-type": "order.updated",
        "ce-source": "/src",
        "ce-time": WHEN,
        "ce-dataversion": "3",
        "ce-datacontenttype": "application/json",
        "Content-Type": "application/json",
    } | changes.pop("headers", {})
    body = changes.pop("body", f'{{"a":"{event_id}","b":2}}'.encode())
    return Stored(seq, changes.pop("subject", "events.orders"), headers, body)


def test_a_clean_stream_has_no_problems() -> None:
    """Each published row's message once, with its headers, body (sorted, compact) and
    subject: nothing to report."""
    rows = [row("e1"), row("e2"), row("e3", published=False, dead="no_route")]
    assert stream_problems(rows, [message("e1"), message("e2", 2)], EXPECTED) == []


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "e1: published, 0 messages in the stream"),
        ([message("e1"), message("e1", 2)], "e1: published, 2 messages in the stream"),
        ([message("e1", headers={"ce-time": "2024"})], "e1: headers"),
        ([message("e1", headers={"Message-Id": "x"})], "e1: headers"),
        ([message("e1", body=b'{"b":2,"a":"e1"}')], "e1: body"),
        ([message("e1", subject="events.other")], "e1: on subject events.other"),
    ],
)
def test_each_wrong_message_is_reported(messages: list[Stored], problem: str) -> None:
    """Missing, twice, a header off, the body in another encoding, another subject."""
    [found] = stream_problems([row("e1")], messages, EXPECTED)
    assert found.startswith(problem)


KEYED = Expected("EVENTS", "/src", {"order.updated": "events.orders.{key}"})


def keyed(event_id: str, seq: int, key: str, expects: int, **changes: Any) -> Stored:
    fence = {"Nats-Expected-Last-Subject-Sequence": str(expects)}
    return message(event_id, seq, subject=f"events.orders.{key}", headers=fence, **changes)


def test_a_key_subject_holds_its_rows_each_fenced_by_the_one_before() -> None:
    """A route whose subject holds the key: each message on its key's subject, expecting
    the sequence of the message before it there (0 for the first); a message on another
    key's subject, or expecting anything else, is reported."""
    rows = [row(f"e{n}") | {"ordering_key": key} for n, key in enumerate("aab", start=1)]
    clean = [keyed("e1", 1, "a", 0), keyed("e2", 2, "a", 1), keyed("e3", 3, "b", 0)]
    assert stream_problems(rows, clean, KEYED) == []
    broken = [keyed("e1", 1, "a", 0), keyed("e3", 2, "b", 0), keyed("e2", 3, "a", 0)]
    [found] = stream_problems(rows, broken, KEYED)
    assert found.startswith("e2: headers differ: {'Nats-Expected-Last-Subject-Sequence': '0'}")
    elsewhere = [keyed("e1", 1, "a", 0), keyed("e2", 2, "b", 0), keyed("e3", 3, "b", 2)]
    assert stream_problems(rows, elsewhere, KEYED) == ["e2: on subject events.orders.b"]


def test_a_dead_row_in_the_stream_and_a_planted_conflict() -> None:
    """A dead row's id in the stream is reported unless it is the planted message alone and
    the row is dead-lettered `conflict`."""
    planted = Expected(**{**EXPECTED.__dict__, "planted": {"e2": b"other"}})
    rows = [row("e1", published=False, dead="too_large"), row("e2", published=False, dead="x")]
    messages = [message("e1"), message("e2", 2, body=b"other")]
    assert stream_problems(rows, messages, planted) == [
        "e1: dead (too_large) but in the stream",
        "e2: planted conflict, dead x",
    ]


def test_markers_each_just_before_its_event() -> None:
    """Atomic-marker mode: a published row's marker once, just before its event, in its
    batch; a marker missing, twice, elsewhere, of another batch or for a row not published
    is reported."""
    batch = {"Nats-Batch-Id": "b1"}
    other = {"Nats-Batch-Id": "b2"}

    def marker(event_id: str, seq: int, headers: dict[str, str] = batch) -> Stored:
        return Stored(seq, f"relayd.markers.{event_id}", headers, b"{}")

    rows = [row(name) for name in ("e1", "e2", "e3", "e4", "e5")] + [
        row("e6", published=False, dead="conflict")
    ]
    stored = [
        marker("e1", 1),
        message("e1", 2, headers=batch),
        message("e2", 3, headers=batch),  # no marker
        marker("e3", 4),
        marker("e3", 5),
        message("e3", 6, headers=batch),
        marker("e4", 7),
        message("e5", 8, headers=batch),
        message("e4", 9, headers=batch),
        marker("e5", 10, other),
        message("e5", 11, headers=batch),
        marker("e6", 12),
    ]
    markers, events = split_markers(stored, "relayd.markers")
    assert [m.seq for m in events] == [2, 3, 6, 8, 9, 11]
    assert marker_problems(rows, stored, markers) == [
        "e2: published, 0 markers",
        "e3: published, 2 markers",
        "e4: its marker (seq 7) is not before it",
        "e5: its marker is of another batch",
        "e6: 1 marker(s), not published",
    ]


def test_a_message_stored_past_its_start_by_bound() -> None:
    """C4 at the stream: a message stored later than lease_s - timeout_s after the row's
    latest claim before it, or before any claim of the row, is reported; the planted
    conflict is not."""
    window = Expected(**{**EXPECTED.__dict__, "planted": {"e4": b"x"}, "send_window_s": 2.0})
    claim = NOW
    claims = [
        {"event_id": "e1", "tx_now": claim},
        {"event_id": "e2", "tx_now": claim},
        {"event_id": "e2", "tx_now": claim + timedelta(seconds=5)},
    ]

    def at(event_id: str, seq: int, after_s: float) -> Stored:
        stored_at = NOW + timedelta(seconds=after_s)
        return Stored(seq, "events.orders", {"Nats-Msg-Id": event_id}, b"{}", stored_at)

    messages = [at("e1", 1, 1.9), at("e2", 2, 6.0), at("e4", 3, 0.0)]
    assert late_stores(messages, claims, window) == []
    [late, early] = late_stores([at("e1", 1, 2.5), at("e3", 2, 1.0)], claims, window)
    assert late.startswith("e1: stored 0.500 s past its claim's start-by bound")
    assert early == "e3: stored (seq 2) before any claim"


def test_the_ledger_counts_each_id_and_names_messages_without_one() -> None:
    """The stream as an emulator ledger: a count per id, the job rebuilt from the headers,
    and a message with no Nats-Msg-Id under a name no outbox row has."""
    bare = Stored(3, "events.orders", {}, b"{}")
    jobs = ledger_of([message("e1"), message("e1", 2), bare])["jobs"]
    assert jobs["e1"]["created"] == 2
    assert jobs["e1"]["job"] == {
        "id": "e1",
        "type": "order.updated",
        "args": [{"a": "e1", "b": 2}],
        "meta": {"version": 3, "occurred_at": WHEN},
    }
    assert jobs["(no Nats-Msg-Id, seq 3)"]["created"] == 1
    assert body_of({"b": [1, "é"], "a": None}) == '{"a":null,"b":[1,"é"]}'.encode()


async def test_a_stray_message_fails_the_check(stage: NatsStage) -> None:
    """A message under an id the outbox never had fails the check as unexpected."""
    await stage.add_stream()
    await stage.produce(3)
    await stage.relay("relay")
    await stage.scene.drained()
    await stage.check()
    await stage.client.jetstream().publish(
        "events.orders", b"{}", headers={"Nats-Msg-Id": "not-an-event"}
    )
    with pytest.raises(AssertionError, match="unexpected \\(1\\): not-an-event"):
        await stage.check()
    assert all(m.stored_at is not None for m in await read_stream(stage.client, "EVENTS"))
