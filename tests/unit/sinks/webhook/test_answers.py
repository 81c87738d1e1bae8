"""What the webhook sink sends for a row and what each answer means, as tables: the body built
once, the id and the traceparent as headers, 2xx, 410, slow-downs, the row's 4xx and the
endpoint's failures."""

from __future__ import annotations

import json
from typing import Any

import pytest

from relayd.core.envelope import Envelope
from relayd.core.outcomes import DeadLetter, DeadReason, Published, SinkDown
from relayd.core.trace_context import valid_traceparent
from relayd.sinks.http.answers import Response
from relayd.sinks.webhook.answers import (
    DELIVERED,
    MAX_SLOW_S,
    Delivery,
    Gone,
    SlowDown,
    classify,
    delivery_for,
    event_time,
    slow_delay_s,
)

V7_ID = "0190a8f2-5c5e-7e4a-9d6b-6f1d8c3b2a10"  # 2024-07-12T21:56:14.046Z
V4_ID = "9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2d"
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _envelope(
    args: list[Any] | None = None, meta: dict[str, Any] | None = None, event_id: str = V7_ID
) -> Envelope:
    job: dict[str, Any] = {
        "id": event_id,
        "type": "order.paid",
        "args": [{"n": 1}] if args is None else args,
    }
    if meta is not None:
        job["meta"] = meta
    return Envelope.parse(json.dumps(job), event_id)


def test_the_body_is_type_timestamp_and_data_the_same_bytes_every_time() -> None:
    """Built from the stored envelope, keys sorted: no attempt changes a byte."""
    meta = {"occurred_at": "2024-05-01T12:00:00+02:00", "b": 1}
    first = delivery_for(_envelope(meta=meta), url="https://x/", routes={})
    again = delivery_for(
        Envelope.parse(
            '{"meta": {"b": 1, "occurred_at": "2024-05-01T12:00:00+02:00"}, "args": [{"n": 1}],'
            f' "type": "order.paid", "id": "{V7_ID}"}}',
            V7_ID,
        ),
        url="https://x/",
        routes={},
    )
    assert isinstance(first, Delivery)
    assert isinstance(again, Delivery)
    assert first.body == again.body
    assert first.body == (
        b'{"data":{"n":1},"timestamp":"2024-05-01T12:00:00+02:00","type":"order.paid"}'
    )
    assert first.headers == {"webhook-id": V7_ID, "Content-Type": "application/json"}


@pytest.mark.parametrize(
    ("meta", "event_id", "timestamp"),
    [
        ({"occurred_at": "2024-05-01T12:00:00Z"}, V4_ID, "2024-05-01T12:00:00Z"),
        ({}, V7_ID, "2024-07-12T21:56:14.046Z"),  # from the UUIDv7's milliseconds
        ({}, V4_ID, None),  # nothing stable to say
        ({"occurred_at": "yesterday"}, V7_ID, None),  # stated, but not a time
    ],
)
def test_the_timestamp_is_when_the_event_occurred(
    meta: dict[str, Any], event_id: str, timestamp: str | None
) -> None:
    """meta.occurred_at, else the UUIDv7's time; never the attempt's."""
    assert event_time(_envelope(meta=meta, event_id=event_id)) == timestamp


@pytest.mark.parametrize(
    ("envelope", "routes", "url", "expected"),
    [
        (_envelope(), {}, "https://x/", ("https://x/", ("*", "*"))),
        (
            _envelope(),
            {"order.paid": "https://p/"},
            "https://x/",
            ("https://p/", ("*", "order.paid")),
        ),
        (_envelope(), {"other": "https://o/"}, "https://x/", ("https://x/", ("*", "order.paid"))),
        (_envelope(), {"other": "https://o/"}, None, DeadReason.NO_ROUTE),
        (_envelope(args=[1, 2]), {}, "https://x/", DeadReason.INVALID_ENVELOPE),
        (_envelope(event_id=V4_ID), {}, "https://x/", DeadReason.INVALID_ENVELOPE),
    ],
)
def test_the_endpoint_and_what_its_410_pauses(
    envelope: Envelope, routes: dict[str, str], url: str | None, expected: object
) -> None:
    """A routed type goes to its route and a 410 pauses that type; the lone URL's pauses all."""
    delivery = delivery_for(envelope, url=url, routes=routes)
    if isinstance(expected, DeadReason):
        assert isinstance(delivery, DeadLetter)
        assert delivery.reason is expected
    else:
        assert isinstance(delivery, Delivery)
        assert (delivery.url, delivery.pause) == expected


@pytest.mark.parametrize(
    ("value", "sent"),
    [
        (TRACE, True),
        (TRACE + "\r\nX-Evil: 1", False),
        (TRACE.upper(), False),
        ("ff" + TRACE[2:], False),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", False),
        (TRACE[:-1], False),
        (42, False),
        (None, False),
    ],
)
def test_only_a_valid_traceparent_becomes_a_header(value: object, sent: bool) -> None:
    """The producer's meta.traceparent is sent only in the W3C shape: no junk, no CR/LF."""
    assert valid_traceparent(value) == (value if sent else None)
    delivery = delivery_for(_envelope(meta={"traceparent": value}), url="https://x/", routes={})
    assert isinstance(delivery, Delivery)
    assert ("traceparent" in delivery.headers) is sent


@pytest.mark.parametrize(
    ("status", "retry_after", "expected"),
    [
        (200, None, DELIVERED),
        (204, None, DELIVERED),
        (299, None, DELIVERED),
        (410, None, Gone("HTTP 410: gone")),
        (429, None, SlowDown("HTTP 429: gone", None)),
        (429, "7", SlowDown("HTTP 429: gone", 7.0)),
        (502, None, SlowDown("HTTP 502: gone", None)),
        (503, "2", SlowDown("HTTP 503: gone", 2.0)),
        (504, None, SlowDown("HTTP 504: gone", None)),
        (408, None, SlowDown("HTTP 408: gone", None)),
        (500, "3", SlowDown("HTTP 500: gone", 3.0)),
        (500, None, SinkDown("HTTP 500: gone")),
        (400, None, DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400: gone")),
        (409, None, DeadLetter(DeadReason.SINK_REJECTED, "HTTP 409: gone")),
        (413, None, DeadLetter(DeadReason.SINK_TOO_LARGE, "HTTP 413: gone")),
        (422, None, DeadLetter(DeadReason.SINK_UNPROCESSABLE, "HTTP 422: gone")),
    ],
)
def test_classify(status: int, retry_after: str | None, expected: object) -> None:
    """Each status means one thing for the row and the endpoint."""
    assert classify(Response(status, b"gone", retry_after)) == expected


@pytest.mark.parametrize("status", [301, 302, 307, 401, 403, 404, 405, 407, 431])
def test_the_endpoints_own_failures_are_severe_not_the_rows(status: int) -> None:
    """A wrong URL or secret would refuse every row: sink-wide, severe, never a dead letter."""
    answer = classify(Response(status, b"", None))
    assert isinstance(answer, SinkDown)
    assert answer.severe
    assert "check sink" in answer.error or "proxy" in answer.error or "headers" in answer.error


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_signature_names_the_endpoints_secret_file(status: int) -> None:
    """The key to check is the secret file the endpoint is signed with: the shared one, or
    its route's own."""
    shared = classify(Response(status, b"", None))
    own = classify(Response(status, b"", None), signed_with="sink.routes.2.secret_file")
    assert isinstance(shared, SinkDown)
    assert isinstance(own, SinkDown)
    assert (
        shared.error
        == f"HTTP {status} (check sink.secret_file: the receiver refused the signature)"
    )
    assert own.error == (
        f"HTTP {status} (check sink.routes.2.secret_file: the receiver refused the signature)"
    )


def test_a_rows_refusal_shows_a_bounded_sanitised_excerpt() -> None:
    """An HTML page's markup and control characters are dropped, its text cut short."""
    body = b"<html><h1>Bad\r\nrequest</h1>\x1b[31m" + b"x" * 5000 + b"</html>"
    answer = classify(Response(400, body, None))
    assert isinstance(answer, DeadLetter)
    assert answer.error.startswith("HTTP 400: Bad request")
    assert len(answer.error) < 200
    assert "\r" not in answer.error
    assert "\x1b" not in answer.error
    assert "<" not in answer.error


@pytest.mark.parametrize(
    ("retry_after_s", "in_a_row", "delay_s"),
    [
        (None, 1, 1.0),
        (None, 2, 2.0),
        (None, 5, 16.0),
        (None, 50, MAX_SLOW_S),
        (0.0, 1, 1.0),
        (30.0, 1, 30.0),
        (1e9, 1, MAX_SLOW_S),
    ],
)
def test_slow_delay(retry_after_s: float | None, in_a_row: int, delay_s: float) -> None:
    """Retry-After bounded, else a doubling backoff per endpoint."""
    assert slow_delay_s(retry_after_s, in_a_row) == delay_s


def test_delivered_is_published() -> None:
    """2xx is the one proof of delivery."""
    assert isinstance(DELIVERED, Published)
