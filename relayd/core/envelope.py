"""The envelope every sink reads: the stored job's parts relayd checks, routes and
reconciles on (`Envelope.parse`), the rules a producer's envelope must follow, and the same
envelope read as a domain event (`DomainEvent`: `type` the event type, `args` `[data]`,
`meta` carrying the event's schema version and the time it occurred). Nothing here does I/O.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from relayd.core import jsonvalue
from relayd.core.outcomes import DeadLetter, DeadReason

# The outbox envelope's rules, checked before any sink sees a row: the shape of an OJS
# enqueue request, which every sink kind reads (docs/ojs.md#the-request).
TYPE_PATTERN = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")
QUEUE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9\-.]*$")
LOWER_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_TYPE_CHARS = 255
MAX_QUEUE_CHARS = 128
PRIORITY_RANGE = range(-100, 101)
DEFAULT_QUEUE = "default"


class InvalidEnvelope(ValueError):
    """The stored envelope is not one relayd can publish."""


def too_large(envelope_bytes: int, max_envelope_bytes: int) -> DeadLetter | None:
    """The dead letter of an envelope over `sink.max_envelope_bytes` (its stored text as
    UTF-8); None within the bound. The relay applies it to every claimed row, and producers
    to every event they append (relayd/producer/__init__.py), so both refuse the same rows."""
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


# The meta keys of a domain event. `version`: the positive integer version of the data's
# schema (a consumer decodes `data` by type and version). `occurred_at`: when the business
# change happened, an RFC 3339 date-time with an offset, as the producer wrote it.
META_VERSION = "version"
META_OCCURRED_AT = "occurred_at"

# RFC 3339's date-time with an upper-case T and Z, at most nanoseconds: what Go, Java and
# Python print. (RFC 3339 also allows lower case and a space; relayd takes the one form.)
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})$")
MAX_VERSION = 2**31 - 1
_SHOWN_CHARS = 60


@dataclass(frozen=True, slots=True)
class DomainEvent:
    """An envelope read as an event; `data` is `args[0]`, as parsed."""

    id: str
    type: str
    version: int
    occurred_at: str
    data: Any

    @classmethod
    def of(cls, envelope: Envelope) -> DomainEvent:
        """The event an envelope holds; `InvalidEnvelope` saying precisely what is wrong."""
        if len(envelope.args) != 1:
            raise InvalidEnvelope(
                f"args must hold exactly one element, the event's data (it holds "
                f"{len(envelope.args)})"
            )
        version = envelope.meta.get(META_VERSION)
        if version is None:
            raise InvalidEnvelope(f"meta.{META_VERSION} is missing (the event's schema version)")
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 1 <= version <= MAX_VERSION
        ):
            raise InvalidEnvelope(
                f"meta.{META_VERSION} must be an integer from 1 to {MAX_VERSION}, not "
                f"{_shown(version)}"
            )
        occurred_at = envelope.meta.get(META_OCCURRED_AT)
        if occurred_at is None:
            raise InvalidEnvelope(f"meta.{META_OCCURRED_AT} is missing (when the event occurred)")
        if not isinstance(occurred_at, str) or not valid_time(occurred_at):
            raise InvalidEnvelope(
                f"meta.{META_OCCURRED_AT} must be an RFC 3339 date-time with an offset, such as "
                f"2024-05-01T12:00:00Z, not {_shown(occurred_at)}"
            )
        return cls(
            id=envelope.id,
            type=envelope.type,
            version=version,
            occurred_at=occurred_at,
            data=envelope.args[0],
        )


def valid_time(text: str) -> bool:
    """Whether `text` is an RFC 3339 date-time with an offset that names a real instant."""
    if _RFC3339.match(text) is None:
        return False
    try:
        datetime.fromisoformat(text)
    except ValueError:  # a month 13, a 25th hour, a leap second
        return False
    return True


def _shown(value: object) -> str:
    """A value as an error names it: short, whatever the producer stored."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
