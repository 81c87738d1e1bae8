"""What the webhook sink sends for one row, and what each answer means, without I/O.

The delivery (docs/webhooks.md): the body `{"data", "timestamp", "type"}` built once per
row from the stored envelope (the same bytes on every attempt), the endpoint its type routes
to, and the headers: `webhook-id` (the event id: the same on every attempt and every
redrive, for receivers to deduplicate), `webhook-timestamp` (this attempt's Unix time) and
`webhook-signature` (relayd/sinks/webhook/signing.py), and the producer's `traceparent` when
it is a valid W3C value.

The answers: 2xx delivered; 410 Gone stops deliveries to the endpoint (`Gone`: its route is
paused, nothing dead-lettered); 408, 425, 429, 502, 503, 504, and any 5xx with a
`Retry-After`, slow the endpoint down without using an attempt (`SlowDown`); 401, 403, 404,
405, 407, 431 and 3xx say the endpoint or its secret is wrong (sink-wide, severe); any other
4xx is the row's fault (dead-lettered with the status and a short, sanitised excerpt); any
other 5xx is a failure of the receiver that uses an attempt. Everything here is a pure
function of its arguments, tested as tables (tests/unit/sinks/webhook/test_answers.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from relayd.core.envelope import META_OCCURRED_AT, Envelope, valid_time
from relayd.core.outcomes import DeadLetter, DeadReason, Outcome, Published, SinkDown
from relayd.core.retry import parse_retry_after
from relayd.core.trace_context import carried
from relayd.sinks.http.answers import Response, excerpt

CONTENT_TYPE = "application/json"
HEADER_ID = "webhook-id"
HEADER_TIMESTAMP = "webhook-timestamp"
HEADER_SIGNATURE = "webhook-signature"

# Sorted keys and numbers written as read: one text per value (see nats_message._BODY).
_BODY = msgspec.json.Encoder(order="sorted", decimal_format="number")
_UUID_CHARS = 36

# Answers that ask the sender to slow down: the receiver is busy or a gateway in front of
# it is. They say nothing about the row.
SLOW_STATUSES = frozenset({408, 425, 429, 502, 503, 504})
# Answers that say the endpoint, or the secret it verifies with, is wrong: every row would
# get the same, so they are the sink's failure, and an operator's to fix.
# ({secret} is the key of the endpoint's secret file.)
ENDPOINT_STATUSES = {
    401: "check {secret}: the receiver refused the signature",
    403: "check {secret}: the receiver refused the signature",
    404: "check sink.url and sink.routes",
    405: "check sink.url and sink.routes",
    407: "a proxy asks for credentials",
    431: "the receiver refused the headers",
}
_ROW_REASONS = {413: DeadReason.SINK_TOO_LARGE, 422: DeadReason.SINK_UNPROCESSABLE}
# When a slowed endpoint is tried again without a Retry-After: doubling from the first,
# up to the last; a Retry-After is honoured up to MAX_SLOW_S.
FIRST_SLOW_S = 1.0
MAX_SLOW_S = 300.0
# How long a row that met an endpoint's 410 waits before it may be tried again when the pause
# that answer asked for could not be stored (once it is stored, the pause holds the row, and
# the row is due again as soon as an operator lifts it: relayd/engine/settle.py).
GONE_RETRY_S = 60.0
# How long a row claimed before an endpoint's 410, and not sent, waits: the pause holds it
# by then; if the pause could not be stored, the row is sent and meets the 410 itself.
GONE_HOLD_S = 1.0


# Made for every attempt and never changed after: a value by convention, not frozen (a frozen
# dataclass costs about four times as much to build).
@dataclass(slots=True)
class Delivery:
    """What is sent for one row, except what each attempt adds (timestamp, signature)."""

    url: str
    body: bytes
    headers: Mapping[str, str]
    # The pause a 410 from this endpoint asks for: (queue, type), '*' for every one.
    pause: tuple[str, str]


@dataclass(frozen=True, slots=True)
class Gone:
    """410: the receiver disabled this endpoint. Stop sending to it; dead-letter nothing."""

    error: str


@dataclass(frozen=True, slots=True)
class SlowDown:
    """The endpoint asks us to wait `retry_after_s` (None: the sink's own backoff)."""

    error: str
    retry_after_s: float | None


Answer = Outcome | Gone | SlowDown

DELIVERED = Published(sink_state="delivered")


def delivery_for(
    envelope: Envelope, *, url: str | None, routes: Mapping[str, str]
) -> Delivery | DeadLetter:
    """The row's delivery, or why it cannot be sent: no endpoint for its type (`no_route`),
    or an envelope that is not an event (`invalid_envelope`)."""
    routed = routes.get(envelope.type)
    endpoint = routed or url
    if endpoint is None:
        return DeadLetter(
            DeadReason.NO_ROUTE,
            f"no endpoint for type {envelope.type!r} (sink.url, sink.routes)",
        )
    if len(envelope.args) != 1:
        return DeadLetter(
            DeadReason.INVALID_ENVELOPE,
            f"args must hold exactly one element, the event's data (it holds {len(envelope.args)})",
        )
    timestamp = event_time(envelope)
    if timestamp is None:
        return DeadLetter(
            DeadReason.INVALID_ENVELOPE,
            f"meta.{META_OCCURRED_AT} is missing or not an RFC 3339 date-time with an offset, "
            "and the id is not a UUIDv7 to take the time from",
        )
    body = _BODY.encode({"data": envelope.args[0], "timestamp": timestamp, "type": envelope.type})
    # The producer's trace context, each value as stored if valid (never junk in a header).
    headers = {HEADER_ID: envelope.id, "Content-Type": CONTENT_TYPE} | carried(envelope.meta)
    # A routed type's endpoint serves that type: its 410 pauses the type. The one default
    # endpoint of a configuration without routes serves everything: its 410 pauses all.
    pause = ("*", envelope.type) if routed or routes else ("*", "*")
    return Delivery(endpoint, body, headers, pause)


def event_time(envelope: Envelope) -> str | None:
    """The body's `timestamp`: when the event occurred, the same on every attempt.
    `meta.occurred_at` as the producer wrote it if present and valid; else the time in a
    UUIDv7 id (milliseconds, UTC); else None."""
    occurred_at = envelope.meta.get(META_OCCURRED_AT)
    if occurred_at is not None:
        return occurred_at if isinstance(occurred_at, str) and valid_time(occurred_at) else None
    # The id is PostgreSQL's canonical text of a UUID (Envelope.parse): the version is its
    # 15th character, and a UUIDv7's first 48 bits are Unix milliseconds.
    event_id = envelope.id
    if len(event_id) != _UUID_CHARS or event_id[14] != "7":
        return None
    millis = int(event_id[:8] + event_id[9:13], 16)
    return f"{_utc_second(millis // 1000)}.{millis % 1000:03d}Z"


@functools.lru_cache(maxsize=256)  # the rows of a claim were mostly written in the same second
def _utc_second(unix_s: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix_s))


def classify(  # noqa: PLR0911 - one return per kind of answer
    response: Response, *, signed_with: str = "sink.secret_file"
) -> Answer:
    """What one answer to a delivery means; `signed_with` names the secret file the
    endpoint's deliveries are signed with, for a refused signature."""
    status = response.status
    if 200 <= status < 300:
        return DELIVERED
    shown = excerpt(response.body)
    text = f"HTTP {status}" + (f": {shown}" if shown else "")
    if status == 410:
        return Gone(text)
    retry_after_s = parse_retry_after(response.retry_after)
    if status in SLOW_STATUSES or (status >= 500 and retry_after_s is not None):
        return SlowDown(text, retry_after_s)
    if 300 <= status < 400:
        return SinkDown(f"{text} (redirects are not followed; check sink.url)", severe=True)
    hint = ENDPOINT_STATUSES.get(status)
    if hint is not None:
        return SinkDown(f"{text} ({hint.format(secret=signed_with)})", severe=True)
    if 400 <= status < 500:
        return DeadLetter(_ROW_REASONS.get(status, DeadReason.SINK_REJECTED), text)
    return SinkDown(text)


def slow_delay_s(retry_after_s: float | None, slowed_in_a_row: int) -> float:
    """How long an endpoint is left alone after its `slowed_in_a_row`-th slow answer in a
    row (1 for the first): its Retry-After, bounded, or a doubling backoff."""
    if retry_after_s is not None:
        return min(max(retry_after_s, FIRST_SLOW_S), MAX_SLOW_S)
    doublings = min(max(slowed_in_a_row - 1, 0), 16)
    return min(FIRST_SLOW_S * float(2**doublings), MAX_SLOW_S)
