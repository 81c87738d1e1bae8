"""A claim: rows leased to one owner token, and the loop times that bound what may be done
with them (C4). Pure: the times are passed in."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relayd.core.rows import ClaimedRow
from relayd.sinks import SendWindow

if TYPE_CHECKING:
    from relayd.telemetry.tracing import ClaimSpan

# Of an owner token's 16 bytes, those that say which relay process claimed with it (its
# proof of life's identity: relayd/engine/liveness.py); the rest are random per claim.
HOLDER_BYTES = 8


def owner_token(holder: bytes | None) -> uuid.UUID:
    """A fresh owner token for one claim: random, and starting with `holder` when the
    process holds a proof of life, so that its successor can tell its claims."""
    if holder is None:
        return uuid.uuid4()
    return uuid.UUID(bytes=holder + secrets.token_bytes(16 - HOLDER_BYTES))


@dataclass(frozen=True, slots=True)
class Claim:
    """Rows leased to one owner token. Both bounds count from *before* the claim statement
    was sent: its answer may arrive late (a slow link, a stalled server), and the lease runs
    from the database's commit, not from our receipt."""

    owner: uuid.UUID
    rows: list[ClaimedRow]
    sent_at: float  # when the claim statement was sent
    # Nothing that could store a row is sent after `window.send_by`: each attempt gets
    # sink.timeout_s from its own start and must end a timeout's worth before the lease
    # does, leaving that long to settle (lease_s > 2 x timeout_s, a configuration rule).
    window: SendWindow
    lease_ends: float  # the lease has certainly expired by then: settling is pointless
    answered_at: float  # when the claim's answer arrived (for the commit-to-publish lag)
    span: ClaimSpan | None = None  # the claim's span, parent of its publish and settle spans

    @classmethod
    def leased(  # noqa: PLR0913 - what the claim statement answered, and the two bounds' inputs
        cls,
        owner: uuid.UUID,
        rows: list[ClaimedRow],
        *,
        sent_at: float,
        answered_at: float,
        lease_s: float,
        attempt_timeout_s: float,
        span: ClaimSpan | None = None,
    ) -> Claim:
        lease_ends = sent_at + lease_s
        return cls(
            owner=owner,
            rows=rows,
            sent_at=sent_at,
            window=SendWindow(lease_ends - 2 * attempt_timeout_s, opened_at=answered_at),
            lease_ends=lease_ends,
            answered_at=answered_at,
            span=span,
        )
