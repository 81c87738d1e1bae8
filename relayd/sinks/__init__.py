"""Where relayd publishes rows: the `Sink` interface the relay depends on, and what a sink
reports back about its own health. One module per sink implements it (`ojs.py` today).

A sink owns everything about its wire: how a claim's rows travel (one request each, or
batches), how each answer is classified into an outcome value (`relayd.models`), and how it
finds out what it already holds under a row's id (reconciliation, C2). The relay owns the
rest: leases, deadlines, concurrency, the breaker's verdict, settling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from relayd.models import ClaimedRow, Envelope, NotFound, Outcome


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the relay may ask of a sink, asked rather than assumed."""

    # Whether several rows may travel in one request.
    batches: bool
    # Whether the sink can say what it holds under a row's id: without it, an ambiguous
    # outcome cannot be reconciled before a row is sent again.
    reconcile_by_id: bool


class SinkHealth(Protocol):
    """Where a sink reports what its exchanges show of its health: the circuit breaker.

    A read that found or missed a job is not reported: it shows that the sink reads, not
    that it writes, and must not close the breaker while every write fails.
    """

    def sink_accepted(self) -> None:
        """The sink stored a row we sent (a 2xx to a write): the one proof that it works."""

    def sink_answered(self) -> None:
        """The sink answered a write with a verdict on the row and stored nothing (400,
        409, a paused queue): its write path answers."""

    def sink_failed(self, *, severe: bool) -> None:
        """A failure of the sink, not of the row; `severe` when every request will fail until
        an operator acts (401/403, a wrong URL)."""


class Sink(Protocol):
    """A destination for outbox rows."""

    @property
    def capabilities(self) -> Capabilities: ...

    async def start(self) -> None:
        """Open connections; called once before any other method."""

    async def close(self) -> None:
        """Release connections; no method is called afterwards."""

    async def plan(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        """How a claim's rows travel: one list per request (several rows, or one)."""

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, send_by: float
    ) -> dict[str, Outcome]:
        """Publish one request's rows (a list from `plan`) and classify the answers, one
        outcome per row. A row an earlier attempt may have delivered is reconciled first. No
        request that could store a row leaves after `send_by` (loop time): such rows are
        `NotStarted` (C4)."""

    async def check(self) -> tuple[bool, str]:
        """Whether the sink answers and accepts our credentials, and one line saying so
        (`relayd check`; the breaker's probe when it has no row to send). Stores nothing
        and reports nothing to `SinkHealth`."""

    async def reconcile(self, row: ClaimedRow, envelope: Envelope) -> Outcome | NotFound:
        """What the sink holds under the row's id: published (it holds this envelope),
        dead-lettered (it holds another job), `NotFound`, or a failure (C2)."""
