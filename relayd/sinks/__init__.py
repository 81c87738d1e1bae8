"""The seam between the engine and a destination, and the rules every destination obeys,
written once.

A destination (a sink kind) is one package under `relayd/sinks/`: its settings (a model
derived from `SinkSettings`), the message it builds, the pure classification of its answers
and the sink itself, registered by one line in `relayd/sinks/registry.py`. Nothing outside
`relayd/sinks/` names a kind: the daemon, `relayd check`, the demo, the producer's checks
and the service manager's credentials all come from the registered settings model.

A sink owns its wire: how a claim's rows travel (one request each, or batches) and what each
answer means, as an outcome value (`relayd.core.outcomes`). What every sink must do the same
way is here:

- `report`: how the outcome of an exchange feeds the circuit breaker (`SinkHealth`);
- `SendWindow`: nothing that could store a row leaves after the claim's start-by bound (C4);
- `refusal`: the checks a producer runs before it appends (`relayd.producer`) and the relay
  before it sends: the envelope's size, then what the kind itself refuses unsent.

The engine owns the rest: leases, deadlines, concurrency, the breaker's verdict, settling.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, PrivateAttr

from relayd.config.base import MAX_DURATION_S, Section, sink_files_read
from relayd.core.envelope import TYPE_PATTERN, Envelope, too_large
from relayd.core.errors import ConfigError
from relayd.core.outcomes import DeadLetter, Outcome, Published, SinkDown
from relayd.core.rows import ClaimedRow

# Told of every exchange with the sink: its operation (for an HTTP sink, the method) and its
# result as a bounded label: a status or code as text, "error" (no answer: the transport
# failed) or "timeout" (the attempt's deadline ended it). `relayd_sink_requests_total`.
ExchangeObserver = Callable[[str, str], None]

_O = TypeVar("_O")
# The port of each scheme a sink's URL may have, when the URL names none.
_DEFAULT_PORTS = {"http": 80, "https": 443, "nats": 4222, "tls": 4222}


def _event_type(value: str) -> str:
    if not TYPE_PATTERN.match(value):
        raise ValueError(f"an event type matches {TYPE_PATTERN.pattern}")
    return value


# A route's `type` (`[[sink.routes]]` of every kind that routes by event type).
RouteType = Annotated[str, AfterValidator(_event_type)]

# Ordered delivery per key (docs/ordering.md): "key" delivers a key's rows one at a time, in
# the order their transactions committed; "none" delivers rows as they come.
Ordering = Literal["none", "key"]
# What becomes of an ordered key whose head exhausts its attempts or is refused for good:
# "park" holds the key's later rows until an operator acts (`relayd keys`); "skip"
# dead-letters the head and the key goes on.
OnExhausted = Literal["park", "skip"]


@dataclass(frozen=True, slots=True)
class OrderPolicy:
    """How a route orders its rows: `ordered` (rows must carry a key, one in flight per
    key), and whether a head that can never be delivered parks its key (`park`) or is
    dead-lettered for the key to go on."""

    ordered: bool
    park: bool


UNORDERED = OrderPolicy(ordered=False, park=False)


class SinkRoute(Section):
    """What every `[[sink.routes]]` entry may say beside its kind's own keys: its event
    `type`, and its ordering (None: the sink's `ordering` and `on_exhausted`)."""

    type: RouteType
    ordering: Ordering | None = None
    on_exhausted: OnExhausted | None = None


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the relay may ask of a sink, asked rather than assumed."""

    # Whether several rows may go out in one attempt (a batch request, a pipeline of
    # publishes), each still with an outcome of its own: if not, the relay sends each row in
    # an attempt of its own and never asks the sink to group them.
    batches: bool
    # Whether the sink looks up what it holds under a row's id before it sends that row
    # again (the OJS sink's GET). With it, an ambiguous outcome (no answer) is resolved on
    # the next attempt; without it, the row is sent again with the same id and the receiver
    # deduplicates (at least once), which the relay logs as a re-send.
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

    def sink_failed(self, *, severe: bool, reason: str) -> None:
        """A failure of the sink, not of the row; `severe` when every request will fail until
        an operator acts (refused credentials, a wrong address). `reason` says what failed,
        in relayd's words and with the host and port where it is a connection's failure
        (`SinkDown.error`): the reason an open breaker gives (`breaker.opened`, `/readyz`,
        `relayd status`). Never a secret: it is logged and stored."""

    def sink_reconnected(self) -> None:
        """The sink's client made its lost connection again (a sink that keeps one, as NATS
        does): the breaker may probe at once instead of waiting out its cooldown, and the
        reconnect is counted (`relayd_sink_reconnects_total`). A sink whose client opens
        connections as requests need them (HTTP) never calls it."""


def report(health: SinkHealth, outcome: _O, *, write: bool = True) -> _O:
    """Tell the breaker what one exchange showed, and hand its outcome back: a failure of the
    sink (`SinkDown`) always; for a write, a row it stored (or was found to hold) or, for
    anything else, a verdict on the row (C5). A read is told only when it failed."""
    if isinstance(outcome, SinkDown):
        health.sink_failed(severe=outcome.severe, reason=outcome.error)
    elif write:
        if isinstance(outcome, Published):
            health.sink_accepted()
        else:
            health.sink_answered()
    return outcome


@dataclass(frozen=True, slots=True)
class SendWindow:
    """When a claim's requests may still leave (C4): nothing that could store a row is sent
    after `send_by` (loop time), a timeout's worth before the lease ends, so that an attempt
    that starts in time also ends, and settles, before another owner may take the rows.
    A request that could only read (a lookup by id) needs no window."""

    send_by: float
    # When the claim's answer arrived (loop time): its rows' ages were measured then. None:
    # now, for a window made outside a claim.
    opened_at: float | None = None

    def closed(self) -> bool:
        """Whether it is too late to send: the row is then `NotStarted` (released)."""
        return asyncio.get_running_loop().time() > self.send_by

    def elapsed_s(self) -> float:
        """Seconds since the window opened: what to add to a row's age at the claim for its
        age now, as a request leaves."""
        if self.opened_at is None:
            return 0.0
        return max(asyncio.get_running_loop().time() - self.opened_at, 0.0)


class Sink(Protocol):
    """A destination for outbox rows, as the engine calls it."""

    @property
    def capabilities(self) -> Capabilities: ...

    async def start(self) -> None:
        """Get ready to send (load a CA bundle, open a session); called once before any
        other method. A destination that is down is not a failed start: the first exchange
        finds out, and the breaker handles it."""

    async def close(self) -> None:
        """Release connections; no method is called afterwards."""

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        """How a claim's rows travel: one list per request (several rows, or one). Asked
        only of a sink whose capabilities say it batches."""

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, window: SendWindow
    ) -> dict[str, Outcome]:
        """Publish one request's rows (a list from `group_requests`, or one row) and classify
        the answers, one outcome per row, each exchange `report`ed. No request that could
        store a row leaves once `window` is closed: such rows are `NotStarted` (C4)."""

    async def check(self) -> tuple[bool, str]:
        """Whether the sink answers and accepts our credentials, and one line saying so
        (`relayd check`; the breaker's probe when it has no row to send). Stores nothing
        and reports nothing to `SinkHealth`."""


class SinkSettings(Section):
    """`[sink]`: the keys every kind shares; each kind's model adds its own (a key of another
    kind is refused as unknown). `kind` chooses the model (`relayd/sinks/registry.py`), and
    the model's class variables are what the rest of relayd knows of the kind."""

    kind: str
    # Each attempt's deadline; the lease must outlive two of them (`relay.lease_s`).
    timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    # Requests in flight at once in one process, over all its workers.
    concurrency: int = Field(default=32, ge=1, le=1024)
    # A stored envelope larger than this is dead-lettered `too_large` without being sent.
    max_envelope_bytes: int = Field(default=1024 * 1024, ge=1024)
    # Every route's ordering, unless the route says its own (docs/ordering.md).
    ordering: Ordering = "none"
    on_exhausted: OnExhausted = "park"

    # The sink class, as "module:Class", imported when a sink is built (so that loading the
    # configuration imports no transport); its constructor takes (settings, health, *,
    # observe).
    sink_class: ClassVar[str]
    # The modules the sink needs beyond relayd's own dependencies (its client library), and
    # the extra that installs them (`pip install '.[EXTRA]'`, docs/install.md).
    client_modules: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str | None] = None
    # `relayd demo --sink KIND`, as "module:Class" naming the kind's `relayd.demo.Demo`
    # (imported only by the demo); None: no demo.
    demo: ClassVar[str | None] = None
    # The kind's example configuration, as a path in the repository (shipped in the wheel
    # at the same path under `relayd/`): `relayd config example --kind KIND`. None: none.
    example: ClassVar[str | None] = None
    # systemd credentials this kind reads when the unit passes them: the `*_file` key to
    # fill, then the credential's name and every key that must be unset for it to be used.
    credentials: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    # The keys only the sink's connection reads (credentials, a CA bundle): a producer that
    # loads the configuration for its bounds and routes drops them unread
    # (`relayd.settings.load_producer_sections`), since it neither has nor needs the secrets.
    # A kind reads the files they name in a validator that does nothing unless
    # `relayd.config.base.sink_files_read()`: the operator commands keep the paths unread.
    connection_keys: ClassVar[frozenset[str]] = frozenset()

    # Whether the files were read when these settings were validated: settings loaded for an
    # operator command (`relayd.settings.load_settings(sink_files=False)`) cannot build a sink.
    _files_read: bool = PrivateAttr(default_factory=sink_files_read)

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

    @classmethod
    def without_connection_keys(cls, table: Mapping[str, object]) -> dict[str, object]:
        """`[sink]` as a table of keys, less those only the connection reads
        (`connection_keys`): what a producer validates, unread secrets and all."""
        return {key: value for key, value in table.items() if key not in cls.connection_keys}

    @functools.cached_property
    def _any_ordered(self) -> bool:
        """Whether the sink or any of its routes orders rows by key."""
        routes: Sequence[SinkRoute] = getattr(self, "routes", ())
        return self.ordering == "key" or any(route.ordering == "key" for route in routes)

    def route_of(self, envelope: Envelope) -> SinkRoute | None:
        """The `[[sink.routes]]` entry that carries the envelope (None: none, or a kind
        without routes): where its ordering may be said."""
        return None

    def order_policy(self, envelope: Envelope | None) -> OrderPolicy:
        """How the envelope's route orders its rows (None: a row whose envelope could not be
        read, which follows the sink's own setting)."""
        if not self._any_ordered:
            return UNORDERED  # the usual case: no route lookup per row on the hot path
        route = None if envelope is None else self.route_of(envelope)
        ordering = (route.ordering if route is not None else None) or self.ordering
        if ordering == "none":
            return UNORDERED
        on_exhausted = (route.on_exhausted if route is not None else None) or self.on_exhausted
        return OrderPolicy(ordered=True, park=on_exhausted == "park")

    def refuses(self, envelope: Envelope, key: str | None = None) -> DeadLetter | None:
        """What this kind refuses to send, decided from the envelope and its ordering key
        alone (no route for its type, a message over the kind's own bound): the dead letter
        the relay would record. None: nothing, as by default."""
        return None

    @classmethod
    def require_client(cls) -> None:
        """`ConfigError` naming `sink.kind` and the extra to install when the kind's client
        library is missing: `relayd run`, `relayd check` and the demo need it, the operator
        commands and the producers do not."""
        missing = [name for name in cls.client_modules if importlib.util.find_spec(name) is None]
        if missing:
            kind = cls.model_fields["kind"].default
            raise ConfigError(
                "sink.kind",
                f"kind {kind!r} needs {', '.join(missing)}, which is not installed: "
                f"install relayd[{cls.extra}] (pip install '.[{cls.extra}]' in a clone, or the "
                f"wheel with [{cls.extra}]: docs/install.md)",
            )

    def build(self, health: SinkHealth, observe: ExchangeObserver | None = None) -> Sink:
        """The sink these settings describe, reporting to `health` and `observe`;
        `relayd.core.errors.ConfigError` naming the key when a setting it needs is missing,
        or naming the extra when the kind's client library is not installed."""
        if not self._files_read:
            raise RuntimeError(
                "sink settings loaded without their files (for an operator command) cannot "
                "build a sink: load them with relayd.settings.load_settings(path)"
            )
        self.require_client()
        module, _, name = self.sink_class.partition(":")
        sink: Sink = getattr(importlib.import_module(module), name)(self, health, observe=observe)
        return sink


def endpoint(url: str) -> str:
    """Where `url` points, as `host:port` (`[v6]:port`), the port its scheme implies when it
    names none: what a connection's failure names. Never the URL's credentials, path or
    query, where a secret may stand."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    try:
        port = parts.port
    except ValueError:  # not a number: the settings refuse such a URL, kept honest here
        port = None
    if port is None:
        port = _DEFAULT_PORTS.get(parts.scheme, 0)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refusal(
    settings: SinkSettings, envelope: Envelope, stored_bytes: int, key: str | None = None
) -> DeadLetter | None:
    """Why the sink of `settings` would never send this envelope with this ordering key
    (`stored_bytes`: its text as PostgreSQL gives it back, UTF-8), or None: over
    `sink.max_envelope_bytes`, then what the kind refuses unsent. The producer runs it before
    appending; the relay records the same dead letters."""
    return too_large(stored_bytes, settings.max_envelope_bytes) or settings.refuses(envelope, key)
