"""What the NATS sink sends for one outbox row, decided without I/O: the subject its route
names, the body (the event's data as JSON, the same bytes on every attempt) and the headers
(the id JetStream deduplicates on, the CloudEvents attributes in binary mode, the producer's
`traceparent` and `tracestate` when the row carries valid ones); or why the row cannot be
sent (docs/nats.md#the-message).
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from relayd.core.envelope import DomainEvent, Envelope, InvalidEnvelope
from relayd.core.outcomes import DeadLetter, DeadReason
from relayd.core.trace_context import carried

# JetStream's headers (ADR-4 and the JetStream publish API).
MSG_ID = "Nats-Msg-Id"
EXPECTED_STREAM = "Nats-Expected-Stream"
# The same id for consumers that follow the generic message-id convention.
MESSAGE_ID = "Message-Id"
# A route's subject token that stands for the event id (`events.orders.{id}`).
ID_TOKEN = "{id}"  # noqa: S105 - a subject token, not a secret
# A route's subject token that stands for the row's ordering key (`events.orders.{key}`).
KEY_TOKEN = "{key}"  # noqa: S105 - a subject token, not a secret
# What a subject token may hold: visible ASCII, no wildcard, no separator.
TOKEN_CHARS = frozenset(chr(code) for code in range(0x21, 0x7F)) - {"*", ">", "."}
CONTENT_TYPE = "application/json"
CE_SPECVERSION = "1.0"
# The event's schema version as a CloudEvents extension attribute (an integer).
CE_VERSION_ATTRIBUTE = "dataversion"

# A NATS header block: "NATS/1.0[ status]\r\n", then "Name: value\r\n" lines, then "\r\n".
_HEADER_LINE = b"NATS/1.0"
_CRLF = b"\r\n"

# Sorted keys and numbers written as read: one text per value, whatever order or spacing the
# stored envelope had, so a re-sent event has the bytes of its first send (integers too long
# for msgspec come back as Decimal and are written as the same digits).
_BODY = msgspec.json.Encoder(order="sorted", decimal_format="number")


@dataclass(frozen=True, slots=True)
class Route:
    """Events of `type` (of `version`, or of every version when None) go to `subject`."""

    type: str
    subject: str
    version: int | None = None


class Routes:
    """The route table: a route naming the event's version wins over one for every version."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self._subjects = {(route.type, route.version): route.subject for route in routes}

    def subject(self, event_type: str, version: int) -> str | None:
        """The route's subject, as configured (`{id}` and `{key}` not yet replaced)."""
        return self._subjects.get((event_type, version)) or self._subjects.get((event_type, None))

    @property
    def subjects(self) -> list[str]:
        return sorted(set(self._subjects.values()))


@dataclass(frozen=True, slots=True)
class NatsMessage:
    subject: str
    body: bytes
    headers: dict[str, str]
    # The route's subject as configured, `{id}` and `{key}` unreplaced: it decides the
    # dedupe mode.
    route: str = ""

    @property
    def size(self) -> int:
        """Bytes the server counts against its max_payload: body and header block."""
        return len(self.body) + header_block_size(self.headers)


def message_for(  # noqa: PLR0913 - keywords: the sink's settings, and the row's key
    envelope: Envelope,
    routes: Routes,
    *,
    stream: str,
    source: str,
    max_body_bytes: int,
    key: str | None = None,
) -> NatsMessage | DeadLetter:
    """The message that carries the envelope's event (`key`: the row's ordering key, for a
    route whose subject holds `{key}`), or the row's dead letter: not an event, or an
    ordering key that cannot stand in its subject (`invalid_envelope`), no route for its
    type and version (`no_route`), a body over `sink.max_payload_bytes` (`too_large`)."""
    try:
        event = DomainEvent.of(envelope)
    except InvalidEnvelope as exc:
        return DeadLetter(DeadReason.INVALID_ENVELOPE, str(exc))
    subject = routes.subject(event.type, event.version)
    if subject is None:
        return DeadLetter(
            DeadReason.NO_ROUTE,
            f"no route for type {event.type!r} version {event.version} (sink.routes)",
        )
    body = _BODY.encode(event.data)
    if len(body) > max_body_bytes:
        return DeadLetter(
            DeadReason.TOO_LARGE,
            f"the event's data is {len(body)} bytes as JSON, over sink.max_payload_bytes "
            f"({max_body_bytes})",
        )
    tokens = subject.split(".")
    if KEY_TOKEN in tokens:
        refused = key_refused(key, subject)
        if refused is not None:
            return DeadLetter(DeadReason.INVALID_ENVELOPE, refused)
    concrete = ".".join(
        event.id if token == ID_TOKEN else key if token == KEY_TOKEN and key else token
        for token in tokens
    )
    headers = headers_for(event, stream=stream, source=source)
    # The producer's trace context as stored (valid values only: nothing can break the
    # header block), so the message is the same bytes on every attempt.
    headers.update(carried(envelope.meta))
    return NatsMessage(concrete, body, headers, subject)


def key_refused(key: str | None, subject: str) -> str | None:
    """Why the ordering key cannot stand for `{key}` in the route's subject, or None: a
    subject token is visible ASCII without '.', '*' and '>'."""
    if key is None:
        return f"the route's subject {subject} holds {KEY_TOKEN} and the row has no ordering key"
    if key and TOKEN_CHARS.issuperset(key):
        return None
    return (
        f"the ordering key {key!r} cannot stand for {KEY_TOKEN} in the subject {subject}: a "
        "subject token is visible ASCII without '.', '*' and '>'"
    )


def headers_for(event: DomainEvent, *, stream: str, source: str) -> dict[str, str]:
    """JetStream's dedupe id and expected stream, the id again as `Message-Id`, and the
    CloudEvents attributes as `ce-` headers (the NATS binding's binary mode)."""
    return {
        MSG_ID: event.id,
        MESSAGE_ID: event.id,
        EXPECTED_STREAM: stream,
        "ce-specversion": CE_SPECVERSION,
        "ce-id": event.id,
        "ce-type": event.type,
        "ce-source": percent_encoded(source),
        "ce-time": event.occurred_at,
        f"ce-{CE_VERSION_ATTRIBUTE}": str(event.version),
        "ce-datacontenttype": CONTENT_TYPE,
        "Content-Type": CONTENT_TYPE,
    }


@functools.lru_cache(maxsize=64)  # the configured source, asked for every message
def percent_encoded(value: str) -> str:
    """A header value as the CloudEvents NATS binding encodes strings: UTF-8 bytes of space,
    '"', '%' and anything outside visible ASCII as %XY (upper case)."""
    if all("!" <= char <= "~" and char not in '"%' for char in value):
        return value
    return "".join(
        char
        if "!" <= char <= "~" and char not in '"%'
        else "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))
        for char in value
    )


def header_block(headers: Mapping[str, str]) -> bytes:
    """The header block as the client writes it."""
    lines = b"".join(f"{name}: {value}".encode() + _CRLF for name, value in headers.items())
    return _HEADER_LINE + _CRLF + lines + _CRLF


def header_block_size(headers: Mapping[str, str]) -> int:
    """len(header_block(headers)), without building it (asked for every message)."""
    size = len(_HEADER_LINE) + 2 * len(_CRLF)
    for name, value in headers.items():
        if name.isascii() and value.isascii():
            size += len(name) + len(value) + 4  # ": " and CRLF
        else:
            size += len(f"{name}: {value}".encode()) + len(_CRLF)
    return size


def parse_header_block(raw: bytes) -> dict[str, list[str]]:
    """The headers of a stored message (`hdrs` of a stream message, decoded), by name as
    sent; values in order. Lines that are not `Name: value` are skipped."""
    headers: dict[str, list[str]] = {}
    lines = raw.split(_CRLF)
    if not lines or not lines[0].startswith(_HEADER_LINE):
        return headers
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip():
            text = name.strip().decode("utf-8", "replace")
            headers.setdefault(text, []).append(value.strip().decode("utf-8", "replace"))
    return headers


def b64decode(text: object) -> bytes | None:
    """Standard base64 as the JetStream API writes message bodies and headers; None if
    `text` is not that."""
    if not isinstance(text, str):
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
