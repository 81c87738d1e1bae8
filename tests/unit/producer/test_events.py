"""Typed events and the bounds an event is checked against before it is appended: the
envelope every sink reads, the trace context taken when it is built, and each refusal as
the error class a producer catches (relayd/producer/__init__.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel, Field

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION, DomainEvent, Envelope
from relayd.core.errors import ConfigError
from relayd.producer import (
    AppendError,
    Event,
    EventIdConflict,
    EventTooLarge,
    InvalidEvent,
    NoRoute,
    Outbox,
    define_event,
    new_job,
    settle,
    uuid7,
)
from relayd.sinks.nats.message import NatsMessage, Route, Routes, message_for

ROOT = Path(__file__).resolve().parents[3]


def _nested_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


class OrderUpdatedV1(BaseModel):
    order_id: int
    status: str
    note: str = Field(default="", alias="orderNote")


OrderUpdated = define_event("order.updated", 1, OrderUpdatedV1)
AT = datetime(2024, 5, 1, 14, 0, 0, 500000, tzinfo=timezone(timedelta(hours=2)))


def test_an_event_is_the_envelope_every_sink_reads() -> None:
    """`new` builds `type`, `args = [data]` and meta version and occurred_at, which
    `DomainEvent.of` reads back."""
    event_id = uuid7()
    event = OrderUpdated.new(
        OrderUpdatedV1(order_id=42, status="paid"), event_id=event_id, occurred_at=AT
    )
    assert event.envelope == {
        "id": event_id,
        "type": "order.updated",
        "args": [{"order_id": 42, "status": "paid", "orderNote": ""}],
        "meta": {META_VERSION: 1, META_OCCURRED_AT: "2024-05-01T12:00:00.500000Z"},
    }
    read = DomainEvent.of(Envelope.parse(event.job, event_id))
    assert read == DomainEvent(
        id=event_id,
        type="order.updated",
        version=1,
        occurred_at="2024-05-01T12:00:00.500000Z",
        data={"order_id": 42, "status": "paid", "orderNote": ""},
    )
    assert OrderUpdatedV1.model_validate(read.data) == OrderUpdatedV1(order_id=42, status="paid")


def test_the_nats_sink_sends_the_events_data_and_time() -> None:
    """The NATS sink publishes an event's data as its body and its time and version as
    CloudEvents headers, on its type's route."""
    event = OrderUpdated.new({"order_id": 42, "status": "paid"}, occurred_at=AT)
    message = message_for(
        Envelope.parse(event.job, event.id),
        Routes([Route("order.updated", "events.orders")]),
        stream="EVENTS",
        source="shop",
        max_body_bytes=1024,
    )
    assert isinstance(message, NatsMessage)
    assert message.subject == "events.orders"
    assert json.loads(message.body) == {"order_id": 42, "status": "paid", "orderNote": ""}
    assert message.headers["ce-time"] == "2024-05-01T12:00:00.500000Z"
    assert message.headers["ce-dataversion"] == "1"
    assert message.headers["Nats-Msg-Id"] == event.id


def test_defaults_are_a_new_uuidv7_and_now() -> None:
    """Without an id or a time, an event gets a fresh UUIDv7 and the current UTC time."""
    before = datetime.now(UTC)
    first = OrderUpdated.new({"order_id": 1, "status": "paid"})
    second = OrderUpdated.new({"order_id": 1, "status": "paid"})
    after = datetime.now(UTC)
    assert first.id != second.id
    assert first.id[14] == "7"
    assert first.occurred_at.endswith("Z")
    assert before <= datetime.fromisoformat(first.occurred_at) <= after


def test_an_event_is_immutable() -> None:
    """An event's fields cannot be set, and changing its envelope's dict changes nothing."""
    event = OrderUpdated.new({"order_id": 1, "status": "paid"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.id = uuid7()  # type: ignore[misc]
    event.envelope["args"][0]["status"] = "changed"
    event.data["status"] = "changed"
    assert event.data["status"] == "paid"


def test_a_queue_routes_the_event_on_an_ojs_sink() -> None:
    """`define_event(..., queue=)` puts the queue under `options.queue`."""
    shipped = define_event("order.shipped", 2, OrderUpdatedV1, queue="orders")
    event = shipped.new({"order_id": 1, "status": "shipped"})
    assert Envelope.parse(event.job, event.id).queue == "orders"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("Order.Updated", 1), "an event type matches"),
        (("order..updated", 1), "an event type matches"),
        (("o" * 256, 1), "at most 255"),
        (("order.updated", 0), "from 1 to 2147483647"),
        (("order.updated", 2**31), "from 1 to 2147483647"),
        (("order.updated", True), "an integer"),
        (("order.updated", "1"), "an integer"),
    ],
)
def test_define_event_refuses_what_no_sink_reads(arguments: tuple[Any, Any], message: str) -> None:
    """A type or version the envelope's rules refuse fails at definition."""
    with pytest.raises(InvalidEvent, match=message):
        define_event(*arguments, OrderUpdatedV1)


def test_define_event_refuses_a_bad_model_or_queue() -> None:
    """The data model is a pydantic class; a queue matches the OJS pattern."""
    with pytest.raises(InvalidEvent, match="pydantic model class"):
        define_event("order.updated", 1, dict)  # type: ignore[type-var]
    with pytest.raises(InvalidEvent, match="a queue matches"):
        define_event("order.updated", 1, OrderUpdatedV1, queue="Orders!")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data": {"order_id": "x", "status": "paid"}}, "does not fit OrderUpdatedV1"),
        ({"event_id": "0190a0e4-7d3a-4b5c-8d6e-0123456789ab"}, "UUIDv7"),
        ({"event_id": "0190A0E4-7D3A-7B5C-8D6E-0123456789AB"}, "UUIDv7"),
        ({"occurred_at": datetime(2024, 5, 1, 12, 0)}, "aware datetime"),
    ],
)
def test_new_refuses_bad_data_ids_and_times(kwargs: dict[str, Any], message: str) -> None:
    """Data the model refuses, an id that is no lowercase UUIDv7, a naive time: refused."""
    data = kwargs.pop("data", {"order_id": 1, "status": "paid"})
    with pytest.raises(InvalidEvent, match=message):
        OrderUpdated.new(data, **kwargs)


class Anything(BaseModel):
    """A model whose one field takes any value: what the data can hold is the serializer's
    to refuse."""

    value: Any


Anything_ = define_event("thing.happened", 1, Anything)


@pytest.mark.parametrize(
    ("data", "kwargs", "message"),
    [
        ({"value": _nested_list(300)}, {}, "Maximum serialization depth exceeded"),
        ({"value": object()}, {}, "Unable to serialize unknown type"),
        ({"value": "a\x00b"}, {}, "NUL character"),
        ({"value": "\ud800"}, {}, "lone surrogate"),
        # The deepest pydantic serializes, inside the envelope: over the relay's bound.
        ({"value": _nested_list(254)}, {}, "nested deeper than 256 levels"),
        ({"value": 1}, {"occurred_at": "2024-05-01T12:00:00Z"}, "aware datetime"),
        ({"value": 1}, {"event_id": 7}, "UUIDv7"),
        ([1, 2], {}, "does not fit Anything"),
    ],
    ids=[
        "deeper-than-pydantic",
        "unserializable",
        "nul",
        "surrogate",
        "deeper-than-the-relay",
        "time-as-text",
        "id-as-number",
        "not-a-mapping",
    ],
)
def test_every_failure_of_new_is_an_append_error(
    data: Any, kwargs: dict[str, Any], message: str
) -> None:
    """Whatever the data, the id or the time holds, `new` raises an `InvalidEvent` (an
    `AppendError`) saying why, never pydantic's or the JSON encoder's own error."""
    with pytest.raises(InvalidEvent, match=message) as raised:
        Anything_.new(data, **kwargs)
    assert isinstance(raised.value, AppendError)


class Measured(BaseModel):
    value: float


def test_an_infinite_float_is_an_append_error() -> None:
    """A float field holding an infinity (pydantic keeps it; JSON has no word for it)."""
    with pytest.raises(InvalidEvent, match="Out of range float values are not JSON compliant"):
        define_event("thing.measured", 1, Measured).new({"value": float("inf")})


def test_meta_carries_the_active_span() -> None:
    """Built under an active OpenTelemetry span, an event's meta holds its traceparent."""
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("checkout") as span:
        event = OrderUpdated.new({"order_id": 1, "status": "paid"})
    context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert event.meta["traceparent"] == expected
    assert DomainEvent.of(Envelope.parse(event.job, event.id)).version == 1


def test_meta_holds_no_trace_without_a_span() -> None:
    """Without an active span, nothing about tracing is stored."""
    event = OrderUpdated.new({"order_id": 1, "status": "paid"})
    assert set(event.meta) == {META_VERSION, META_OCCURRED_AT}


def test_a_plain_job_carries_the_active_span_as_an_event_does() -> None:
    """`new_job` under an active span: its meta holds the span's traceparent beside the
    caller's entries; a traceparent the caller gives is kept; without a span, no meta is
    added."""
    tracer = TracerProvider().get_tracer("test")
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracer.start_as_current_span("checkout") as span:
        job = new_job("order.fulfill", [{"order_id": 1}], meta={"correlation_id": "c-1"})
        event = OrderUpdated.new({"order_id": 1, "status": "paid"})
        propagated = new_job("order.fulfill", [], meta={"traceparent": given})
    context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert job["meta"] == {"traceparent": expected, "correlation_id": "c-1"}
    assert job["meta"]["traceparent"] == event.meta["traceparent"]
    assert propagated["meta"] == {"traceparent": given}
    assert "meta" not in new_job("order.fulfill", [])


def test_the_docs_list_every_public_attribute_of_an_event() -> None:
    """docs/producers.md's table of an `Event`'s attributes names each of its fields and
    properties, and nothing else, so that the two cannot drift."""
    docs = (ROOT / "docs/producers.md").read_text()
    table = docs.split("An `Event` (`relayd.producer.Event`", 1)[1].split("\n\n", 2)[1]
    documented = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    fields = [field.name for field in dataclasses.fields(Event)]
    properties = [name for name, value in vars(Event).items() if isinstance(value, property)]
    assert documented == fields + properties


def _job(**fields: Any) -> dict[str, Any]:
    job = new_job("order.updated", [{"order_id": 1}], meta={"version": 1})
    job.update(fields)
    return job


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (_job(id="0190a0e4-7d3a-4b5c-8d6e-0123456789ab"), "UUIDv7"),
        (_job(id=None), "UUIDv7"),
        (_job(args={"order_id": 1}), "args must be a JSON array, not an object"),
        (_job(meta=[1]), "meta must be a JSON object"),
        (_job(type=7), "type must match"),
        (_job(options={"queue": "Bad Queue"}), "options.queue must match"),
        (_job(options={"priority": 101}), "options.priority"),
        (_job(args=["a\x00b"]), "NUL character"),
        (_job(args=["\ud800"]), "lone surrogate"),
        (_job(args=[float("nan")]), "not JSON"),
        (_job(args=[object()]), "not JSON"),
        (_job(args=_nested_list(300)), "nested deeper than 256"),
        (_job(args=_nested_list(100_000)), "nests too deep"),
    ],
    ids=[
        "uuidv4",
        "no-id",
        "args-object",
        "meta-array",
        "type-number",
        "bad-queue",
        "priority",
        "nul",
        "surrogate",
        "nan",
        "object",
        "deep",
        "too-deep-for-json",
    ],
)
def test_envelopes_the_table_or_relay_refuse_fail_at_append(
    job: dict[str, Any], message: str
) -> None:
    """What the table's checks or the relay would refuse is `InvalidEvent` at the source."""
    with pytest.raises(InvalidEvent, match=message) as raised:
        Outbox().prepare(job)
    assert isinstance(raised.value, AppendError)


def test_an_escaped_backslash_before_u0000_is_no_nul() -> None:
    """The text `\\u0000` (a backslash, then letters) is fine: only NUL itself is refused."""
    job = _job(args=["\\u0000"])
    assert Outbox().prepare(job) == (job["id"], json.dumps(job, separators=(",", ":")), None)


def test_an_envelope_over_the_sink_bound_is_too_large() -> None:
    """An envelope over `max_envelope_bytes` is `EventTooLarge`, naming size and bound."""
    event = OrderUpdated.new({"order_id": 1, "status": "x" * 2000})
    with pytest.raises(EventTooLarge, match=r"over sink.max_envelope_bytes \(1024\)"):
        Outbox.from_sink({"max_envelope_bytes": 1024}).prepare(event)
    assert Outbox.from_sink({"max_envelope_bytes": 4096}).prepare(event) == (
        event.id,
        event.job,
        None,
    )


# The checks of a NATS sink's own kind (`NatsSettings.refuses`), from its `[sink]` table.
NATS = Outbox.from_sink(
    {
        "kind": "nats",
        "routes": [
            {"type": "order.updated", "subject": "events.orders"},
            {"type": "order.paid", "subject": "paid.v2", "version": 2},
        ],
        "max_payload_bytes": 100,
    }
)


def test_nats_takes_a_routed_event_within_its_bounds() -> None:
    """A routed event with small data passes the NATS sink's checks."""
    event = OrderUpdated.new({"order_id": 1, "status": "paid"})
    assert NATS.prepare(event) == (event.id, event.job, None)


@pytest.mark.parametrize(
    ("event", "error", "message"),
    [
        (
            define_event("order.created", 1, OrderUpdatedV1).new({"order_id": 1, "status": ""}),
            NoRoute,
            "no route for type 'order.created' version 1",
        ),
        (
            define_event("order.paid", 1, OrderUpdatedV1).new({"order_id": 1, "status": ""}),
            NoRoute,
            "no route for type 'order.paid' version 1",
        ),
        (
            OrderUpdated.new({"order_id": 1, "status": "x" * 100}),
            EventTooLarge,
            r"over sink.max_payload_bytes \(100\)",
        ),
        (_job(args=[1, 2]), InvalidEvent, "exactly one element"),
        (_job(meta={}), InvalidEvent, "meta.version is missing"),
    ],
    ids=["no-route", "no-route-for-version", "body-too-large", "two-args", "no-version"],
)
def test_nats_refusals_fail_at_append(event: Any, error: type[AppendError], message: str) -> None:
    """What the NATS sink would dead-letter unsent fails at the source, by kind."""
    with pytest.raises(error, match=message):
        NATS.prepare(event)


@pytest.mark.parametrize(
    ("same", "done"), [(True, True), (None, False)], ids=["same-envelope", "row-gone"]
)
def test_settle_after_a_taken_id(same: bool | None, done: bool) -> None:
    """The same stored envelope ends the append; a row gone since (retention) inserts again."""
    assert settle(uuid7(), same) is done


def test_settle_on_another_envelope_is_a_conflict() -> None:
    """Another stored envelope under the id is `EventIdConflict`."""
    event_id = uuid7()
    with pytest.raises(EventIdConflict, match=event_id):
        settle(event_id, same=False)


def test_event_id_conflict_names_the_id() -> None:
    """`EventIdConflict` carries and names the id."""
    event_id = uuid7()
    conflict = EventIdConflict(event_id)
    assert conflict.event_id == event_id
    assert event_id in str(conflict)
    assert isinstance(conflict, AppendError)


NATS_CONFIG = """
[database]
dsn_file = "/nonexistent/dsn"

[outbox]
table = "app.events"

[sink]
kind = "nats"
servers = ["nats://127.0.0.1:4222"]
stream = "EVENTS"
user = "relay"
password_file = "/nonexistent/password"
ca_file = "/nonexistent/ca.pem"
max_envelope_bytes = 2048
max_payload_bytes = 64

[[sink.routes]]
type = "order.updated"
subject = "events.orders"
"""


def test_from_config_reads_the_daemons_file_without_its_secrets(tmp_path: Path) -> None:
    """The table, bound and routes come from the daemon's file; secret files are not read."""
    config = tmp_path / "relayd.toml"
    config.write_text(NATS_CONFIG)
    outbox = Outbox.from_config(config)
    assert str(outbox.table) == "app.events"
    assert outbox.max_envelope_bytes == 2048
    event = OrderUpdated.new({"order_id": 1, "status": "paid"})
    assert outbox.prepare(event) == (event.id, event.job, None)
    unrouted = define_event("order.paid", 1, OrderUpdatedV1)
    with pytest.raises(NoRoute):
        outbox.prepare(unrouted.new({"order_id": 1, "status": ""}))
    with pytest.raises(EventTooLarge, match=r"max_payload_bytes \(64\)"):
        outbox.prepare(OrderUpdated.new({"order_id": 1, "status": "x" * 64}))


def test_from_config_of_an_ojs_sink(tmp_path: Path) -> None:
    """An OJS sink gives the envelope bound and no routes; its token file is not read."""
    config = tmp_path / "relayd.toml"
    config.write_text('[sink]\nurl = "http://ojs"\ntoken_file = "/nonexistent/token"\n')
    outbox = Outbox.from_config(config)
    assert (outbox.table, outbox.max_envelope_bytes) == (Outbox().table, 1024 * 1024)
    assert outbox.sink.kind == "ojs"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[outbox]\ntable = "Bad-Name"\n', "outbox.table"),
        (
            '[sink]\nkind = "nats"\n[[sink.routes]]\ntype = "Bad"\nsubject = "x"\n',
            "sink.routes.0.type",
        ),
        ('[sink]\nkind = "carrier-pigeon"\n', "sink.kind"),
        ("[sink\n", "config"),
    ],
)
def test_from_config_names_a_bad_key(tmp_path: Path, text: str, key: str) -> None:
    """A bad table, route or kind, or a broken file, is a `ConfigError` naming the key."""
    config = tmp_path / "relayd.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as raised:
        Outbox.from_config(config)
    assert raised.value.key == key


def test_from_config_of_a_missing_file(tmp_path: Path) -> None:
    """A file that is not there is an error, not the defaults."""
    with pytest.raises(ConfigError, match="file not found"):
        Outbox.from_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("relayd.producer", ("asyncpg", "psycopg", "sqlalchemy", "opentelemetry")),
        ("relayd.producer.psycopg", ("asyncpg", "sqlalchemy", "opentelemetry")),
        ("relayd.producer.sqlalchemy", ("asyncpg", "psycopg", "opentelemetry")),
    ],
)
def test_importing_a_producer_imports_no_other_driver(module: str, absent: tuple[str, ...]) -> None:
    """`relayd.producer` imports no driver; each driver's module imports only its own."""
    code = (
        f"import sys, {module}\nprint(sorted(name for name in {absent!r} if name in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
