"""Where relayd publishes rows: the `Sink` interface the relay depends on, what a sink
reports back about its own health, and the settings every sink kind shares.

A sink kind is one module (or package) under `relayd/sinks/`, a settings model derived from
`SinkSettings`, and one line in `relayd/sinks/registry.py`; nothing outside `relayd/sinks/`
names it. A sink owns everything about its wire: how a claim's rows travel (one request each,
or batches), how each answer is classified into an outcome value (`relayd.models`), and how
it finds out what it already holds under a row's id (reconciliation, C2), when it can. The
relay owns the rest: leases, deadlines, concurrency, the breaker's verdict, settling.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Protocol

from pydantic import AfterValidator, Field, PrivateAttr

from relayd.models import TYPE_PATTERN, ClaimedRow, Envelope, NotFound, Outcome
from relayd.sections import MAX_DURATION_S, Section

# Told of every exchange with the sink: its operation (for an HTTP sink, the method) and its
# result as a bounded label: a status or code as text, "error" (no answer: the transport
# failed) or "timeout" (the attempt's deadline ended it). `relayd_sink_requests_total`.
ExchangeObserver = Callable[[str, str], None]


def _event_type(value: str) -> str:
    if not TYPE_PATTERN.match(value):
        raise ValueError(f"an event type matches {TYPE_PATTERN.pattern}")
    return value


# A route's `type` (`[[sink.routes]]` of every kind that routes by event type).
RouteType = Annotated[str, AfterValidator(_event_type)]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the relay may ask of a sink, asked rather than assumed."""

    # Whether several rows may go out in one attempt (a batch request, a pipeline of
    # publishes), each still with an outcome of its own: if not, the relay sends each row in
    # an attempt of its own and never asks the sink to group them.
    batches: bool
    # Whether the sink can say what it holds under a row's id. With it, a row an earlier
    # attempt may have delivered is looked up before it is sent again, and an ambiguous
    # outcome (no answer) is resolved then; without it, the row is sent again with the same
    # id and the receiver deduplicates (at least once).
    reconcile_by_id: bool

    @property
    def ambiguous(self) -> str:
        """What an ambiguous outcome means with this sink, in one clause (`relayd check`)."""
        if self.reconcile_by_id:
            return "an unanswered attempt is looked up by id before any re-send"
        return "an unanswered attempt is re-sent with the same id, for the destination to dedupe"


class SinkHealth(Protocol):
    """Where a sink reports what its exchanges show of its health: the circuit breaker.

    A read that found or missed a row is not reported: it shows that the sink reads, not
    that it writes, and must not close the breaker while every write fails.
    """

    def sink_accepted(self) -> None:
        """The sink stored a row we sent: the one proof that it works."""

    def sink_answered(self) -> None:
        """The sink answered a write with a verdict on the row and stored nothing (a
        refusal, a paused queue): its write path answers."""

    def sink_failed(self, *, severe: bool) -> None:
        """A failure of the sink, not of the row; `severe` when every request will fail until
        an operator acts (refused credentials, a wrong address)."""


class Sink(Protocol):
    """A destination for outbox rows."""

    @property
    def capabilities(self) -> Capabilities: ...

    async def start(self) -> None:
        """Open connections; called once before any other method."""

    async def close(self) -> None:
        """Release connections; no method is called afterwards."""

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        """How a claim's rows travel: one list per request (several rows, or one). Asked
        only of a sink whose capabilities say it batches."""

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, send_by: float
    ) -> dict[str, Outcome]:
        """Publish one request's rows (a list from `group_requests`, or one row) and classify
        the answers, one outcome per row. A row an earlier attempt may have delivered is
        reconciled first, where the sink can. No request that could store a row leaves
        after `send_by` (loop time): such rows are `NotStarted` (C4)."""

    async def check(self) -> tuple[bool, str]:
        """Whether the sink answers and accepts our credentials, and one line saying so
        (`relayd check`; the breaker's probe when it has no row to send). Stores nothing
        and reports nothing to `SinkHealth`."""

    async def reconcile(self, row: ClaimedRow, envelope: Envelope) -> Outcome | NotFound:
        """What the sink holds under the row's id: published (it holds this envelope),
        dead-lettered (it holds another), `NotFound`, or a failure (C2). A sink that cannot
        look up an id answers `NotFound`, and says so in its capabilities."""


class SinkSettings(Section):
    """`[sink]`: the keys every kind shares; each kind's model adds its own (a key of another
    kind is refused as unknown). `kind` chooses the model (`relayd/sinks/registry.py`)."""

    kind: str
    # Each attempt's deadline; the lease must outlive two of them (`relay.lease_s`).
    timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    # Requests in flight at once in one process, over all its workers.
    concurrency: int = Field(default=32, ge=1, le=1024)
    # A stored envelope larger than this is dead-lettered `too_large` without being sent.
    max_envelope_bytes: int = Field(default=1024 * 1024, ge=1024)

    # The sink class, as "module:Class", imported when a sink is built (so that loading the
    # configuration imports no transport); its constructor takes (settings, health, *,
    # observe).
    sink_class: ClassVar[str]
    # systemd credentials this kind reads when the unit passes them: the `*_file` key to
    # fill, then the credential's name and every key that must be unset for it to be used.
    credentials: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    # The keys only the sink's connection reads (credentials, a CA bundle): a producer that
    # loads the configuration for its bounds and routes drops them unread
    # (`relayd.config.load_producer_sections`), since it neither has nor needs the secrets.
    connection_keys: ClassVar[frozenset[str]] = frozenset()

    # The longest time from a row's first attempt to its last, from the retry and relay
    # settings (set by the whole configuration; None for a sink built alone). A sink whose
    # dedupe forgets ids after a while weighs it in `relayd check`.
    _retry_horizon_s: float | None = PrivateAttr(default=None)

    @property
    def retry_horizon_s(self) -> float | None:
        return self._retry_horizon_s

    def plan_retries(self, horizon_s: float) -> None:
        """Tell the sink settings relayd's retry horizon (see `_retry_horizon_s`)."""
        self._retry_horizon_s = horizon_s

    @property
    def target(self) -> str:
        """Where rows go, in words an operator recognises (a URL, servers and a stream)."""
        raise NotImplementedError

    def build(self, health: SinkHealth, observe: ExchangeObserver | None = None) -> Sink:
        """The sink these settings describe, reporting to `health` and `observe`;
        `relayd.errors.ConfigError` naming the key when a setting it needs is missing."""
        module, _, name = self.sink_class.partition(":")
        sink: Sink = getattr(importlib.import_module(module), name)(self, health, observe=observe)
        return sink
