"""What the NATS sink sends for a row (docs/nats.md#the-message): a domain event read from
the envelope or refused precisely, its route, a body that is the same bytes on every
attempt, and the dedupe id and CloudEvents attributes as headers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from relayd.core.envelope import (
    META_OCCURRED_AT,
    META_VERSION,
    DomainEvent,
    Envelope,
    InvalidEnvelope,
)
from relayd.core.outcomes import DeadLetter, DeadReason
from relayd.sinks.nats.message import (
    NatsMessage,
    Route,
    Routes,
    header_block,
    header_block_size,
    message_for,
    parse_header_block,
    percent_encoded,
)

ID = "019539a4-aaaa-7000-8000-111111111111"
WHEN = "2024-05-01T12:00:00Z"
ROUTES = Routes(
    [
        Route("order.updated", "events.orders"),
        Route("order.updated", "events.orders.v2", version=2),
        Route("mail.sent", "events.mail", version=1),
    ]
)


def _envelope(args: Any = None, meta: Any = None, *, text: str | None = None) -> Envelope:
    job = {
        "id": ID,
        "type": "order.updated",
        "args": [{"order_id": 42}] if args is None else args,
        "meta": {META_VERSION: 1, META_OCCURRED_AT: WHEN} if meta is None else meta,
    }
    return Envelope.parse(text if text is not None else json.dumps(job), ID)


def _message(envelope: Envelope, max_body_bytes: int = 1024) -> NatsMessage | DeadLetter:
    return message_for(
        envelope, ROUTES, stream="EVENTS", source="/orders", max_body_bytes=max_body_bytes
    )


def test_the_meta_keys_have_stable_names() -> None:
    """The producer's typed helpers write these keys (one place to import them from)."""
    assert (META_VERSION, META_OCCURRED_AT) == ("version", "occurred_at")


@pytest.mark.parametrize(
    ("args", "meta", "error"),
    [
        ([], None, "args must hold exactly one element, the event's data (it holds 0)"),
        ([1, 2], None, "args must hold exactly one element, the event's data (it holds 2)"),
        (None, {META_OCCURRED_AT: WHEN}, "meta.version is missing (the event's schema version)"),
        (
            None,
            {META_VERSION: 0, META_OCCURRED_AT: WHEN},
            "meta.version must be an integer from 1 to 2147483647, not 0",
        ),
        (
            None,
            {META_VERSION: True, META_OCCURRED_AT: WHEN},
            "meta.version must be an integer from 1 to 2147483647, not True",
        ),
        (
            None,
            {META_VERSION: "1", META_OCCURRED_AT: WHEN},
            "meta.version must be an integer from 1 to 2147483647, not '1'",
        ),
        (
            None,
            {META_VERSION: 1.0, META_OCCURRED_AT: WHEN},
            "meta.version must be an integer from 1 to 2147483647, not 1.0",
        ),
        (None, {META_VERSION: 1}, "meta.occurred_at is missing (when the event occurred)"),
        *(
            (
                None,
                {META_VERSION: 1, META_OCCURRED_AT: value},
                "meta.occurred_at must be an RFC 3339 date-time with an offset, such as "
                f"2024-05-01T12:00:00Z, not {value!r}",
            )
            for value in (
                "2024-05-01",
                "2024-05-01T12:00:00",  # no offset
                "2024-05-01 12:00:00Z",
                "2024-13-01T12:00:00Z",
                "2024-05-01T25:00:00Z",
                "2024-05-01T12:00:00.1234567890Z",
                1714564800,
            )
        ),
    ],
)
def test_an_envelope_that_is_not_an_event_says_why(args: Any, meta: Any, error: str) -> None:
    with pytest.raises(InvalidEnvelope) as refused:
        DomainEvent.of(_envelope(args, meta))
    assert str(refused.value) == error
    assert _message(_envelope(args, meta)) == DeadLetter(DeadReason.INVALID_ENVELOPE, error)


@pytest.mark.parametrize(
    "when", [WHEN, "2024-05-01T12:00:00.5Z", "2024-05-01T14:00:00.123456789+02:00"]
)
def test_occurrence_times_in_rfc_3339(when: str) -> None:
    event = DomainEvent.of(_envelope(meta={META_VERSION: 3, META_OCCURRED_AT: when}))
    assert (event.version, event.occurred_at) == (3, when)


def test_the_message_carries_the_id_and_the_cloudevents_attributes() -> None:
    """Nats-Msg-Id and Message-Id are the event id; the CloudEvents binary-mode headers say
    what the event is; the stream is the expected one."""
    message = _message(_envelope())
    assert isinstance(message, NatsMessage)
    assert message.subject == "events.orders"
    assert message.body == b'{"order_id":42}'
    assert message.headers == {
        "Nats-Msg-Id": ID,
        "Message-Id": ID,
        "Nats-Expected-Stream": "EVENTS",
        "ce-specversion": "1.0",
        "ce-id": ID,
        "ce-type": "order.updated",
        "ce-source": "/orders",
        "ce-time": WHEN,
        "ce-dataversion": "1",
        "ce-datacontenttype": "application/json",
        "Content-Type": "application/json",
    }
    assert message.size == len(message.body) + len(header_block(message.headers))


def test_the_body_is_the_same_bytes_whatever_the_stored_text() -> None:
    """Key order, spacing and number spelling of the stored envelope do not change the
    body: a re-sent event is byte for byte its first send (docs/contract.md#c2)."""
    meta = f'"meta": {{"occurred_at": "{WHEN}", "version": 1}}'
    texts = [
        f'{{"id": "{ID}", "type": "order.updated", "args": [{{"b": [1, 2.5], "a": "é"}}], {meta}}}',
        f'{{"args":[{{"a":"\\u00e9","b":[1,2.5]}}],"type":"order.updated","id":"{ID}",{meta}}}',
    ]
    bodies = {_message(_envelope(text=text)).body for text in texts}  # type: ignore[union-attr]
    assert bodies == {'{"a":"é","b":[1,2.5]}'.encode()}


def test_integers_of_any_length_keep_their_digits() -> None:
    digits = "1" + "0" * 5000
    text = (
        f'{{"id": "{ID}", "type": "order.updated", "args": [{{"n": {digits}}}], '
        f'"meta": {{"version": 1, "occurred_at": "{WHEN}"}}}}'
    )
    message = _message(_envelope(text=text), max_body_bytes=10_000)
    assert isinstance(message, NatsMessage)
    assert message.body == f'{{"n":{digits}}}'.encode()


@pytest.mark.parametrize(
    ("event_type", "version", "subject"),
    [
        ("order.updated", 1, "events.orders"),
        ("order.updated", 2, "events.orders.v2"),  # the version's own route wins
        ("order.updated", 9, "events.orders"),
        ("mail.sent", 1, "events.mail"),
    ],
)
def test_routes_by_type_and_version(event_type: str, version: int, subject: str) -> None:
    assert ROUTES.subject(event_type, version) == subject


def test_a_subject_template_carries_the_event_id() -> None:
    """`{id}` as a whole token of a route's subject is the event id; the message keeps the
    route as configured (it decides the dedupe mode)."""
    routes = Routes([Route("order.updated", "events.{id}.orders.{id}")])
    message = message_for(
        _envelope(), routes, stream="EVENTS", source="/orders", max_body_bytes=1024
    )
    assert isinstance(message, NatsMessage)
    assert message.subject == f"events.{ID}.orders.{ID}"
    assert message.route == "events.{id}.orders.{id}"


@pytest.mark.parametrize(
    ("key", "subject", "error"),
    [
        ("order-42", "events.orders.order-42", None),
        (
            "Ä",
            None,
            "the ordering key 'Ä' cannot stand for {key} in the subject events.orders.{key}",
        ),
        ("a.b", None, "the ordering key 'a.b' cannot stand"),
        ("a b", None, "the ordering key 'a b' cannot stand"),
        ("*", None, "the ordering key '*' cannot stand"),
        (">", None, "the ordering key '>' cannot stand"),
        (None, None, "the route's subject events.orders.{key} holds {key} and the row has no"),
    ],
)
def test_a_subject_template_carries_the_ordering_key(
    key: str | None, subject: str | None, error: str | None
) -> None:
    """`{key}` is the row's ordering key, which must be one subject token; a row whose key
    cannot be one (or that has none) is dead-lettered `invalid_envelope`, never sent."""
    routes = Routes([Route("order.updated", "events.orders.{key}")])
    message = message_for(
        _envelope(), routes, stream="EVENTS", source="/orders", max_body_bytes=1024, key=key
    )
    if subject is not None:
        assert isinstance(message, NatsMessage)
        assert (message.subject, message.route) == (subject, "events.orders.{key}")
    else:
        assert isinstance(message, DeadLetter)
        assert message.reason is DeadReason.INVALID_ENVELOPE
        assert error is not None
        assert message.error.startswith(error)


def test_an_event_without_a_route_is_dead_lettered_no_route() -> None:
    text = json.dumps(
        {
            "id": ID,
            "type": "mail.sent",
            "args": [{}],
            "meta": {META_VERSION: 2, META_OCCURRED_AT: WHEN},
        }
    )
    assert _message(_envelope(text=text)) == DeadLetter(
        DeadReason.NO_ROUTE, "no route for type 'mail.sent' version 2 (sink.routes)"
    )


def test_a_body_over_the_bound_is_too_large_unsent() -> None:
    message = _message(_envelope([{"x": "a" * 100}]), max_body_bytes=50)
    assert message == DeadLetter(
        DeadReason.TOO_LARGE,
        "the event's data is 108 bytes as JSON, over sink.max_payload_bytes (50)",
    )


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        ("/orders", "/orders"),
        ("urn:example:orders?x=1", "urn:example:orders?x=1"),
        ("my service", "my%20service"),
        ('say "hi"', "say%20%22hi%22"),
        ("100%", "100%25"),
        ("Euro € 😀", "Euro%20%E2%82%AC%20%F0%9F%98%80"),
        ("tab\there", "tab%09here"),
    ],
)
def test_header_values_are_percent_encoded_as_the_binding_says(value: str, encoded: str) -> None:
    """CloudEvents NATS binding 3.1.3.2: space, '"', '%' and anything outside visible ASCII,
    as UTF-8 bytes in upper-case %XY."""
    assert percent_encoded(value) == encoded


def test_a_stored_header_block_is_read_back() -> None:
    raw = header_block({"Nats-Msg-Id": ID, "ce-type": "a.b"}) + b""
    assert parse_header_block(raw) == {"Nats-Msg-Id": [ID], "ce-type": ["a.b"]}
    assert parse_header_block(b"NATS/1.0\r\nA: 1\r\nA: 2\r\nnot a header\r\n\r\n") == {
        "A": ["1", "2"]
    }
    assert parse_header_block(b"HTTP/1.1 200\r\n\r\n") == {}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Nats-Msg-Id": ID},
        {"Nats-Msg-Id": ID, "ce-type": "order.updated", "ce-source": "/orders"},
        {"ce-source": "caf\u00e9 \u2603"},  # non-ASCII: counted in UTF-8 bytes
        {"\u00fcber": "\U0001f600", "x": ""},
    ],
)
def test_the_header_block_size_is_the_length_of_the_block(headers: dict[str, str]) -> None:
    """A message's size counts its header block's bytes as the client writes them."""
    assert header_block_size(headers) == len(header_block(headers))
