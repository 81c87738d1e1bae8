"""A domain event, as the outbox stores it: the one envelope schema every sink reads, with
`type` the event type, `args` `[data]`, and `meta` carrying the event's schema version and
the time it occurred (the keys below). A sink that publishes events, not jobs (NATS), reads
them with `DomainEvent.of`; producers build them under the same names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relayd.models import Envelope, InvalidEnvelope

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
