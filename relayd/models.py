"""Values that cross module boundaries: the outbox table's name, claimed rows, parsed
envelopes, attempt outcomes.

Outcomes are produced once, at the sink boundary (`relayd/sinks/`), and consumed by the relay
(`relay.py`), which turns them into settle groups. Nothing here does I/O.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from relayd import jsonvalue

# The outbox envelope's rules, checked before any sink sees a row: the shape of an OJS
# enqueue request, which every sink kind reads (docs/ojs.md#the-request).
TYPE_PATTERN = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")
QUEUE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9\-.]*$")
LOWER_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_TYPE_CHARS = 255
MAX_QUEUE_CHARS = 128
PRIORITY_RANGE = range(-100, 101)
DEFAULT_QUEUE = "default"


# One identifier part of the outbox table name. Anything else is refused, so the name can be
# quoted and formatted into SQL once at start-up without injection risk.
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# PostgreSQL truncates identifiers (and NOTIFY channels) at 63 bytes.
_MAX_CHANNEL_BYTES = 63


@dataclass(frozen=True, slots=True)
class OutboxTable:
    """A validated, schema-qualified outbox table name."""

    schema_name: str
    name: str

    @classmethod
    def parse(cls, value: str) -> OutboxTable:
        """`[schema.]name` (schema `public` when absent); ValueError says what is wrong."""
        parts = value.split(".")
        if len(parts) == 1:
            parts = ["public", *parts]
        if len(parts) != 2 or not all(_IDENT.match(part) for part in parts):
            raise ValueError(
                f"invalid table name {value!r}: expected [schema.]name, each part matching "
                f"{_IDENT.pattern}"
            )
        table = cls(schema_name=parts[0], name=parts[1])
        if len(table.channel.encode()) > _MAX_CHANNEL_BYTES:
            raise ValueError(
                f"table name {value!r} is too long: 'schema.name' must fit the "
                f"{_MAX_CHANNEL_BYTES}-byte NOTIFY channel limit"
            )
        return table

    @property
    def qualified(self) -> str:
        """The quoted identifier, safe to format into SQL."""
        return f'"{self.schema_name}"."{self.name}"'

    @property
    def quoted_schema(self) -> str:
        return f'"{self.schema_name}"'

    @property
    def channel(self) -> str:
        """The NOTIFY channel the insert trigger signals (`schema.name`)."""
        return f"{self.schema_name}.{self.name}"

    def __str__(self) -> str:
        return self.channel


class DeadReason(enum.StrEnum):
    """Why a row was dead-lettered (the `dead_reason` column; a bounded metric label)."""

    INVALID_ENVELOPE = "invalid_envelope"
    TOO_LARGE = "too_large"
    SINK_REJECTED = "sink_rejected"  # 400 invalid_request
    SINK_TOO_LARGE = "sink_too_large"  # 413
    SINK_UNPROCESSABLE = "sink_unprocessable"  # 422 validation_error / unsupported
    CONFLICT = "conflict"  # the id holds a different job on the sink (C2)
    NO_ROUTE = "no_route"  # the sink has no destination for the event's type (NATS routes)
    # A re-send could store the event twice: an earlier attempt may have stored it, and the
    # sink's dedupe has forgotten its id since (NATS, sink.past_window = "dead_letter").
    PAST_WINDOW = "past_window"
    MAX_ATTEMPTS = "max_attempts"
    # Set by an operator, never by the relay: a row held by a pause, discarded from there
    # (`relayd held discard`). Such a row is marked discarded at once.
    HELD_DISCARDED = "held_discarded"


class InvalidEnvelope(ValueError):
    """The stored envelope is not one relayd can publish."""


def too_large(envelope_bytes: int, max_envelope_bytes: int) -> DeadLetter | None:
    """The dead letter of an envelope over `sink.max_envelope_bytes` (its stored text as
    UTF-8); None within the bound. The relay applies it to every claimed row, and producers
    to every event they append (relayd/producer.py), so both refuse the same rows."""
    if envelope_bytes <= max_envelope_bytes:
        return None
    return DeadLetter(
        DeadReason.TOO_LARGE,
        f"the envelope is {envelope_bytes} bytes, over sink.max_envelope_bytes "
        f"({max_envelope_bytes})",
    )


# Envelope and ClaimedRow are made for every row relayd handles and never changed after:
# values by convention, not frozen, because a frozen dataclass costs about four times as much
# to build (each field set through object.__setattr__).
@dataclass(slots=True)
class Envelope:
    """The parts of a stored envelope that relayd checks, routes and reconciles on (C2);
    `options` as stored, for a sink to read what it understands."""

    id: str
    type: str
    args: list[Any]
    queue: str
    meta: dict[str, Any]
    priority: int | None
    tags: list[Any] | None
    options: dict[str, Any]

    @classmethod
    def parse(cls, text: str | bytes, event_id: str) -> Envelope:
        """Parse and validate a stored job; `InvalidEnvelope` says precisely what is wrong.

        Whatever the row holds, this raises nothing else: a row relayd cannot understand is
        that row's problem (dead-lettered), never the worker's (C6).
        """
        try:
            job = jsonvalue.loads(text)
        except jsonvalue.JsonError as exc:
            raise InvalidEnvelope(str(exc)) from None
        if not isinstance(job, dict):
            raise InvalidEnvelope("the job is not a JSON object")
        job_id = job.get("id")
        if job_id != event_id:  # event_id is PostgreSQL's canonical, lowercase text
            if not isinstance(job_id, str) or not LOWER_UUID.match(job_id):
                raise InvalidEnvelope("id is not a lowercase UUID")
            raise InvalidEnvelope("id differs from event_id")
        job_type = job.get("type")
        if not isinstance(job_type, str) or not _valid_type(job_type):
            if isinstance(job_type, str) and len(job_type) > MAX_TYPE_CHARS:
                raise InvalidEnvelope(f"type is longer than {MAX_TYPE_CHARS} characters")
            raise InvalidEnvelope(f"type must match {TYPE_PATTERN.pattern}")
        args = job.get("args")
        if not isinstance(args, list):
            raise InvalidEnvelope(f"args must be a JSON array, not {_json_type(args)}")
        meta = job.get("meta", {})
        if not isinstance(meta, dict):
            raise InvalidEnvelope(f"meta must be a JSON object, not {_json_type(meta)}")
        options = job.get("options", {})
        if not isinstance(options, dict):
            raise InvalidEnvelope(f"options must be a JSON object, not {_json_type(options)}")
        queue = _queue(options.get("queue"), "options.queue")
        if queue is None:
            queue = _queue(job.get("queue"), "queue")
        # Routing and policy live under options (a top-level priority is only echoed back).
        priority = options.get("priority")
        if priority is not None and (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or priority not in PRIORITY_RANGE
        ):
            raise InvalidEnvelope("options.priority must be an integer from -100 to 100")
        tags = options.get("tags")
        if tags is not None and not isinstance(tags, list):
            raise InvalidEnvelope("options.tags must be a JSON array")
        return cls(
            id=job_id,
            type=job_type,
            args=args,
            queue=queue or DEFAULT_QUEUE,
            meta=meta,
            priority=priority,
            tags=tags,
            options=options,
        )


def _queue(value: object, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _valid_queue(value):
        raise InvalidEnvelope(f"{key} must match {QUEUE_PATTERN.pattern} (at most 128 chars)")
    return value


# An outbox carries a handful of types and queues over and over: check each once.
@functools.lru_cache(maxsize=4096)
def _valid_type(value: str) -> bool:
    return len(value) <= MAX_TYPE_CHARS and TYPE_PATTERN.match(value) is not None


@functools.lru_cache(maxsize=4096)
def _valid_queue(value: str) -> bool:
    return len(value) <= MAX_QUEUE_CHARS and QUEUE_PATTERN.match(value) is not None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float | Decimal):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    return "an array"


@dataclass(slots=True)
class ClaimedRow:
    """One row leased by a claim; `job` is the stored envelope's text as UTF-8, the request
    body sent byte for byte."""

    event_id: str
    job: bytes
    attempts: int
    previous_attempt_at: datetime | None
    age_s: float  # since created_at, on the database's clock; infinite if created_at is
    # An operator redrove the row (`relayd dlq retry`) after its last attempt: this attempt
    # is the re-send the operator decided on. It leaves `claimed_before` as it is (the OJS
    # sink still reconciles first); a NATS route in window mode sends it even past the
    # stream's duplicate window (docs/nats.md#deduplication).
    redriven: bool = False

    @property
    def claimed_before(self) -> bool:
        """An earlier attempt may have reached the sink: reconcile with a GET first (C2)."""
        return self.previous_attempt_at is not None


@dataclass(slots=True)
class ClaimBatch:
    """A claim's rows, and what its statement saw for the next claim's watermark: the
    smallest available_at of the pending rows it scanned (`head`; None: none), and the start
    of the oldest transaction still writing (`writers_since`; None: not visible to relayd's
    role, so no watermark can be trusted)."""

    rows: list[ClaimedRow]
    head: datetime | None
    writers_since: datetime | None


# --- outcomes of one publish attempt -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Published:
    """The sink holds this exact envelope."""

    sink_state: str
    reconciled: bool = False  # proven by a GET, not by a 2xx to our POST
    sink_job_id: str | None = None  # a unique policy kept another job instead (200)


@dataclass(frozen=True, slots=True)
class RetryLater:
    """A failure of this row that may pass (a paused queue, an odd answer); costs an attempt."""

    error: str
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class SinkDown:
    """A failure of the sink, not the row: feeds the circuit breaker (C5).

    `reached` is False when the request certainly never reached the server (connection
    refused), `severe` when every request will fail until an operator acts (401/403, a wrong
    base URL): the breaker opens at once.
    """

    error: str
    reached: bool = True
    severe: bool = False
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """This row can never succeed."""

    reason: DeadReason
    error: str


@dataclass(frozen=True, slots=True)
class NotStarted:
    """The attempt never began (stop or open breaker): release the claim."""


@dataclass(frozen=True, slots=True)
class Held:
    """Not sent, or not accepted for a reason that is not the row's: the poison-storm guard
    holds the row's queue and type (relayd/storm.py), or the sink's endpoint asks to be left
    alone (a webhook receiver's 429 or 410). Due again after `retry_after_s`, without using
    an attempt. `pause`, when set, is the (queue, type) the sink asks to pause, `'*'` for
    every one (a webhook endpoint that answered 410 Gone): stored and audited with `error`
    as its reason."""

    error: str
    retry_after_s: float
    pause: tuple[str, str] | None = None


Outcome = Published | RetryLater | SinkDown | DeadLetter | NotStarted | Held


@dataclass(frozen=True, slots=True)
class NotFound:
    """Reconciliation found nothing under the row's id: the sink never stored it, or
    purged it since; sending it (again) is safe."""


def timed_out(elapsed_s: float) -> SinkDown:
    """The attempt's deadline passed mid-exchange: the sink may have stored the job."""
    return SinkDown(f"no answer within the attempt deadline ({elapsed_s:.1f}s)")


# Characters that break a line or a terminal when stored text is shown: C0 and C1 controls,
# DEL, and Unicode's line and paragraph separators.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_ERROR_BYTES = 512


def clean_error(text: str) -> str:
    """`last_error` text: control characters stripped, at most 512 UTF-8 bytes."""
    text = CONTROL_CHARS.sub(" ", text)
    data = text.encode()
    if len(data) <= MAX_ERROR_BYTES:
        return text
    return data[: MAX_ERROR_BYTES - 3].decode(errors="ignore") + "..."
