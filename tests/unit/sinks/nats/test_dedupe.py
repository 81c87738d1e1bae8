"""Dedupe that outlives the duplicate window (docs/nats.md#deduplication): the facts read
from what the server reports, the mode each route runs in, the past-window bound, the
messages a guarded publish sends, and what a "wrong last sequence" answer and the read-back
after it prove (docs/contract.md#c2)."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest

from relayd.core.outcomes import DeadLetter, DeadReason, Published, RetryLater, SinkDown
from relayd.core.retry import retry_horizon_s
from relayd.sinks.nats.answers import (
    classify_ack,
    classify_batch_event,
    classify_marker_reply,
    classify_stored,
    read_facts,
)
from relayd.sinks.nats.dedupe import (
    BATCH_COMMIT,
    BATCH_ID,
    BATCH_SEQ,
    EXPECTED_LAST_SUBJECT_SEQ,
    MarkerFound,
    Mode,
    PastWindow,
    StreamFacts,
    Taken,
    as_pattern,
    atomic_batch,
    expecting_new_subject,
    marker_body,
    mode_for,
    past_window,
    past_window_action,
    past_window_dead_letter,
    stream_facts,
)
from relayd.sinks.nats.message import EXPECTED_STREAM, MSG_ID, NatsMessage

ID = "019539a4-aaaa-7000-8000-111111111111"
BODY = b'{"order_id":42}'
MESSAGE = NatsMessage("events.orders", BODY, {MSG_ID: ID}, "events.orders")
PREFIX = "relayd.markers"


def _reply(value: Any) -> bytes:
    return json.dumps(value).encode()


def _facts(
    level: int = 5,
    *,
    atomic: bool = True,
    subjects: tuple[str, ...] = ("events.>", "relayd.>"),
    version: tuple[int, int, int] | None = (2, 15, 1),
) -> StreamFacts:
    return StreamFacts(
        api_level=level,
        allow_atomic=atomic,
        duplicate_window_s=120.0,
        subjects=subjects,
        version=version,
    )


@pytest.mark.parametrize(
    ("account", "stream", "expected"),
    [
        # nats-server 2.15 with an atomic stream.
        (
            {"api": {"level": 5, "total": 3}},
            {
                "config": {
                    "subjects": ["e.>"],
                    "allow_atomic": True,
                    "duplicate_window": 10**9,
                    "metadata": {"_nats.ver": "2.15.1", "_nats.level": "5"},
                }
            },
            StreamFacts(5, True, 1.0, ("e.>",), (2, 15, 1)),
        ),
        (
            {"api": {"level": 2}},
            {"config": {"metadata": {"_nats.ver": "2.12.0-RC.6"}}},
            StreamFacts(2, False, None, (), (2, 12, 0)),
        ),
        # nats-server 2.9: no API level, no allow_atomic in the echoed config.
        (
            {"api": {"total": 0, "errors": 0}},
            {"config": {"subjects": ["e.>"], "duplicate_window": 120 * 10**9}},
            StreamFacts(0, False, 120.0, ("e.>",)),
        ),
        # Anything of another type counts as not supported.
        (
            {"api": {"level": True}},
            {
                "config": {
                    "subjects": "e.>",
                    "allow_atomic": "true",
                    "duplicate_window": "2m",
                    "metadata": {"_nats.ver": "v2"},
                }
            },
            StreamFacts(0, False, None, ()),
        ),
        ({}, {}, StreamFacts(0, False, None, ())),
    ],
)
def test_facts_come_from_what_the_server_reports(
    account: dict[str, Any], stream: dict[str, Any], expected: StreamFacts
) -> None:
    """The API level and the stream's settings are read from the answers, never assumed:
    an old server that does not report them supports nothing new."""
    assert stream_facts(account, stream) == expected


def test_facts_that_cannot_be_read_are_the_sinks_failure() -> None:
    """No mode is chosen on a guess: without the stream's answer, nothing is sent."""
    missing = _reply({"error": {"code": 404, "err_code": 10059, "description": "not found"}})
    assert read_facts(_reply({"api": {}}), missing, stream_name="EVENTS") == SinkDown(
        "stream EVENTS not found (create it: docs/nats.md#operations)", reached=False
    )
    assert read_facts(SinkDown("no responders"), missing, stream_name="EVENTS") == SinkDown(
        "JetStream does not answer: no responders", reached=False
    )


@pytest.mark.parametrize(
    ("route", "facts", "expected"),
    [
        ("events.orders.{id}", _facts(), Mode.ID_IN_SUBJECT),
        ("events.orders.{id}", _facts(0, atomic=False), Mode.ID_IN_SUBJECT),
        ("events.{id}.created", _facts(0, atomic=False), Mode.ID_IN_SUBJECT),
        ("events.orders", _facts(), Mode.ATOMIC_MARKER),
        ("events.orders", _facts(2), Mode.ATOMIC_MARKER),
        ("events.orders", _facts(2, version=(2, 12, 1)), Mode.ATOMIC_MARKER),
        # 2.12.0 reports level 2 but refuses Nats-Msg-Id inside a batch; no version: no batch.
        ("events.orders", _facts(2, version=(2, 12, 0)), Mode.WINDOW),
        ("events.orders", _facts(5, version=None), Mode.WINDOW),
        # A 2.11 server (level 1), or a server that reports no level (2.9, 2.10).
        ("events.orders", _facts(1), Mode.WINDOW),
        ("events.orders", _facts(0), Mode.WINDOW),
        # The stream does not allow atomic batches, or does not take the markers.
        ("events.orders", _facts(atomic=False), Mode.WINDOW),
        ("events.orders", _facts(subjects=("events.>",)), Mode.WINDOW),
        ("events.orders", _facts(subjects=("events.>", "relayd.markers.*")), Mode.ATOMIC_MARKER),
        # `{id}` is a whole token, not a part of one.
        ("events.orders{id}", _facts(0), Mode.WINDOW),
        # The ordering key in the subject: fenced by the subject's sequence, on any server.
        ("events.orders.{key}", _facts(), Mode.KEY_IN_SUBJECT),
        ("events.orders.{key}", _facts(0, atomic=False), Mode.KEY_IN_SUBJECT),
        ("events.orders{key}", _facts(0), Mode.WINDOW),
    ],
)
def test_each_route_runs_in_the_first_mode_that_applies(
    route: str, facts: StreamFacts, expected: Mode
) -> None:
    """The id in the subject on any server; else atomic markers where the server (API level
    2+, version 2.12.1+) and the stream (allow_atomic, the marker subjects) say so; else
    the window."""
    assert mode_for(route, facts, marker_prefix=PREFIX) is expected


def test_a_route_with_the_id_is_taken_by_a_wildcard() -> None:
    """`relayd check`: a stream takes a route with `{id}` when it takes any token there."""
    assert as_pattern("events.orders.{id}") == "events.orders.*"
    assert as_pattern("events.{key}.orders") == "events.*.orders"
    assert _facts(subjects=("events.orders.*",)).takes(as_pattern("events.orders.{id}"))
    assert not _facts(subjects=("events.orders.x",)).takes(as_pattern("events.orders.{id}"))


@pytest.mark.parametrize(
    ("claimed_before", "age_s", "window_s", "expected"),
    [
        (False, 10_000.0, 120.0, False),  # a first attempt: nothing stored to forget
        (True, 100.0, 120.0, False),  # inside the window, with the margin
        (True, 110.0, 120.0, True),  # the margin (the attempt's deadline) reaches past it
        (True, 2.0, 1.0, True),
        (True, 0.5, None, True),  # no window reported: nothing can be promised
    ],
)
def test_a_row_is_past_the_window_when_its_age_may_exceed_it(
    claimed_before: bool, age_s: float, window_s: float | None, expected: bool
) -> None:
    """The window runs from the first store, no earlier than the row's creation: age plus
    the time until the message leaves bounds how long the stream has held the id."""
    got = past_window(claimed_before=claimed_before, age_s=age_s, window_s=window_s, margin_s=10.0)
    assert got is expected


@pytest.mark.parametrize(
    ("redriven", "setting", "expected"),
    [
        (False, "resend", PastWindow.RESEND),
        (False, "dead_letter", PastWindow.DEAD_LETTER),
        (True, "dead_letter", PastWindow.REDRIVEN),  # the operator looked and decided
        (True, "resend", PastWindow.REDRIVEN),  # counted as the operator's, not the setting's
    ],
)
def test_a_redrive_sends_a_row_past_the_window_whatever_the_setting(
    redriven: bool, setting: str, expected: PastWindow
) -> None:
    """A row redriven since its last attempt is sent; any other follows sink.past_window."""
    assert past_window_action(redriven=redriven, setting=setting) is expected


def test_past_the_window_dead_letters_with_its_own_reason() -> None:
    """`sink.past_window = "dead_letter"`: the reason `past_window`, the age and window named."""
    refused = past_window_dead_letter(130.4, 120.0)
    assert refused.reason is DeadReason.PAST_WINDOW
    assert "130s old, past the stream's duplicate window (120s)" in refused.error


def test_the_retry_horizon_adds_every_backoff_ceiling_and_lease() -> None:
    """From the first attempt to the last: 1+2+4+4 s of backoff (cap 4), 4 leases of 30 s."""
    horizon = retry_horizon_s(base_s=1, cap_s=4, max_attempts=5, lease_s=30, timeout_s=10)
    assert horizon == 11 + 4 * 30
    assert retry_horizon_s(base_s=1, cap_s=4, max_attempts=1, lease_s=30, timeout_s=10) == 0


def test_the_id_in_the_subject_expects_the_subject_empty() -> None:
    """The event itself expects sequence 0 on its own subject; nothing else changes."""
    guarded = expecting_new_subject(MESSAGE)
    assert guarded.headers == {MSG_ID: ID, EXPECTED_LAST_SUBJECT_SEQ: "0"}
    assert (guarded.subject, guarded.body, guarded.route) == (
        MESSAGE.subject,
        BODY,
        MESSAGE.route,
    )


def test_an_atomic_batch_is_the_marker_then_the_event_committing() -> None:
    """The marker first (expecting its subject empty), the event second, committing: the
    PubAck names the event's sequence, and a second batch is refused whole."""
    marker, event = atomic_batch(
        MESSAGE, event_id=ID, stream="EVENTS", marker_prefix=PREFIX, batch_id="b1"
    )
    assert marker.subject == f"relayd.markers.{ID}"
    assert marker.headers == {
        BATCH_ID: "b1",
        BATCH_SEQ: "1",
        EXPECTED_LAST_SUBJECT_SEQ: "0",
        EXPECTED_STREAM: "EVENTS",
    }
    assert json.loads(marker.body) == {
        "subject": "events.orders",
        "sha256": hashlib.sha256(BODY).hexdigest(),
    }
    assert event.headers == {MSG_ID: ID, BATCH_ID: "b1", BATCH_SEQ: "2", BATCH_COMMIT: "1"}
    assert (event.subject, event.body) == (MESSAGE.subject, BODY)


WRONG_LAST = _reply(
    {"error": {"code": 400, "err_code": 10071, "description": "wrong last sequence: 1"}}
)


def test_wrong_last_sequence_means_taken_only_for_a_guarded_publish() -> None:
    """A publish that expected its subject empty learns it is not; any other publish never
    sent an expectation, and is retried."""
    assert classify_ack(WRONG_LAST, stream="EVENTS", subject="s", guarded=True) == Taken(
        "JetStream error 10071: wrong last sequence: 1"
    )
    assert classify_ack(WRONG_LAST, stream="EVENTS", subject="s") == RetryLater(
        "JetStream error 10071: wrong last sequence: 1 (publishing to s): wrong last "
        "sequence (this publish expected none)"
    )


def _msg(data: bytes, seq: int, msg_id: str | None = None) -> bytes:
    headers = "NATS/1.0\r\n" + (f"Nats-Msg-Id: {msg_id}\r\n" if msg_id else "") + "\r\n"
    message = {
        "subject": "x",
        "seq": seq,
        "hdrs": base64.b64encode(headers.encode()).decode(),
        "data": base64.b64encode(data).decode(),
    }
    return _reply({"message": message})


NO_MESSAGE = _reply({"error": {"code": 404, "err_code": 10037, "description": "no message found"}})


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (_msg(marker_body(MESSAGE), 7), MarkerFound(7)),
        (
            _msg(marker_body(NatsMessage("events.orders", b"{}", {})), 7),
            DeadLetter(
                DeadReason.CONFLICT,
                "the stream holds a marker for this id at seq 7 from another event (a "
                "different subject or body)",
            ),
        ),
        (
            NO_MESSAGE,
            RetryLater("reading the event's marker: JetStream error 10037: no message found"),
        ),
        (b"?", RetryLater("reading the event's marker: the reply is not a JetStream answer")),
        (
            _reply({"error": {"code": 503, "err_code": 10008, "description": "unavailable"}}),
            SinkDown("reading the event's marker: JetStream error 10008: unavailable"),
        ),
    ],
)
def test_a_marker_proves_its_batch_only_if_it_is_this_events(
    reply: bytes, expected: object
) -> None:
    """C2: the marker names its event's subject and body digest; a marker of another event
    under the same id is a conflict."""
    assert classify_marker_reply(reply, message=MESSAGE) == expected


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (_msg(BODY, 8, ID), Published("stored", reconciled=True)),
        # Removed since by the stream's limits: the atomic batch stored it with its marker.
        (NO_MESSAGE, Published("stored", reconciled=True)),
        (
            _msg(b"{}", 8, ID),
            DeadLetter(
                DeadReason.CONFLICT,
                "the stream holds a different message under this id at seq 8 (body of 2 "
                "bytes, ours 15)",
            ),
        ),
    ],
)
def test_the_event_after_its_marker_is_read_back(reply: bytes, expected: object) -> None:
    """C2: the batch put the event right after its marker; what is there is compared."""
    assert classify_batch_event(reply, marker_seq=7, body=BODY, event_id=ID) == expected


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (_msg(BODY, 3, ID), Published("stored", reconciled=True)),
        (
            _msg(b'{"order_id":1}', 3, "another"),
            DeadLetter(
                DeadReason.CONFLICT,
                "the stream holds a different message under this id at seq 3 (Nats-Msg-Id "
                "another; body of 14 bytes, ours 15)",
            ),
        ),
        (
            NO_MESSAGE,
            RetryLater(
                "reading the event's subject: JetStream error 10037: no message found: the "
                "subject holds nothing now (removed since the refusal)"
            ),
        ),
    ],
)
def test_the_events_own_subject_is_read_back(reply: bytes, expected: object) -> None:
    """C2: with the id in the subject, the last message there is ours or a conflict."""
    assert classify_stored(reply, seq=None, body=BODY, event_id=ID) == expected
