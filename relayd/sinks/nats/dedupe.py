"""How the NATS sink keeps a re-sent event from being stored twice, decided without I/O:
what the server and the stream report (API level, `allow_atomic`, `duplicate_window`,
subjects), the mode each route runs in, the messages a guarded publish sends, what a
"wrong last sequence" answer and the read-back after it prove, and the retry horizon the
duplicate window is weighed against (docs/nats.md#deduplication).

Modes, chosen per route, the first that applies:

- `id_in_subject`: the route's subject holds the event id (`{id}`); the event is sent with
  `Nats-Expected-Last-Subject-Sequence: 0`, which every JetStream server honours: a second
  store of the subject is refused, at any time.
- `atomic_marker`: the server reports JetStream API level 2 or more and version 2.12.1 or
  later, and the stream echoes `allow_atomic: true` and takes the marker subjects; a marker
  on `<prefix>.<id>`, expecting sequence 0, and the event travel in one atomic batch: both
  are stored or neither.
- `key_in_subject`: the route's subject holds the row's ordering key (`{key}`, ordered routes
  only); the event is sent expecting the subject's last sequence to be the one relayd last
  saw there (`relayd/sinks/nats/fence.py`): a second store of the event, or a late copy of
  it after the key's next event, is refused at any time.
- `window`: the stream's `duplicate_window` alone; past it, `sink.past_window` decides,
  unless an operator redrove the row since its last attempt.

Features are taken from what the server says, never from the absence of an error: an old
server ignores the headers and stream settings it does not know, and would store twice.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from relayd.core.outcomes import DeadLetter, DeadReason, Outcome, Published, RetryLater
from relayd.sinks.nats.message import (
    EXPECTED_STREAM,
    ID_TOKEN,
    KEY_TOKEN,
    NatsMessage,
    b64decode,
)

# JetStream's headers for an expected subject sequence and for atomic batches (ADR-50).
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQ = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
# Atomic batch publish came with nats-server 2.12, JetStream API level 2 (the server's
# jetstream_versioning.go: "Atomic batch publishing was added in v2.12 and require API
# level 2"). A server before 2.11 reports no level at all: level 0. 2.12.0 reports level 2
# too but refuses a Nats-Msg-Id inside a batch (error 10177, lifted in 2.12.1): the server's
# version, which the stream's echoed metadata carries (`_nats.ver`, 2.11+), must say 2.12.1
# or later.
ATOMIC_API_LEVEL = 2
ATOMIC_MIN_VERSION = (2, 12, 1)
_VERSION_KEY = "_nats.ver"
# The error a publish expecting a subject's last sequence gets when the subject holds one.
WRONG_LAST_SEQUENCE = frozenset({10071, 10164})
ATOMIC_DISABLED = 10174
# A batch holding a Nats-Msg-Id the stream still has in its window (the answer names no
# sequence).
BATCH_DUPLICATE_ID = 10201
_NANOSECONDS = 1e9


class Mode(enum.StrEnum):
    ID_IN_SUBJECT = "id_in_subject"
    KEY_IN_SUBJECT = "key_in_subject"
    ATOMIC_MARKER = "atomic_marker"
    WINDOW = "window"


@dataclass(frozen=True, slots=True)
class StreamFacts:
    """What the server reports: its JetStream API level (account info) and the stream's
    configuration as it echoes it back."""

    api_level: int
    allow_atomic: bool
    duplicate_window_s: float | None
    subjects: tuple[str, ...]
    version: tuple[int, int, int] | None = None
    # The stream's whole budget of bytes (None: no limit): a message larger than it can never
    # be stored, however much is removed.
    max_bytes: int | None = None

    @property
    def atomic(self) -> bool:
        """Whether the server and the stream take atomic batches with message ids."""
        return (
            self.api_level >= ATOMIC_API_LEVEL
            and self.version is not None
            and self.version >= ATOMIC_MIN_VERSION
            and self.allow_atomic
        )

    def takes(self, subject: str) -> bool:
        """Whether the stream stores `subject` (a `*` token in it stands for any token)."""
        return any(subject_matches(pattern, subject) for pattern in self.subjects)


def stream_facts(account: Mapping[str, Any], stream: Mapping[str, Any]) -> StreamFacts:
    """The facts from a successful account info and stream info answer; anything missing
    or of another type counts as not supported."""
    api = account.get("api")
    level = api.get("level") if isinstance(api, dict) else None
    config = stream.get("config")
    config = config if isinstance(config, dict) else {}
    window, subjects = config.get("duplicate_window"), config.get("subjects")
    max_bytes = config.get("max_bytes")
    metadata = config.get("metadata")
    version = metadata.get(_VERSION_KEY) if isinstance(metadata, dict) else None
    return StreamFacts(
        api_level=level if _int(level) and level > 0 else 0,
        allow_atomic=config.get("allow_atomic") is True,
        duplicate_window_s=window / _NANOSECONDS if _int(window) and window > 0 else None,
        subjects=tuple(s for s in subjects if isinstance(s, str))
        if isinstance(subjects, list)
        else (),
        version=_version(version),
        max_bytes=max_bytes if _int(max_bytes) and max_bytes > 0 else None,
    )


def _version(text: object) -> tuple[int, int, int] | None:
    """`2.15.1` (or `2.12.0-RC.1`, read as 2.12.0) as numbers; None for anything else."""
    if not isinstance(text, str):
        return None
    parts = text.split("-", 1)[0].split(".")
    if len(parts) != len(ATOMIC_MIN_VERSION) or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def marker_pattern(prefix: str) -> str:
    """The subjects the markers go to, as a stream must take them."""
    return f"{prefix}.*"


def mode_for(route_subject: str, facts: StreamFacts, *, marker_prefix: str) -> Mode:
    """The mode a route runs in (the module docstring's order)."""
    fixed = mode_without_facts(route_subject)
    if fixed is not None:
        return fixed
    if facts.atomic and facts.takes(marker_pattern(marker_prefix)):
        return Mode.ATOMIC_MARKER
    return Mode.WINDOW


def mode_without_facts(route_subject: str) -> Mode | None:
    """The route's mode when the subject decides it (the id or the ordering key in it: those
    modes work on every server); None when it depends on what the server reports."""
    tokens = route_subject.split(".")
    if ID_TOKEN in tokens:
        return Mode.ID_IN_SUBJECT
    if KEY_TOKEN in tokens:
        return Mode.KEY_IN_SUBJECT
    return None


def as_pattern(route_subject: str) -> str:
    """A route's subject as the stream must take it: `{id}` and `{key}` are any token."""
    return ".".join(
        "*" if token in (ID_TOKEN, KEY_TOKEN) else token for token in route_subject.split(".")
    )


# --- the window ------------------------------------------------------------------------


def past_window(
    *, claimed_before: bool, age_s: float, window_s: float | None, margin_s: float
) -> bool:
    """Whether a re-send may come after the stream forgot the event's id. The window runs
    from the first store, which is no earlier than the row's creation: a row younger than
    the window (with `margin_s` for the time until the message leaves) is inside it. relayd
    keeps no first-attempt time, so a row that waited in a backlog before its first attempt
    counts as older than it is: the bound errs toward caution, never the other way."""
    if not claimed_before:
        return False  # no earlier attempt can have stored it: nothing to deduplicate
    if window_s is None:
        return True
    return age_s + margin_s >= window_s


class PastWindow(enum.StrEnum):
    """What becomes of a row past the window (the `past_window` metric's code)."""

    REDRIVEN = "redriven"  # an operator redrove it since its last attempt: sent
    RESEND = "resend"  # sink.past_window = "resend": sent, perhaps stored twice
    DEAD_LETTER = "dead_letter"  # sink.past_window = "dead_letter": for an operator


def past_window_action(*, redriven: bool, setting: str) -> PastWindow:
    """A row past the window is sent when an operator redrove it after its last attempt
    (`relayd dlq retry`: the operator looked and decided, whatever the setting); otherwise
    `sink.past_window` decides. The redrive covers the one attempt after it: a retry of that
    attempt is weighed again, since it may have stored the event itself."""
    if redriven:
        return PastWindow.REDRIVEN
    return PastWindow.DEAD_LETTER if setting == "dead_letter" else PastWindow.RESEND


def past_window_dead_letter(age_s: float, window_s: float | None) -> DeadLetter:
    """The row's dead letter under `sink.past_window = "dead_letter"`, saying why."""
    window = f"{window_s:g}s" if window_s is not None else "unknown"
    return DeadLetter(
        DeadReason.PAST_WINDOW,
        f"an earlier attempt may have stored this event and the row is {age_s:.0f}s old, "
        f"past the stream's duplicate window ({window}): a re-send could store it twice "
        "(sink.past_window = dead_letter; check the stream, then `relayd dlq retry`)",
    )


# --- the messages ----------------------------------------------------------------------


def expecting_new_subject(message: NatsMessage) -> NatsMessage:
    """The event, refused by the stream if its subject already holds a message."""
    return dataclasses.replace(message, headers=message.headers | {EXPECTED_LAST_SUBJECT_SEQ: "0"})


def marker_body(message: NatsMessage) -> bytes:
    """What a marker says about its event: the subject and a digest of the body, so that a
    marker left by another event under the same id is told apart (a conflict)."""
    digest = hashlib.sha256(message.body).hexdigest()
    return json.dumps({"subject": message.subject, "sha256": digest}, sort_keys=True).encode()


def atomic_batch(
    message: NatsMessage, *, event_id: str, stream: str, marker_prefix: str, batch_id: str
) -> tuple[NatsMessage, NatsMessage]:
    """The marker (first) and the event (the commit, whose PubAck names its sequence): the
    marker expects its subject empty, so a second batch for the event is refused whole."""
    marker = NatsMessage(
        f"{marker_prefix}.{event_id}",
        marker_body(message),
        {
            BATCH_ID: batch_id,
            BATCH_SEQ: "1",
            EXPECTED_LAST_SUBJECT_SEQ: "0",
            EXPECTED_STREAM: stream,
        },
    )
    event = dataclasses.replace(
        message, headers=message.headers | {BATCH_ID: batch_id, BATCH_SEQ: "2", BATCH_COMMIT: "1"}
    )
    return marker, event


# --- what the stream holds after "wrong last sequence" ---------------------------------


@dataclass(frozen=True, slots=True)
class Taken:
    """A publish that expected an empty subject was refused: the subject holds a message
    (its event's, or another's); read it to know which."""

    description: str


@dataclass(frozen=True, slots=True)
class MarkerFound:
    """The stream holds our event's marker at `seq`; its batch put the event at `seq + 1`."""

    seq: int


def classify_marker(answer: Mapping[str, Any], *, message: NatsMessage) -> Outcome | MarkerFound:
    """The last message on the event's marker subject (a `last_by_subj` read): a marker
    for this event's body is proof its batch committed; another body is a conflict."""
    stored = answer.get("message")
    seq = stored.get("seq") if isinstance(stored, dict) else None
    if not isinstance(stored, dict) or not _int(seq):
        return RetryLater("reading the event's marker: the reply holds no message")
    data = b64decode(stored.get("data", ""))
    if data == marker_body(message):
        return MarkerFound(seq)
    return DeadLetter(
        DeadReason.CONFLICT,
        f"the stream holds a marker for this id at seq {seq} from another event "
        "(a different subject or body)",
    )


# The marker is stored and its event's sequence holds nothing now: the batch stored both or
# neither, so the event was stored, and the stream's limits (max_age, max_msgs) or an
# operator removed it since. Re-sending would deliver it a second time.
BATCH_EVENT_GONE = Published(sink_state="stored", reconciled=True)


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a stream subject (`*` one token, a final `>` one or more) takes `subject`."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, part in enumerate(wanted):
        if part == ">":
            return index == len(wanted) - 1 and len(tokens) > index
        if index >= len(tokens) or (part != "*" and part != tokens[index]):
            return False
    return len(tokens) == len(wanted)


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
