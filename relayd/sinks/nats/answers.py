"""What each NATS answer means for a row, decided without I/O (docs/nats.md#outcomes): the
reply to a JetStream publish (a PubAck, a duplicate's PubAck, an API error), the stored
message read back after a duplicate, and every exception the client raises.

Exceptions are classified by type, never by text alone: a client's message could quote what
it was given; a connection's failures are put in relayd's words in `relayd/sinks/nats/link.py`.
The answer to a publish is the only proof that a message is stored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors

from relayd.core.outcomes import DeadLetter, DeadReason, Outcome, Published, RetryLater, SinkDown
from relayd.sinks.nats.dedupe import (
    ATOMIC_API_LEVEL,
    ATOMIC_DISABLED,
    BATCH_EVENT_GONE,
    WRONG_LAST_SEQUENCE,
    MarkerFound,
    StreamFacts,
    Taken,
    as_pattern,
    classify_marker,
    marker_pattern,
    mode_for,
    stream_facts,
)
from relayd.sinks.nats.link import NOT_CONNECTED, Link, not_connected
from relayd.sinks.nats.message import MSG_ID, NatsMessage, b64decode, parse_header_block

STORED = "stored"  # the sink_state of a published row: the stream holds it

# JetStream API error codes (the server's errors.json, `err_code`) and what each means for
# a publish. Codes not listed are classified by their HTTP-like `code`.
_SEVERE: Mapping[int, str] = {
    10060: "the subject is stored by another stream than sink.stream (check sink.routes "
    "and the streams' subjects)",
    10109: "the stream is sealed: it takes no more messages",
    10039: "JetStream is not enabled for this account",
    10076: "JetStream is not enabled on the server",
    10035: "the account is not found",
}
_SINK_WIDE: Mapping[int, str] = {
    10008: "JetStream is temporarily unavailable",
    10023: "the server lacks resources",
    10028: "the server lacks memory for the stream",
    10047: "the server lacks storage for the stream",
    10002: "the account's resource limits are reached",
    10053: "the stream's limits are reached (discard new)",
    10077: "the server could not store the message",
    10118: "the stream is offline",
    10194: "the stream is offline",
    10167: "the server is shedding load (too many requests)",
}
_ROW_REFUSED: Mapping[int, tuple[DeadReason, str]] = {
    10054: (DeadReason.SINK_TOO_LARGE, "the message exceeds the stream's max_msg_size"),
    10097: (DeadReason.SINK_REJECTED, "the headers exceed 64 KiB"),
}
_RETRY: Mapping[int, str] = {
    10158: "another publish with this id is in progress",
    10071: "wrong last sequence (this publish expected none)",
    10164: "wrong last sequence (this publish expected none)",
    10070: "wrong last message id (relayd sends no expected id)",
    ATOMIC_DISABLED: "atomic publish is disabled on the stream (its configuration changed: "
    "relayd reads it again)",
    10176: "the atomic batch arrived incomplete",
    10177: "the server refuses a header inside an atomic batch (nats-server 2.12.0 refuses "
    "Nats-Msg-Id there: upgrade it, or turn allow_atomic off)",
}
_NO_MESSAGE = 10037
_STREAM_NOT_FOUND = 10059


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A PubAck with `duplicate: true`: the stream already holds a message with this id,
    at `seq`; read it back to see whether it is ours (C2)."""

    seq: int


@dataclass(frozen=True, slots=True)
class ApiError:
    code: int | None
    err_code: int | None
    description: str

    def describe(self) -> str:
        code = f"{self.err_code}" if self.err_code is not None else f"code {self.code}"
        return f"JetStream error {code}: {self.description or 'no description'}"


def classify_ack(
    reply: bytes, *, stream: str, subject: str, guarded: bool = False
) -> Outcome | Duplicate | Taken:
    """What the reply to one publish means (docs/nats.md#outcomes). A `guarded` publish
    expected its (marker's) subject empty: "wrong last sequence" says it holds a message."""
    answer = _json_object(reply)
    if answer is None:
        # Another responder than JetStream answered on the subject (a plain subscriber):
        # nothing says the stream stored the message. The next attempt re-sends it with the
        # same id, which the stream deduplicates if it did.
        return RetryLater(f"the reply on {subject} is not a JetStream PubAck")
    error = _api_error(answer)
    if error is not None:
        if guarded and error.err_code in WRONG_LAST_SEQUENCE:
            return Taken(error.describe())
        return classify_api_error(error, subject=subject)
    seq = answer.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        return RetryLater(f"the reply on {subject} is not a JetStream PubAck")
    if not isinstance(answer.get("stream"), str):
        return RetryLater(f"the reply on {subject} is not a JetStream PubAck")
    if answer["stream"] != stream:
        return RetryLater(
            f"stream {answer['stream']!r} acknowledged the message, not sink.stream {stream!r}"
        )
    if answer.get("duplicate") is True:
        return Duplicate(seq)
    return _PUBLISHED


_PUBLISHED = Published(sink_state=STORED)


def classify_api_error(error: ApiError, *, subject: str) -> Outcome:
    """A JetStream API error by its code: the row's fault (dead-lettered), the sink's
    (the breaker), or neither (retried)."""
    text = f"{error.describe()} (publishing to {subject})"
    err_code = error.err_code if error.err_code is not None else -1
    if err_code in _SEVERE:
        return SinkDown(f"{text}: {_SEVERE[err_code]}", reached=False, severe=True)
    if err_code in _SINK_WIDE:
        return SinkDown(f"{text}: {_SINK_WIDE[err_code]}")
    if err_code in _ROW_REFUSED:
        reason, cause = _ROW_REFUSED[err_code]
        return DeadLetter(reason, f"{text}: {cause}")
    if err_code in _RETRY:
        return RetryLater(f"{text}: {_RETRY[err_code]}")
    if error.code is not None and (error.code >= 500 or error.code in (408, 429)):
        return SinkDown(text)
    # An error relayd does not know: retried, so that nothing is dead-lettered on a guess;
    # the row's attempts bound it (max_attempts).
    return RetryLater(text)


# The refusals that say the stream has no room for a message now: sink-wide (the stream
# frees room as its limits remove old messages, or an operator raises them), unless the
# message is larger than the stream's whole budget (`never_stored`).
NO_ROOM = frozenset({10053, 10077})


def never_stored(message: NatsMessage, facts: StreamFacts) -> DeadLetter | None:
    """The dead letter of a message the stream can never hold: larger than its `max_bytes`
    as stored (body, header block and subject, a lower bound of what the stream counts);
    None when it may fit once there is room."""
    if facts.max_bytes is None:
        return None
    size = message.size + len(message.subject.encode())
    if size <= facts.max_bytes:
        return None
    return DeadLetter(
        DeadReason.SINK_TOO_LARGE,
        f"the message is at least {size} bytes as stored, over the stream's max_bytes "
        f"({facts.max_bytes}): the stream can never hold it",
    )


def classify_stored(
    reply: bytes,
    *,
    seq: int | None,
    body: bytes,
    event_id: str,
    gone: Outcome | None = None,
) -> Outcome:
    """What the stream holds at `seq` (the sequence a duplicate's PubAck named, or the
    event's in a committed batch), or last on the event's own subject (`seq` None),
    compared with our message: the same id and body is ours (published, reconciled);
    another body under our id is a conflict, never published (the stream's dedupe compares
    ids, not bytes). `gone` is the outcome when nothing is there any more."""
    answer = _json_object(reply)
    where = f"reading back seq {seq}" if seq is not None else "reading the event's subject"
    if answer is None:
        return RetryLater(f"{where}: the reply is not a JetStream answer")
    error = _api_error(answer)
    if error is not None:
        if gone is not None and (error.err_code == _NO_MESSAGE or error.code == 404):
            return gone
        if error.err_code == _NO_MESSAGE or error.code == 404:
            # Deleted or aged out since it was stored; its id is still in the dedupe
            # window. Once the window passes, a re-send stores it again.
            gone_now = (
                "the stream acknowledged a duplicate it no longer holds"
                if seq is not None
                else "the subject holds nothing now (removed since the refusal)"
            )
            return RetryLater(f"{where}: {error.describe()}: {gone_now}")
        if error.code is not None and (error.code >= 500 or error.code in (408, 429)):
            return SinkDown(f"{where}: {error.describe()}")
        return RetryLater(f"{where}: {error.describe()}")
    message = answer.get("message")
    if not isinstance(message, dict):
        return RetryLater(f"{where}: the reply holds no message")
    if seq is None:
        seq = message.get("seq") if _int(message.get("seq")) else 0
    stored_body = b64decode(message.get("data", ""))
    raw_headers = b64decode(message.get("hdrs", ""))
    if stored_body is None or raw_headers is None:
        return RetryLater(f"{where}: the message's data or headers are not base64")
    ids = _header(parse_header_block(raw_headers), MSG_ID)
    differ = []
    if ids != [event_id]:
        differ.append(f"{MSG_ID} {ids[0] if ids else 'missing'}")
    if stored_body != body:
        differ.append(f"body of {len(stored_body)} bytes, ours {len(body)}")
    if differ:
        return DeadLetter(
            DeadReason.CONFLICT,
            f"the stream holds a different message under this id at seq {seq} "
            f"({'; '.join(differ)})",
        )
    return Published(sink_state=STORED, reconciled=True)


@dataclass(frozen=True, slots=True)
class LastOnSubject:
    """The last message on an ordering key's subject: at `seq` (0: the subject holds
    nothing), and, when it is this event, what that means (published, reconciled; or a
    conflict: another body under its id); `ours` None: another event of the key."""

    seq: int
    ours: Outcome | None = None


def classify_last_on_subject(
    reply: bytes, *, body: bytes, event_id: str
) -> LastOnSubject | Outcome:
    """The reply to a `last_by_subj` read of a key's subject (before its first publish
    there, or after a refusal for "wrong last sequence"), or the failure to read it."""
    where = "reading the ordering key's subject"
    answer = _json_object(reply)
    if answer is None:
        return RetryLater(f"{where}: the reply is not a JetStream answer")
    error = _api_error(answer)
    if error is not None:
        if error.err_code == _NO_MESSAGE or error.code == 404:
            return LastOnSubject(0)
        if error.code is not None and (error.code >= 500 or error.code in (408, 429)):
            return SinkDown(f"{where}: {error.describe()}")
        return RetryLater(f"{where}: {error.describe()}")
    message = answer.get("message")
    seq = message.get("seq") if isinstance(message, dict) else None
    raw_headers = b64decode(message.get("hdrs", "")) if isinstance(message, dict) else None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1 or raw_headers is None:
        return RetryLater(f"{where}: the reply holds no message")
    if _header(parse_header_block(raw_headers), MSG_ID) != [event_id]:
        return LastOnSubject(seq)
    return LastOnSubject(seq, classify_stored(reply, seq=None, body=body, event_id=event_id))


def acked_seq(reply: bytes) -> int | None:
    """The sequence a PubAck names (the stream stored the message there)."""
    answer = _json_object(reply)
    seq = answer.get("seq") if answer is not None else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else None


def classify_marker_reply(reply: bytes, *, message: NatsMessage) -> Outcome | MarkerFound:
    """The last message on the event's marker subject, after the batch was refused with
    "wrong last sequence": our marker (then read its event), another's (a conflict)."""
    answer = _json_object(reply)
    where = "reading the event's marker"
    if answer is None:
        return RetryLater(f"{where}: the reply is not a JetStream answer")
    error = _api_error(answer)
    if error is None:
        return classify_marker(answer, message=message)
    if error.code is not None and (error.code >= 500 or error.code in (408, 429)):
        return SinkDown(f"{where}: {error.describe()}")
    # Gone (deleted since the refusal) or refused: the next attempt sends the batch again.
    return RetryLater(f"{where}: {error.describe()}")


def classify_batch_event(reply: bytes, *, marker_seq: int, body: bytes, event_id: str) -> Outcome:
    """The message after our marker, where its batch stored the event (a batch's sequences
    follow one another): ours is published (reconciled); another there, which a committed
    batch cannot leave, is never taken as ours (a conflict); nothing there is our event,
    removed since by the stream's limits or an operator (published: it was stored)."""
    return classify_stored(
        reply, seq=marker_seq + 1, body=body, event_id=event_id, gone=BATCH_EVENT_GONE
    )


def read_facts(
    account: bytes | SinkDown, stream: bytes | SinkDown, *, stream_name: str
) -> StreamFacts | SinkDown:
    """The server's API level and the stream's configuration, as the publish path needs
    them to choose a mode; a failure to read them is the sink's (nothing sent)."""
    verdict = _facts_or_failure(account, stream, stream_name=stream_name)
    if isinstance(verdict, str):
        return SinkDown(verdict, reached=False)
    return verdict


def _facts_or_failure(
    account: bytes | SinkDown, stream: bytes | SinkDown, *, stream_name: str
) -> StreamFacts | str:
    if isinstance(account, SinkDown):
        return f"JetStream does not answer: {account.error}"
    info = _json_object(account)
    error = None if info is None else _api_error(info)
    if info is None or error is not None:
        return f"JetStream refuses: {error.describe() if error else 'not a JSON answer'}"
    if isinstance(stream, SinkDown):
        return f"stream {stream_name}: {stream.error}"
    described = _json_object(stream)
    error = None if described is None else _api_error(described)
    if described is None or error is not None:
        if error is not None and error.err_code == _STREAM_NOT_FOUND:
            return f"stream {stream_name} not found (create it: docs/nats.md#operations)"
        return f"stream {stream_name}: {error.describe() if error else 'not a JSON answer'}"
    return stream_facts(info, described)


# The server's -ERR for a publish its user may not make (nats-server, `Permissions
# Violation for Publish to "<subject>"`): the connection stays open, the message is dropped
# and never answered, so the client sees only a timeout. nats-py hands the line to error_cb
# as a plain client Error.
_PUBLISH_REFUSED = re.compile(r'permissions violation for publish to "([^"]*)"', re.IGNORECASE)


# The same for a subscription (`Permissions Violation for Subscription to "<subject>"`):
# the server keeps the connection and delivers nothing to the refused subscription.
_SUBSCRIBE_REFUSED = re.compile(
    r'permissions violation for subscription to "([^"]*)"', re.IGNORECASE
)


def publish_refused(exc: BaseException) -> str | None:
    """The subject of a publish the server refused for lack of permission, from the error
    the client reported; None for any other error."""
    return _refused_subject(_PUBLISH_REFUSED, exc)


def subscribe_refused(exc: BaseException) -> str | None:
    """The subject of a subscription the server refused for lack of permission, from the
    error the client reported; None for any other error."""
    return _refused_subject(_SUBSCRIBE_REFUSED, exc)


def _refused_subject(pattern: re.Pattern[str], exc: BaseException) -> str | None:
    if type(exc) is not nats.errors.Error:
        return None
    match = pattern.search(str(exc))
    return match[1] if match else None


class Refused(Exception):
    """The server refused something for lack of permission: an operator must grant it."""

    def __init__(self, message: str, subject: str) -> None:
        super().__init__(message)
        self.subject = subject


class PublishRefused(Refused):
    """The server refused a publish to `subject` for lack of permission (its -ERR line,
    reported on the side): the message was dropped, and no answer will come."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"permissions violation for publish to {subject}", subject)


class InboxRefused(Refused):
    """The server refused relayd's subscription to its reply subject `subject`: no PubAck
    and no API answer can reach relayd. `sent` says whether the request it fails was
    written before the refusal was known (then the server may have stored it)."""

    def __init__(self, subject: str, *, sent: bool) -> None:
        super().__init__(f"permissions violation for subscription to {subject}", subject)
        self.sent = sent


def inbox_refused(exc: InboxRefused) -> SinkDown:
    """A refused reply subscription: severe (an operator must grant it); reached if the
    message was written before the refusal was known."""
    return SinkDown(
        f"the server refuses relayd's subscription to its replies ({exc.subject}; "
        "permissions violation), so no answer can reach it: grant relayd's NATS user "
        "subscribe permission on _INBOX.> (docs/nats.md#operations)",
        reached=exc.sent,
        severe=True,
    )


def classify_exception(exc: BaseException, *, subject: str, link: Link) -> Outcome:
    """A failure the client raised while publishing. Every one but a timeout is raised
    before the message is handed to the connection, so nothing can have been stored
    (`reached=False`); a timeout after sending is ambiguous: the next attempt re-sends
    with the same id, which the stream deduplicates within its duplicate window.

    A publish the server refused for lack of permission needs an operator (severe: the
    breaker opens at once, the attempt is refunded). It stays counted as reached: the
    refusal names a subject, not a message, and a permission granted meanwhile could have
    let this very message in. A refused reply subscription is severe too: reached if the
    message was written before the refusal was known (it may be stored, unanswered), not
    reached if it was never written. A publish refused for want of a connection names the
    server and what the client last met (`link`)."""
    name = type(exc).__name__
    if isinstance(exc, PublishRefused):
        return SinkDown(
            f"the server refuses publishes to {subject} (permissions violation): grant "
            "relayd's NATS user publish permission on it (docs/nats.md#operations)",
            severe=True,
        )
    if isinstance(exc, InboxRefused):
        return inbox_refused(exc)
    if isinstance(exc, nats.errors.NoRespondersError | nats.js.errors.NoStreamResponseError):
        return SinkDown(
            f"no responders on {subject}: no stream stores it, or JetStream is not ready "
            "(check the stream and its subjects against sink.routes)",
            reached=False,
        )
    if isinstance(exc, nats.errors.TimeoutError):
        return SinkDown(f"no PubAck for {subject} from {link.server} in time: it may be stored")
    if isinstance(exc, NOT_CONNECTED):
        return not_connected(exc, link)
    if isinstance(exc, nats.errors.MaxPayloadError):
        return DeadLetter(
            DeadReason.SINK_TOO_LARGE, "the message exceeds the server's max_payload; not sent"
        )
    if isinstance(exc, nats.errors.BadSubjectError | nats.errors.BadHeaderError):
        return SinkDown(
            f"the client refused the message ({name}; check sink.routes)",
            reached=False,
            severe=True,
        )
    return SinkDown(f"NATS client error: {name}", reached=False)


def reply_code(reply: bytes) -> str:
    """A reply as `relayd_sink_requests_total` labels it: `ok`, or the JetStream error code
    (a bounded set, the server's errors.json), or `invalid` for a reply that is neither."""
    answer = _json_object(reply)
    if answer is None:
        return "invalid"
    error = _api_error(answer)
    if error is None:
        return "ok"
    return str(error.err_code if error.err_code is not None else error.code or "error")


# --- relayd check ------------------------------------------------------------------------


def stream_verdict(
    account: bytes | SinkDown,
    stream: bytes | SinkDown,
    *,
    stream_name: str,
    routes: Sequence[str],
    max_payload: int,
    max_body_bytes: int,
    marker_prefix: str,
    horizon_s: float | None,
    past_window: str,
) -> tuple[bool, str]:
    """`relayd check`'s verdict on JetStream (the account info) and the stream (its info):
    it exists, its subjects take every route's subject, the payload bound fits the server;
    shown: the duplicate window against relayd's retry horizon, and each route's mode
    (docs/nats.md#deduplication)."""
    facts = _facts_or_failure(account, stream, stream_name=stream_name)
    if isinstance(facts, str):
        return False, facts
    missing = [r for r in routes if not facts.takes(as_pattern(r))]
    if missing:
        return False, (
            f"stream {stream_name} does not take {', '.join(missing)} "
            f"(its subjects: {', '.join(facts.subjects) or 'none'}; check sink.routes)"
        )
    if max_body_bytes > max_payload:
        return False, (
            f"sink.max_payload_bytes ({max_body_bytes}) is above the server's max_payload "
            f"({max_payload})"
        )
    modes = {route: mode_for(route, facts, marker_prefix=marker_prefix) for route in routes}
    api_text = f"API level {facts.api_level}" if facts.api_level else "API level unknown"
    return True, (
        f"JetStream answers ({api_text}); stream {stream_name} takes every route's subject; "
        f"{_window_text(facts, horizon_s, past_window, modes)}; max_payload {max_payload}; "
        f"modes: {', '.join(f'{route} {mode}' for route, mode in modes.items())}"
        f"{_marker_hint(facts, marker_prefix, modes)}"
    )


def _window_text(
    facts: StreamFacts, horizon_s: float | None, past_window: str, modes: Mapping[str, str]
) -> str:
    window = facts.duplicate_window_s
    text = f"duplicate window {window:g}s" if window is not None else "duplicate window unknown"
    if horizon_s is None:
        return text
    text += f", retry horizon {horizon_s:g}s"
    if "window" in modes.values() and (window is None or window <= horizon_s):
        text += (
            f" (window-mode routes: an unanswered attempt retried past the window is "
            f"handled by sink.past_window = {past_window})"
        )
    return text


def _marker_hint(facts: StreamFacts, marker_prefix: str, modes: Mapping[str, str]) -> str:
    """Why window mode, where a setting of the stream would give atomic markers."""
    if "window" not in modes.values():
        return ""
    if facts.api_level < ATOMIC_API_LEVEL or (facts.allow_atomic and not facts.atomic):
        return " (atomic markers need nats-server 2.12.1+, JetStream API level 2)"
    wanted = marker_pattern(marker_prefix)
    if not facts.allow_atomic:
        return f" (atomic markers need the stream's allow_atomic and its subject {wanted})"
    return f" (atomic markers need the stream to take {wanted})"


def _json_object(reply: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(reply)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _api_error(answer: Mapping[str, Any]) -> ApiError | None:
    error = answer.get("error")
    if error is None:
        return None
    if not isinstance(error, dict):
        return ApiError(None, None, str(error)[:200])
    code, err_code = error.get("code"), error.get("err_code")
    description = error.get("description")
    return ApiError(
        code if _int(code) else None,
        err_code if _int(err_code) else None,
        description[:200] if isinstance(description, str) else "",
    )


def _header(headers: Mapping[str, list[str]], name: str) -> list[str]:
    """A header's values, its name matched case-insensitively (NATS headers are)."""
    return [
        value for key, values in headers.items() if key.lower() == name.lower() for value in values
    ]


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
