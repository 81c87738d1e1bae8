"""The application side: typed events, checked against the sink's bounds and appended to the
outbox in the caller's transaction, together with the business change they announce
(docs/producers.md).

    OrderUpdated = define_event("order.updated", 1, OrderUpdatedV1)
    event = OrderUpdated.new(OrderUpdatedV1(order_id=42, status="paid"))  # once, outside
    async with conn.transaction():                                         # a retried callback
        await conn.execute("UPDATE orders SET status = 'paid' WHERE id = $1", 42)
        await append(conn, event, outbox=outbox)

This module holds what every driver shares and the asyncpg functions; psycopg 3 and
SQLAlchemy 2 have their own modules with the same `append` (`relayd.producer.psycopg`,
`relayd.producer.sqlalchemy`). Nothing here imports a database driver: an application pays
only for the one it uses.

`append` raises, inside the caller's transaction (which it may then roll back):

    AppendError             the event is not in the outbox; nothing was written
    ├── NotInTransaction    the connection is in no transaction: the event would commit
    │                       alone, without the business change (asyncpg, psycopg)
    ├── InvalidEvent        an envelope the table's checks or the relay would refuse (the
    │                       id is not a UUIDv7, args is not an array, a NUL in a string, ...),
    │                       or an ordering key the table would refuse (not 1 to 256
    │                       characters, a NUL)
    ├── EventTooLarge       over sink.max_envelope_bytes, or over the sink kind's own bound
    │                       (NATS: the event's data over sink.max_payload_bytes)
    ├── NoRoute             the sink kind has no route for the event (NATS: no
    │                       [[sink.routes]] for its type and version)
    ├── MissingKey          the event's route is ordered (ordering = "key") and the event has
    │                       no ordering key: the relay would dead-letter it
    └── EventIdConflict     the outbox already holds another envelope, or the same envelope
                            under another ordering key, under this id

Appending an id the outbox holds with the same envelope (by jsonb equality) and the same
ordering key does nothing: a retried transaction callback, a redelivered request. Two
transactions racing on one id end with one row: at READ COMMITTED the second waits for the
first, then finds its row (no-op or `EventIdConflict`); at REPEATABLE READ or SERIALIZABLE
PostgreSQL fails the second with a serialization failure, for the caller to retry
(docs/producers.md#idempotence).

Ordered delivery (docs/producers.md#ordered-delivery): an event may carry an ordering key
(`define_event(..., key=...)` computes it from the data, `append(..., key=...)` gives it),
stored in the row's `ordering_key`. The outbox's trigger numbers a key's rows in the order
their transactions commit, and the relay delivers them in that order, one at a time: a
keyed row is always ordered. A route's `ordering = "key"` makes the key required
(`MissingKey` without one) and decides what becomes of a key whose head fails for good.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from relayd.core import trace_context
from relayd.core.envelope import (
    MAX_QUEUE_CHARS,
    MAX_TYPE_CHARS,
    MAX_VERSION,
    META_OCCURRED_AT,
    META_VERSION,
    QUEUE_PATTERN,
    TYPE_PATTERN,
    Envelope,
    InvalidEnvelope,
)
from relayd.core.outcomes import DeadLetter, DeadReason
from relayd.core.rows import OutboxTable

# The errors live in their own module; importing them here re-exports them as the
# producer's public names (`X as X`).
from relayd.producer.errors import MAX_KEY_CHARS as MAX_KEY_CHARS
from relayd.producer.errors import AppendError as AppendError
from relayd.producer.errors import EventIdConflict as EventIdConflict
from relayd.producer.errors import EventTooLarge as EventTooLarge
from relayd.producer.errors import InvalidEvent as InvalidEvent
from relayd.producer.errors import MissingKey as MissingKey
from relayd.producer.errors import NoRoute as NoRoute
from relayd.producer.errors import NotInTransaction as NotInTransaction
from relayd.producer.errors import checked_key as checked_key
from relayd.sinks import SinkSettings, refusal, registry

if TYPE_CHECKING:
    import asyncpg


M = TypeVar("M", bound=BaseModel)

DEFAULT_TABLE = OutboxTable.parse("relayd.outbox")
# A JSON string escape of NUL that is not itself an escaped backslash: jsonb refuses it.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# The table refuses a pending row whose event_id is not a version 7, RFC 4122 variant UUID.
_UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


# --- typed events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One domain event, built once: `job` is its envelope's JSON text, fixed at build time,
    so a retried transaction callback appends the same bytes."""

    id: str
    type: str
    version: int
    occurred_at: str
    job: str
    # The ordering key (`define_event(..., key=...)`), stored in the row's `ordering_key`;
    # None: the event is not ordered.
    key: str | None = None

    @property
    def envelope(self) -> dict[str, Any]:
        """The envelope as a fresh dict: `id`, `type`, `args` (`[data]`), `meta`."""
        value: dict[str, Any] = json.loads(self.job)
        return value

    @property
    def data(self) -> Any:
        """The payload as JSON values (`args[0]`)."""
        return self.envelope["args"][0]

    @property
    def meta(self) -> dict[str, Any]:
        """The envelope's meta: version, occurred_at, and the producer's trace context."""
        value: dict[str, Any] = self.envelope["meta"]
        return value


@dataclass(frozen=True, slots=True)
class EventType(Generic[M]):
    """An event type and schema version with its payload model; `new` builds events."""

    type: str
    version: int
    model: builtins.type[M]  # the field `type` shadows the builtin here
    queue: str | None = None
    # The event's ordering key from its data; None: its events carry none.
    key: Callable[[M], str] | None = None

    def new(
        self,
        data: M | Mapping[str, Any],
        *,
        event_id: str | None = None,
        occurred_at: datetime | None = None,
    ) -> Event:
        """The event carrying `data` (validated by the model when given as a mapping), under
        `event_id` (a new UUIDv7 by default), that occurred at `occurred_at` (an aware
        datetime; now by default), with the ordering key the type's `key` function gives
        for the data, if it has one (what the function raises is passed on). The active
        OpenTelemetry span's W3C trace context, if any, goes into `meta` now, not at
        append."""
        what = f"{self.type} v{self.version}"
        if not isinstance(data, self.model):
            try:
                data = self.model.model_validate(data)
            except ValidationError as exc:
                raise InvalidEvent(
                    f"{what}: the data does not fit "
                    f"{self.model.__name__}: {exc.errors()[0]['msg']} at "
                    f"{'.'.join(str(part) for part in exc.errors()[0]['loc']) or 'top level'}"
                ) from None
            except RecursionError:
                raise InvalidEvent(f"{what}: the data nests too deep") from None
        key = None if self.key is None else checked_key(self.key(data), f"{what}: the key")
        if event_id is None:
            event_id = uuid7()
        elif not isinstance(event_id, str) or not _UUID7.match(event_id):
            raise InvalidEvent(f"event_id must be a lowercase UUIDv7, not {event_id!r}")
        when = datetime.now(UTC) if occurred_at is None else occurred_at
        if not isinstance(when, datetime) or when.tzinfo is None or when.utcoffset() is None:
            raise InvalidEvent(
                f"occurred_at must be an aware datetime (with a time zone), not {when!r}"
            )
        stamp = when.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
        meta: dict[str, Any] = {
            **trace_context.producer_meta(),
            META_VERSION: self.version,
            META_OCCURRED_AT: stamp,
        }
        try:
            # pydantic refuses data nested deeper than it serializes (a ValueError); JSON has
            # no words for NaN or an infinity (a ValueError too); a model of its own may
            # raise anything a value's serializer raises.
            envelope: dict[str, Any] = {
                "id": event_id,
                "type": self.type,
                "args": [data.model_dump(mode="json", by_alias=True)],
                "meta": meta,
            }
            if self.queue is not None:
                envelope["options"] = {"queue": self.queue}
            job = _json_text(envelope)
        except (ValueError, TypeError, RecursionError) as exc:
            raise InvalidEvent(f"{what}: the data is not JSON: {_said(exc)}") from None
        # What the relay would refuse of it (a depth beyond its bound, a lone surrogate) is
        # refused now, not at append: an event that exists can be appended.
        _checked(job)
        return Event(event_id, self.type, self.version, stamp, job, key)


def define_event(
    event_type: str,
    version: int,
    model: type[M],
    *,
    queue: str | None = None,
    key: Callable[[M], str] | None = None,
) -> EventType[M]:
    """An event type (`order.updated`), its schema version (an integer from 1) and the
    pydantic model of its data; `queue` routes it on an OJS sink (`options.queue`); `key`
    gives each event's ordering key from its data (`key=lambda data: f"order-{data.id}"`),
    a str of 1 to 256 characters: the relay delivers the events of a key in the order their
    transactions committed."""
    if not isinstance(event_type, str) or not (
        len(event_type) <= MAX_TYPE_CHARS and TYPE_PATTERN.match(event_type)
    ):
        raise InvalidEvent(
            f"an event type matches {TYPE_PATTERN.pattern} (at most {MAX_TYPE_CHARS} "
            f"characters), not {event_type!r}"
        )
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidEvent(f"{event_type}: the version is an integer, not {version!r}")
    if not 1 <= version <= MAX_VERSION:
        raise InvalidEvent(f"{event_type}: the version is from 1 to {MAX_VERSION}, not {version}")
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise InvalidEvent(f"{event_type}: the data model must be a pydantic model class")
    if queue is not None and not (len(queue) <= MAX_QUEUE_CHARS and QUEUE_PATTERN.match(queue)):
        raise InvalidEvent(
            f"{event_type}: a queue matches {QUEUE_PATTERN.pattern} (at most "
            f"{MAX_QUEUE_CHARS} characters), not {queue!r}"
        )
    if key is not None and not callable(key):
        raise InvalidEvent(
            f"{event_type}: key is a function of the data that returns the ordering key, "
            f"not a {type(key).__name__}"
        )
    return EventType(event_type, version, model, queue, key)


# --- the outbox and its bounds ------------------------------------------------------------


class Prepared(NamedTuple):
    """What `append` writes, once every check passed: the row's `event_id`, its `job` (the
    envelope's JSON text) and its `ordering_key` (None: none)."""

    event_id: str
    job: str
    key: str | None


@dataclass(frozen=True, slots=True)
class Outbox:
    """The outbox table an application appends to and the relay's sink settings its events
    are checked against: the same table, bound and routes as the relay's, from its
    configuration file (`from_config`) or given (`Outbox()`: the default table and the
    default sink's settings)."""

    table: OutboxTable = DEFAULT_TABLE
    sink: SinkSettings = field(default_factory=registry.default_settings)

    @classmethod
    def from_config(cls, path: str | Path) -> Outbox:
        """The table, bound and routes of the daemon's configuration file (its sink's
        credentials are not read); `relayd.core.errors.ConfigError` naming a bad key."""
        from relayd.settings import load_producer_sections  # noqa: PLC0415 - pydantic-settings, only when asked

        outbox, sink = load_producer_sections(path)
        return cls(outbox.outbox_table, sink)

    @classmethod
    def from_sink(
        cls, sink: SinkSettings | Mapping[str, Any], *, table: OutboxTable = DEFAULT_TABLE
    ) -> Outbox:
        """The bounds of sink settings already loaded (`Settings.sink`), or of a `[sink]`
        table given as a mapping (`{"kind": "nats", "routes": [...]}`); a mapping is
        validated as the configuration would be (`relayd.core.errors.ConfigError`)."""
        if not isinstance(sink, SinkSettings):
            from relayd.settings import sink_section  # noqa: PLC0415 - pydantic-settings, only when asked

            sink = sink_section(sink)
        return cls(table, sink)

    @property
    def max_envelope_bytes(self) -> int:
        """The sink's bound on a stored envelope (`sink.max_envelope_bytes`)."""
        return self.sink.max_envelope_bytes

    def prepare(self, event: Event | Mapping[str, Any], *, key: str | None = None) -> Prepared:
        """The event's id, envelope text and ordering key (`key`, or the event's own), once
        every bound holds; an `AppendError` saying which does not. Pure: what `append` checks
        before it writes."""
        if key is not None:
            key = checked_key(key)
        if isinstance(event, Event):
            text = event.job
            if event.key is not None:
                if key is not None and key != event.key:
                    raise InvalidEvent(
                        f"event {event.id}: the key given differs from the event's own (from "
                        "its type's key function): give one or the other"
                    )
                key = checked_key(event.key, f"event {event.id}: the ordering key")
        else:
            try:
                text = _json_text(dict(event))
            except (TypeError, ValueError) as exc:
                raise InvalidEvent(f"the envelope is not JSON: {_said(exc)}") from None
            except RecursionError:
                raise InvalidEvent("the envelope nests too deep to be JSON") from None
        envelope = _checked(text)
        if key is None and self.sink.order_policy(envelope).ordered:
            raise MissingKey(
                f"event {envelope.id}: events of type {envelope.type!r} are delivered in order "
                'per key (ordering = "key", on its route or the sink) and this one has no '
                "ordering key: give it one (append(..., key=...), or define_event(..., key=...))"
            )
        refused = refusal(self.sink, envelope, len(_stored_text(text)), key)
        if refused is not None:
            raise _append_error(refused, envelope.id)
        return Prepared(envelope.id, text, key)


def _append_error(dead: DeadLetter, event_id: str) -> AppendError:
    """What a dead letter the sink would record becomes at the source."""
    text = f"event {event_id}: {dead.error}"
    if dead.reason is DeadReason.NO_ROUTE:
        return NoRoute(text)
    if dead.reason is DeadReason.TOO_LARGE:
        return EventTooLarge(text)
    return InvalidEvent(text)


def _said(exc: BaseException) -> str:
    """An error's words, for an `InvalidEvent` (its type when it has none)."""
    return str(exc) or type(exc).__name__


def _json_text(envelope: dict[str, Any]) -> str:
    """JSON text PostgreSQL's jsonb takes: no NaN or infinities."""
    return json.dumps(envelope, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _stored_text(text: str) -> bytes:
    """The envelope as the relay reads it back (`job::text`, UTF-8): jsonb prints ", " and
    ": " between items, which the standard library's default separators also write. (A
    float Python writes in exponent form, 1e+20, is counted as written; jsonb prints its
    digits.)"""
    return json.dumps(json.loads(text), ensure_ascii=False).encode()


def _checked(text: str) -> Envelope:
    """The envelope as the relay parses it; `InvalidEvent` for what the table's checks or
    the relay would refuse."""
    if _NUL_ESCAPE.search(text):
        raise InvalidEvent("a string holds the NUL character (\\u0000), which jsonb refuses")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise InvalidEvent("a string holds a lone surrogate, which is not UTF-8") from None
    try:
        raw: Any = json.loads(text)
    except RecursionError:
        raise InvalidEvent("the envelope nests too deep to be JSON") from None
    event_id = raw.get("id") if isinstance(raw, dict) else None
    if not isinstance(event_id, str) or not _UUID7.match(event_id):
        raise InvalidEvent(
            f"id must be a lowercase UUIDv7 (relayd_event_id_is_uuidv7), not {event_id!r}"
        )
    try:
        return Envelope.parse(text, event_id)
    except InvalidEnvelope as exc:
        raise InvalidEvent(f"event {event_id}: {exc}") from None


def settle(event_id: str, same: bool | None) -> bool:
    """After an insert that found the id taken, what the stored row says: True (the same
    envelope and ordering key: nothing to do), False (gone since, deleted by retention:
    insert again), or `EventIdConflict` (another envelope or key)."""
    if same is None:
        return False
    if not same:
        raise EventIdConflict(event_id)
    return True


NO_TRANSACTION = (
    "append runs in the transaction that makes the business change; this connection is in "
    "none (asyncpg: conn.transaction(); psycopg: autocommit off, or conn.transaction())"
)

# Inserting again after the stored row vanished between the two statements (retention
# cleanup deleted it) is tried this many times in all; the race needs a deletion each time.
INSERT_TRIES = 3


def vanished(event_id: str) -> AppendError:
    """The id was taken at each insert and free at each read that followed: retention
    cleanup deleting rows faster than the append could look (`INSERT_TRIES`)."""
    return AppendError(f"event {event_id}: its stored row kept vanishing; append it again")


def statements(
    table: OutboxTable, style: Literal["$", "%s", ":"], *, keyed: bool = False
) -> tuple[str, str]:
    """The insert that does nothing on a taken id and the comparison read in a new
    statement, with placeholders in the driver's `style`: `$` (asyncpg, by position: id,
    job, then the key when `keyed`), `%s` (psycopg, by name) or `:` (SQLAlchemy's text(), by
    name; it takes no `::` after a name, hence CAST). An event without a key is written as
    before ordered delivery existed, without naming ordering_key: an application may append
    unkeyed events to an outbox not yet migrated to 0011 (the numbering trigger does not
    fire for it anyway)."""
    marks = {
        "$": ("$1", "$2", "$3"),
        "%s": ("%(id)s", "%(job)s", "%(key)s"),
        ":": (":id", ":job", ":key"),
    }[style]
    ident, body, mark = marks
    # Both are bound as text, cast in SQL: a codec the application registered for jsonb
    # (asyncpg's set_type_codec) would otherwise encode the envelope's text a second time.
    event_id, job = f"CAST(CAST({ident} AS text) AS uuid)", f"CAST(CAST({body} AS text) AS jsonb)"
    if not keyed:
        insert = (
            f"INSERT INTO {table.qualified} (event_id, job) "
            f"VALUES ({event_id}, {job}) ON CONFLICT (event_id) DO NOTHING RETURNING true"
        )
        # The key is part of the event: the same envelope stored under a key is a conflict.
        # Read from the row as JSON, so that an outbox without the column answers too.
        compare = (
            f"SELECT job = {job} AND to_jsonb(o) ->> 'ordering_key' IS NULL "
            f"FROM {table.qualified} AS o WHERE event_id = {event_id}"
        )
        return insert, compare
    key = f"CAST({mark} AS text)"
    insert = (
        f"INSERT INTO {table.qualified} (event_id, job, ordering_key) "
        f"VALUES ({event_id}, {job}, {key}) ON CONFLICT (event_id) DO NOTHING RETURNING true"
    )
    # The key is part of the event: the same envelope under another key is a conflict.
    compare = (
        f"SELECT job = {job} AND ordering_key IS NOT DISTINCT FROM {key} "
        f"FROM {table.qualified} WHERE event_id = {event_id}"
    )
    return insert, compare


# --- asyncpg ------------------------------------------------------------------------------

# `relayd.outbox` with the daemon's default bound: what `append` checks unless told otherwise.
DEFAULT_OUTBOX = Outbox()


async def append(
    conn: asyncpg.Connection,
    event: Event | Mapping[str, Any],
    *,
    outbox: Outbox = DEFAULT_OUTBOX,
    key: str | None = None,
) -> None:
    """Append `event` in `conn`'s transaction (asyncpg) under its ordering key (`key`, or
    the event's own; None: none); a no-op if the outbox holds the same envelope and key
    under its id. `AppendError` (module docstring) if it cannot."""
    event_id, job, ordering_key = outbox.prepare(event, key=key)
    if not conn.is_in_transaction():
        raise NotInTransaction(NO_TRANSACTION)
    keyed = ordering_key is not None
    insert, compare = statements(outbox.table, "$", keyed=keyed)
    args = (event_id, job, ordering_key) if keyed else (event_id, job)
    for _ in range(INSERT_TRIES):
        if await conn.fetchval(insert, *args) is not None:
            return
        if settle(event_id, await conn.fetchval(compare, *args)):
            return
    raise vanished(event_id)


def uuid7(now_s: float | None = None) -> str:
    """A new lowercase UUIDv7 (RFC 9562): 48-bit Unix milliseconds (of `now_s` if given, for
    a caller with its own clock), then 74 random bits."""
    millis = time.time_ns() // 1_000_000 if now_s is None else int(now_s * 1000)
    value = millis << 80 | int.from_bytes(os.urandom(10))
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    text = f"{value:032x}"  # str(uuid.UUID(int=value)), without building the object
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def new_job(
    job_type: str,
    args: list[Any],
    *,
    queue: str | None = None,
    meta: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    job_id: str | None = None,
) -> dict[str, Any]:
    """An OJS enqueue request with a fresh UUIDv7; routing goes under `options` (OJS binding).
    The active OpenTelemetry span's W3C trace context, if any, goes into `meta` now, as
    `EventType.new` does; a `traceparent` or `tracestate` given in `meta` is kept instead."""
    job: dict[str, Any] = {"id": job_id or uuid7(), "type": job_type, "args": args}
    merged_meta = {**trace_context.producer_meta(), **(meta or {})}
    if merged_meta:
        job["meta"] = merged_meta
    merged = dict(options or {})
    if queue is not None:
        merged["queue"] = queue
    if merged:
        job["options"] = merged
    return job


async def enqueue(
    conn: asyncpg.Connection,
    job: dict[str, Any],
    *,
    table: OutboxTable | str = "relayd.outbox",
    key: str | None = None,
) -> str:
    """Insert one envelope under the ordering key `key` (None: none); call it inside the
    transaction that makes the business change. Unchecked and not idempotent (a taken id
    fails on the primary key): `append` is both. Only the key is checked (`InvalidEvent`)."""
    await enqueue_many(conn, [job], table=table, keys=None if key is None else [key])
    return str(job["id"])


async def enqueue_many(
    conn: asyncpg.Connection,
    jobs: Iterable[dict[str, Any]],
    *,
    table: OutboxTable | str = "relayd.outbox",
    keys: Iterable[str | None] | None = None,
) -> int:
    """Insert many envelopes in one statement (one round trip); returns how many. `keys`
    gives each job's ordering key, in the jobs' order (None for a job without one); the
    jobs of one key are numbered in that order. Only the keys are checked (`InvalidEvent`).

    One statement, not one per row: PostgreSQL prepares the outbox's CHECK constraints and
    fires its NOTIFY trigger once per statement, which made ten single-row INSERTs cost
    about 2.5 times the server CPU per row of one ten-row INSERT (docs/performance.md)."""
    outbox = table if isinstance(table, OutboxTable) else OutboxTable.parse(table)
    ids: list[str] = []
    texts: list[str] = []
    for job in jobs:
        ids.append(job["id"])
        texts.append(json.dumps(job))
    ordering_keys: list[str | None] | None = None
    if keys is not None:
        ordering_keys = [
            None if key is None else checked_key(key, f"job {index}: the ordering key")
            for index, key in enumerate(keys)
        ]
        if len(ordering_keys) != len(ids):
            raise InvalidEvent(
                f"{len(ids)} jobs and {len(ordering_keys)} keys: give one key (or None) per job"
            )
    if ids:
        # Bound as text and cast in SQL, as `append` does (an application's jsonb codec).
        # Without keys, the statement as before keys (it names no ordering_key: an outbox
        # not yet migrated to 0011 takes it). With keys, ORDER BY the jobs' places: the
        # numbering trigger fires row by row, and nothing else promises unnest's order.
        if ordering_keys is None or all(k is None for k in ordering_keys):
            await conn.execute(
                f"INSERT INTO {outbox.qualified} (event_id, job) "
                "SELECT CAST(i AS uuid), CAST(j AS jsonb) "
                "FROM unnest($1::text[], $2::text[]) AS r(i, j)",
                ids,
                texts,
            )
        else:
            await conn.execute(
                f"INSERT INTO {outbox.qualified} (event_id, job, ordering_key) "
                "SELECT CAST(i AS uuid), CAST(j AS jsonb), k "
                "FROM unnest($1::text[], $2::text[], $3::text[]) "
                "WITH ORDINALITY AS r(i, j, k, n) ORDER BY n",
                ids,
                texts,
                ordering_keys,
            )
    return len(ids)
