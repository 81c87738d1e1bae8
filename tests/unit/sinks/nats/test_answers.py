"""The NATS answer -> outcome tables (docs/nats.md#outcomes): the reply to a JetStream
publish, the message read back after a duplicate (docs/contract.md#c2), the client's
exceptions, and `relayd check`'s verdict on the stream (a connection's failures:
test_link.py)."""

from __future__ import annotations

import base64
import json
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from relayd.core.outcomes import DeadLetter, DeadReason, Published, RetryLater, SinkDown
from relayd.sinks.nats.answers import (
    ApiError,
    Duplicate,
    InboxRefused,
    LastOnSubject,
    PublishRefused,
    acked_seq,
    classify_ack,
    classify_api_error,
    classify_exception,
    classify_last_on_subject,
    classify_stored,
    publish_refused,
    reply_code,
    stream_verdict,
    subscribe_refused,
)
from relayd.sinks.nats.dedupe import subject_matches
from relayd.sinks.nats.link import Link

ID = "019539a4-aaaa-7000-8000-111111111111"
SUBJECT = "events.orders"
BODY = b'{"order_id":42}'
# The connection as the sink sees it while NATS is down: where it was, what the client met.
LINK = Link("127.0.0.1:4222", "connection refused")


def _reply(value: Any) -> bytes:
    return json.dumps(value).encode()


def _error(code: int, err_code: int, description: str = "d") -> bytes:
    return _reply({"error": {"code": code, "err_code": err_code, "description": description}})


NOT_A_PUBACK = RetryLater("the reply on events.orders is not a JetStream PubAck")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (_reply({"stream": "EVENTS", "seq": 7}), Published("stored")),
        (_reply({"stream": "EVENTS", "seq": 7, "domain": "hub"}), Published("stored")),
        (_reply({"stream": "EVENTS", "seq": 7, "duplicate": True}), Duplicate(7)),
        (_reply({"stream": "EVENTS", "seq": 7, "duplicate": False}), Published("stored")),
        # Not a PubAck: a plain subscriber answered on the subject; nothing proves a store.
        (b"pong", NOT_A_PUBACK),
        (b"", NOT_A_PUBACK),
        (_reply([1, 2]), NOT_A_PUBACK),
        (_reply({"stream": "EVENTS"}), NOT_A_PUBACK),
        (_reply({"stream": "EVENTS", "seq": 0}), NOT_A_PUBACK),
        (_reply({"stream": "EVENTS", "seq": True}), NOT_A_PUBACK),
        (_reply({"seq": 3}), NOT_A_PUBACK),
        (
            _reply({"stream": "OTHER", "seq": 3}),
            RetryLater("stream 'OTHER' acknowledged the message, not sink.stream 'EVENTS'"),
        ),
        (
            _error(400, 10060, "expected stream does not match"),
            SinkDown(
                "JetStream error 10060: expected stream does not match (publishing to "
                "events.orders): the subject is stored by another stream than sink.stream "
                "(check sink.routes and the streams' subjects)",
                reached=False,
                severe=True,
            ),
        ),
        (
            _error(400, 10054, "message size exceeds maximum allowed"),
            DeadLetter(
                DeadReason.SINK_TOO_LARGE,
                "JetStream error 10054: message size exceeds maximum allowed (publishing to "
                "events.orders): the message exceeds the stream's max_msg_size",
            ),
        ),
    ],
)
def test_classify_ack(reply: bytes, expected: object) -> None:
    """A PubAck is published, a duplicate's asks for a read-back; anything else is never
    taken as a store."""
    assert classify_ack(reply, stream="EVENTS", subject=SUBJECT) == expected


@pytest.mark.parametrize(
    ("code", "err_code", "kind", "severe_or_reason"),
    [
        # The subject is another stream's, the stream is sealed, JetStream is off: an
        # operator must act; every row would fail alike.
        (400, 10060, SinkDown, True),
        (400, 10109, SinkDown, True),
        (503, 10039, SinkDown, True),
        (503, 10076, SinkDown, True),
        # The server is short of something: sink-wide, for the breaker.
        (503, 10008, SinkDown, False),
        (500, 10047, SinkDown, False),
        (500, 10053, SinkDown, False),
        (503, 10077, SinkDown, False),
        (429, 10167, SinkDown, False),
        # The row's own size or headers: dead-lettered.
        (400, 10054, DeadLetter, DeadReason.SINK_TOO_LARGE),
        (400, 10097, DeadLetter, DeadReason.SINK_REJECTED),
        # Neither the row's nor the sink's fault: retried.
        (409, 10158, RetryLater, None),
        (400, 10071, RetryLater, None),
        (400, 10164, RetryLater, None),
        (400, 10070, RetryLater, None),
        # Atomic batches: disabled since the facts were read, incomplete, a header refused
        # (2.12.0 and Nats-Msg-Id), an id the window holds (the sink sends the event alone).
        (400, 10174, RetryLater, None),
        (400, 10176, RetryLater, None),
        (400, 10177, RetryLater, None),
        (400, 10201, RetryLater, None),
        (429, 10210, SinkDown, False),
        # Codes relayd does not know: by their HTTP-like code, never dead-lettered.
        (503, 19999, SinkDown, False),
        (500, 19999, SinkDown, False),
        (400, 19999, RetryLater, None),
        (404, 19999, RetryLater, None),
    ],
)
def test_api_errors_are_classified_by_code(
    code: int, err_code: int, kind: type, severe_or_reason: object
) -> None:
    """Each JetStream API error names its code and description, and lands where its cause
    belongs: the row, the sink, or neither."""
    outcome = classify_api_error(ApiError(code, err_code, "what the server said"), subject=SUBJECT)
    assert isinstance(outcome, kind)
    assert f"JetStream error {err_code}: what the server said (publishing to {SUBJECT})" in (
        outcome.error  # type: ignore[union-attr]
    )
    if isinstance(outcome, SinkDown):
        assert outcome.severe is severe_or_reason
        assert outcome.reached is not outcome.severe
    if isinstance(outcome, DeadLetter):
        assert outcome.reason is severe_or_reason


def test_an_error_without_an_err_code_is_named_by_its_code() -> None:
    assert classify_api_error(ApiError(503, None, ""), subject=SUBJECT) == SinkDown(
        "JetStream error code 503: no description (publishing to events.orders)"
    )
    assert classify_ack(_reply({"error": "x"}), stream="EVENTS", subject=SUBJECT) == (
        RetryLater("JetStream error code None: x (publishing to events.orders)")
    )


def _stored(
    body: bytes = BODY, msg_id: str | None = ID, extra: dict[str, str] | None = None
) -> bytes:
    lines = "NATS/1.0\r\n"
    if msg_id is not None:
        lines += f"Nats-Msg-Id: {msg_id}\r\n"
    lines += "".join(f"{name}: {value}\r\n" for name, value in (extra or {}).items())
    lines += "\r\n"
    message = {
        "subject": SUBJECT,
        "seq": 7,
        "hdrs": base64.b64encode(lines.encode()).decode(),
        "data": base64.b64encode(body).decode(),
        "time": "2024-05-01T12:00:00Z",
    }
    return _reply({"type": "io.nats.jetstream.api.v1.stream_msg_get_response", "message": message})


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (_stored(), Published("stored", reconciled=True)),
        (_stored(extra={"ce-type": "order.updated"}), Published("stored", reconciled=True)),
        (
            _stored(body=b'{"order_id":43}'),
            DeadLetter(
                DeadReason.CONFLICT,
                "the stream holds a different message under this id at seq 7 (body of 15 "
                "bytes, ours 15)",
            ),
        ),
        (
            _stored(msg_id="another"),
            DeadLetter(
                DeadReason.CONFLICT,
                "the stream holds a different message under this id at seq 7 (Nats-Msg-Id another)",
            ),
        ),
        (
            _stored(body=b"", msg_id=None),
            DeadLetter(
                DeadReason.CONFLICT,
                "the stream holds a different message under this id at seq 7 "
                "(Nats-Msg-Id missing; body of 0 bytes, ours 15)",
            ),
        ),
        (
            _error(404, 10037, "no message found"),
            RetryLater(
                "reading back seq 7: JetStream error 10037: no message found: the stream "
                "acknowledged a duplicate it no longer holds"
            ),
        ),
        (
            _error(503, 10008, "JetStream system temporarily unavailable"),
            SinkDown(
                "reading back seq 7: JetStream error 10008: JetStream system temporarily "
                "unavailable"
            ),
        ),
        (b"?", RetryLater("reading back seq 7: the reply is not a JetStream answer")),
        (_reply({"type": "x"}), RetryLater("reading back seq 7: the reply holds no message")),
        (
            _reply({"message": {"data": "***", "hdrs": ""}}),
            RetryLater("reading back seq 7: the message's data or headers are not base64"),
        ),
    ],
)
def test_a_duplicate_is_published_only_if_the_stream_holds_our_message(
    reply: bytes, expected: object
) -> None:
    """C2: the stream's dedupe compares ids, not bytes; relayd compares the body and the
    id header of what it holds: ours is published as reconciled, another is a conflict."""
    assert classify_stored(reply, seq=7, body=BODY, event_id=ID) == expected


def test_header_names_match_whatever_their_case() -> None:
    reply = _stored(msg_id=None, extra={"nats-msg-id": ID})
    assert classify_stored(reply, seq=7, body=BODY, event_id=ID) == Published(
        "stored", reconciled=True
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            nats.errors.NoRespondersError(),
            SinkDown(
                "no responders on events.orders: no stream stores it, or JetStream is not "
                "ready (check the stream and its subjects against sink.routes)",
                reached=False,
            ),
        ),
        (nats.js.errors.NoStreamResponseError(), "no responders"),
        (
            nats.errors.TimeoutError(),
            SinkDown("no PubAck for events.orders from 127.0.0.1:4222 in time: it may be stored"),
        ),
        (
            nats.errors.OutboundBufferLimitError(),
            SinkDown(
                "not connected to NATS at 127.0.0.1:4222 (reconnecting: connection refused); "
                "nothing was sent",
                reached=False,
            ),
        ),
        (nats.errors.ConnectionClosedError(), "not connected"),
        (nats.errors.ConnectionReconnectingError(), "not connected"),
        (nats.errors.StaleConnectionError(), "not connected"),
        (
            nats.errors.MaxPayloadError(),
            DeadLetter(
                DeadReason.SINK_TOO_LARGE,
                "the message exceeds the server's max_payload; not sent",
            ),
        ),
        (
            nats.errors.BadHeaderError("x"),
            SinkDown(
                "the client refused the message (BadHeaderError; check sink.routes)",
                reached=False,
                severe=True,
            ),
        ),
        (nats.errors.Error("secret"), SinkDown("NATS client error: Error", reached=False)),
    ],
)
def test_transport_failures_say_whether_the_message_left(exc: Exception, expected: object) -> None:
    """Only a timeout after sending is ambiguous (reached); every other client failure
    comes before the message is handed over, so nothing can be stored."""
    outcome = classify_exception(exc, subject=SUBJECT, link=LINK)
    if isinstance(expected, str):
        assert isinstance(outcome, SinkDown)
        assert outcome.error.startswith(expected)
        assert not outcome.reached
    else:
        assert outcome == expected


def test_a_publish_refused_for_lack_of_permission_is_severe() -> None:
    """The server drops a publish its user may not make, unanswered, and says so on the
    side (ReplyInbox.refuse): the outcome names the permission, and is severe (an operator
    must grant it); it stays counted as reached (the refusal names a subject, not this
    message)."""
    assert classify_exception(PublishRefused(SUBJECT), subject=SUBJECT, link=LINK) == SinkDown(
        "the server refuses publishes to events.orders (permissions violation): grant "
        "relayd's NATS user publish permission on it (docs/nats.md#operations)",
        severe=True,
    )


@pytest.mark.parametrize("sent", [True, False])
def test_a_refused_reply_subscription_is_severe(sent: bool) -> None:
    """The server refused the subscription replies come on: no answer can reach relayd.
    Severe (an operator must grant it); reached only for a message written before the
    refusal was known (it may be stored, unanswered)."""
    inbox = "_INBOX.abc.*"
    assert classify_exception(
        InboxRefused(inbox, sent=sent), subject=SUBJECT, link=LINK
    ) == SinkDown(
        "the server refuses relayd's subscription to its replies (_INBOX.abc.*; permissions "
        "violation), so no answer can reach it: grant relayd's NATS user subscribe "
        "permission on _INBOX.> (docs/nats.md#operations)",
        reached=sent,
        severe=True,
    )


@pytest.mark.parametrize(
    ("exc", "subject"),
    [
        # nats-py lowercases the server's line.
        (
            nats.errors.Error('nats: permissions violation for subscription to "_inbox.x.*"'),
            "_inbox.x.*",
        ),
        (nats.errors.Error('nats: Permissions Violation for Subscription to "a.b"'), "a.b"),
        (nats.errors.Error('nats: Permissions Violation for Publish to "events.orders"'), None),
        (nats.errors.TimeoutError(), None),
        (ValueError('Permissions Violation for Subscription to "_INBOX.x.*"'), None),
    ],
)
def test_subscribe_refused_reads_the_subject_of_the_servers_refusal(
    exc: Exception, subject: str | None
) -> None:
    assert subscribe_refused(exc) == subject


@pytest.mark.parametrize(
    ("exc", "subject"),
    [
        (
            nats.errors.Error('nats: Permissions Violation for Publish to "events.orders"'),
            "events.orders",
        ),
        (
            nats.errors.Error('nats: permissions violation for publish to "events.o.1"'),
            "events.o.1",
        ),
        # Other refusals, and the same words in another error type, name no publish.
        (nats.errors.Error('nats: Permissions Violation for Subscription to "_INBOX.x"'), None),
        (nats.errors.Error('nats: Permissions Violation for Publish with Reply of "_R"'), None),
        (nats.errors.Error("nats: 'Authorization Violation'"), None),
        (nats.errors.TimeoutError(), None),
        (ValueError('Permissions Violation for Publish to "events.orders"'), None),
    ],
)
def test_publish_refused_reads_the_subject_of_the_servers_refusal(
    exc: Exception, subject: str | None
) -> None:
    assert publish_refused(exc) == subject


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (_reply({"stream": "EVENTS", "seq": 1}), "ok"),
        (_error(400, 10060), "10060"),
        (_reply({"error": {"code": 503}}), "503"),
        (b"pong", "invalid"),
    ],
)
def test_reply_codes_are_bounded(reply: bytes, code: str) -> None:
    """`relayd_sink_requests_total{code}`: ok, a JetStream error code, or invalid."""
    assert reply_code(reply) == code


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("events.orders", "events.orders", True),
        ("events.*", "events.orders", True),
        ("events.*", "events.orders.v2", False),
        ("events.>", "events.orders.v2", True),
        ("events.>", "events", False),
        (">", "events", True),
        ("events.orders", "events", False),
        ("*.orders", "events.orders", True),
        ("events.>.x", "events.a.x", False),
    ],
)
def test_stream_subjects_take_route_subjects(pattern: str, subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


ACCOUNT = _reply({"api": {"level": 5}, "streams": 1})


def _stream_info(subjects: list[str], window_ns: int = 120_000_000_000) -> bytes:
    return _reply(
        {"config": {"name": "EVENTS", "subjects": subjects, "duplicate_window": window_ns}}
    )


@pytest.mark.parametrize(
    ("account", "stream", "max_body", "expected"),  # routes: events.orders (and .mail)
    [
        (
            ACCOUNT,
            _stream_info(["events.>"]),
            1024,
            (
                True,
                "JetStream answers (API level 5); stream EVENTS takes every route's subject; "
                "duplicate window 120s, retry horizon 300s (window-mode routes: an unanswered "
                "attempt retried past the window is handled by sink.past_window = resend); "
                "max_payload 1048576; modes: events.mail window, events.orders window "
                "(atomic markers need the stream's allow_atomic and its subject "
                "relayd.markers.*)",
            ),
        ),
        (
            ACCOUNT,
            _stream_info(["events.orders"]),
            1024,
            (
                False,
                "stream EVENTS does not take events.mail (its subjects: events.orders; check "
                "sink.routes)",
            ),
        ),
        (
            ACCOUNT,
            _error(404, 10059, "stream not found"),
            1024,
            (False, "stream EVENTS not found (create it: docs/nats.md#operations)"),
        ),
        (
            _error(503, 10039, "JetStream not enabled for account"),
            _error(503, 10039, "JetStream not enabled for account"),
            1024,
            (False, "JetStream refuses: JetStream error 10039: JetStream not enabled for account"),
        ),
        (
            SinkDown("no responders on $JS.API.INFO", reached=False),
            SinkDown("no responders", reached=False),
            1024,
            (False, "JetStream does not answer: no responders on $JS.API.INFO"),
        ),
        (
            _reply({"streams": 1}),
            _stream_info(["events.>"], window_ns=2_000_000_000),
            2 * 1024 * 1024,
            (
                False,
                "sink.max_payload_bytes (2097152) is above the server's max_payload (1048576)",
            ),
        ),
    ],
)
def test_check_reports_the_stream_against_the_routes(
    account: bytes | SinkDown, stream: bytes | SinkDown, max_body: int, expected: object
) -> None:
    """`relayd check`: JetStream answers, the stream exists and takes every route's subject,
    the payload bound fits; the duplicate window is shown."""
    assert (
        stream_verdict(
            account,
            stream,
            stream_name="EVENTS",
            routes=["events.mail", "events.orders"],
            max_payload=1024 * 1024,
            max_body_bytes=max_body,
            marker_prefix="relayd.markers",
            horizon_s=300.0,
            past_window="resend",
        )
        == expected
    )


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        # An empty subject: the key's first event expects sequence 0.
        (_error(404, 10037, "no message found"), LastOnSubject(0)),
        # Another event of the key: its sequence.
        (_stored(msg_id="another"), LastOnSubject(7)),
        (_stored(body=b"{}", msg_id="another"), LastOnSubject(7)),
        # The event itself, stored by an earlier attempt: published; or a conflict.
        (_stored(), LastOnSubject(7, Published("stored", reconciled=True))),
        (
            _stored(body=b'{"order_id":43}'),
            LastOnSubject(
                7,
                DeadLetter(
                    DeadReason.CONFLICT,
                    "the stream holds a different message under this id at seq 7 (body of 15 "
                    "bytes, ours 15)",
                ),
            ),
        ),
        (
            _error(503, 10008, "unavailable"),
            SinkDown("reading the ordering key's subject: JetStream error 10008: unavailable"),
        ),
        (
            _error(400, 10003, "bad request"),
            RetryLater("reading the ordering key's subject: JetStream error 10003: bad request"),
        ),
        (
            b"not json",
            RetryLater("reading the ordering key's subject: the reply is not a JetStream answer"),
        ),
        (
            _reply({"message": {"seq": 0, "hdrs": ""}}),
            RetryLater("reading the ordering key's subject: the reply holds no message"),
        ),
    ],
)
def test_the_last_message_on_a_keys_subject(reply: bytes, expected: object) -> None:
    """What a `last_by_subj` read of a key's subject says before a fenced publish or after
    its refusal: the sequence to expect, or the event itself, or why it is unknown."""
    assert classify_last_on_subject(reply, body=BODY, event_id=ID) == expected


@pytest.mark.parametrize(
    ("reply", "seq"),
    [
        (_reply({"stream": "EVENTS", "seq": 12}), 12),
        (_reply({"stream": "EVENTS", "seq": 0}), None),
        (_reply({"stream": "EVENTS", "seq": True}), None),
        (_reply({"error": {"code": 400}}), None),
        (b"[]", None),
    ],
)
def test_the_sequence_a_puback_names(reply: bytes, seq: int | None) -> None:
    assert acked_seq(reply) == seq
