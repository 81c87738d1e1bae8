"""The outbox table's name, and the rows a claim leases from it: values that cross module
boundaries, made for every row relayd handles. Nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

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
    # The row's ordering key (docs/ordering.md); None: the row is not ordered.
    ordering_key: str | None = None

    @property
    def claimed_before(self) -> bool:
        """An earlier attempt may have reached the sink: reconcile with a GET first (C2)."""
        return self.previous_attempt_at is not None


@dataclass(slots=True)
class ClaimBatch:
    """A claim's rows, and what its statement saw for the next claim's watermark: the
    smallest available_at of the pending rows it scanned (`head`; None: none), and the start
    of the oldest transaction still writing (`writers_since`; None: not visible to relayd's
    role, so no watermark can be trusted). `marked` False: the claim was not asked for
    those two (both None, meaning nothing)."""

    rows: list[ClaimedRow]
    head: datetime | None
    writers_since: datetime | None
    # Where the next claim's walk over the keys starts (`claim_ordered`); None: at the first.
    walked_to: str | None = None
    # Seconds from the claim's start until the first pending row it did not take is due
    # (negative: due already, locked by another claimer); None: no such row.
    next_due_s: float | None = None
    marked: bool = True
    # Whether rows of ordered keys are pending: only then does the next claim need their heads.
    keyed: bool = True
