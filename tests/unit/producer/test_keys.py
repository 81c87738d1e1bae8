"""Ordering keys as a producer gives them: a key function per event type, `key=` at append,
the bounds the table puts on a key, and the ordered route that refuses an event without one
(`MissingKey`)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from relayd.producer import (
    AppendError,
    Event,
    InvalidEvent,
    MissingKey,
    Outbox,
    Prepared,
    define_event,
    new_job,
)

AT = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


class OrderUpdatedV1(BaseModel):
    order_id: int
    status: str


# An event type without a key function.
OrderUpdated = define_event("order.updated", 1, OrderUpdatedV1)


class OrderChangedV1(BaseModel):
    order_ref: Any
    status: str = "paid"


# The ordering key is the data's order_ref, whatever it holds: what the table refuses of it
# is the producer's to refuse first.
OrderChanged = define_event("order.changed", 1, OrderChangedV1, key=lambda data: data.order_ref)


def test_a_key_function_gives_each_event_its_key() -> None:
    """`define_event(..., key=)` computes each event's key from its validated data; the key
    is the event's, not its envelope's: the envelope is the same with or without one."""
    event = OrderChanged.new({"order_ref": "order-42"}, occurred_at=AT)
    assert event.key == "order-42"
    assert Outbox().prepare(event) == Prepared(event.id, event.job, "order-42")
    unkeyed = define_event("order.changed", 1, OrderChangedV1).new(
        {"order_ref": "order-42"}, event_id=event.id, occurred_at=AT
    )
    assert unkeyed.key is None
    assert unkeyed.job == event.job


def test_append_gives_a_key_to_what_has_none() -> None:
    """`key=` at append keys a plain job or an event without a key function; given to an
    event that has one, it must be the same."""
    job = new_job("order.fulfill", [{"order_id": 1}])
    assert Outbox().prepare(job, key="order-1") == (job["id"], _text(job), "order-1")
    event = OrderUpdated.new({"order_id": 1, "status": "paid"})
    assert Outbox().prepare(event, key="order-1").key == "order-1"
    keyed = OrderChanged.new({"order_ref": "order-1"})
    assert Outbox().prepare(keyed, key="order-1").key == "order-1"
    with pytest.raises(InvalidEvent, match="the key given differs from the event's own"):
        Outbox().prepare(keyed, key="order-2")


def _text(job: dict[str, Any]) -> str:
    return json.dumps(job, separators=(",", ":"))


# What the table's CHECK (1 to 256 characters) or PostgreSQL's text would refuse of a key.
BAD_KEYS: dict[str, tuple[Any, str]] = {
    "empty": ("", "is empty: a key is 1 to 256 characters"),
    "257-characters": ("k" * 257, "is 257 characters long: a key is 1 to 256 characters"),
    "nul": ("order\x00-1", "holds the NUL character, which PostgreSQL text refuses"),
    "lone-surrogate": ("order-\ud800", "holds a lone surrogate, which is not UTF-8"),
    "number": (42, "must be a str, not int"),
    "bytes": (b"order-1", "must be a str, not bytes"),
    "none-from-a-function": (None, "must be a str, not None"),
}


@pytest.mark.parametrize(
    "bad", sorted(name for name, (key, _) in BAD_KEYS.items() if key is not None)
)
def test_a_bad_key_is_refused_at_append(bad: str) -> None:
    """A key given at append that the table would refuse is `InvalidEvent`, saying why
    (without the key itself: it is the application's data). None is no key."""
    key, message = BAD_KEYS[bad]
    with pytest.raises(InvalidEvent, match=f"^the ordering key {re.escape(message)}$"):
        Outbox().prepare(new_job("order.fulfill", []), key=key)


@pytest.mark.parametrize("bad", sorted(BAD_KEYS))
def test_a_bad_key_from_a_key_function_is_refused_by_new(bad: str) -> None:
    """A key function's result the table would refuse fails `new` with `InvalidEvent`,
    naming the event type."""
    key, message = BAD_KEYS[bad]
    with pytest.raises(
        InvalidEvent, match=f"^{re.escape(f'order.changed v1: the key {message}')}$"
    ):
        OrderChanged.new({"order_ref": key})


@pytest.mark.parametrize("length", [1, 256])
def test_a_key_of_1_to_256_characters_is_taken(length: int) -> None:
    """The bounds themselves, counted in characters as PostgreSQL's length() counts them
    (not bytes: `é` is one character, two bytes)."""
    key = "é" * length
    assert OrderChanged.new({"order_ref": key}).key == key
    assert Outbox().prepare(new_job("order.fulfill", []), key=key).key == key


def test_an_event_built_by_hand_is_checked_at_append() -> None:
    """An `Event` constructed directly, not by `new`, has its key checked by `append`."""
    valid = OrderChanged.new({"order_ref": "order-1"})
    forged = Event(valid.id, valid.type, valid.version, valid.occurred_at, valid.job, "")
    with pytest.raises(InvalidEvent, match=f"event {valid.id}: the ordering key is empty"):
        Outbox().prepare(forged)


def test_define_event_refuses_a_key_that_is_no_function() -> None:
    """`key` is a function of the data, not the key itself."""
    with pytest.raises(InvalidEvent, match="key is a function of the data"):
        define_event("order.changed", 1, OrderChangedV1, key="order-1")  # type: ignore[arg-type]


def test_what_a_key_function_raises_is_passed_on() -> None:
    """A key function that fails is the application's code failing: its error, unchanged."""

    def broken(data: OrderChangedV1) -> str:
        raise LookupError(data.status)

    with pytest.raises(LookupError, match="paid"):
        define_event("order.changed", 1, OrderChangedV1, key=broken).new({"order_ref": "x"})


# Sink settings with an ordered route, of each kind that has routes, and an OJS sink that
# orders everything (`[sink] ordering = "key"`: OJS has no routes).
ORDERED: dict[str, dict[str, Any]] = {
    "ojs": {"kind": "ojs", "ordering": "key"},
    "webhook": {
        "kind": "webhook",
        "url": "https://hooks.example.com/all",
        "routes": [
            {"type": "order.changed", "url": "https://hooks.example.com/o", "ordering": "key"},
            {"type": "order.updated", "url": "https://hooks.example.com/u"},
        ],
    },
    "nats": {
        "kind": "nats",
        "routes": [
            {"type": "order.changed", "subject": "events.orders", "ordering": "key"},
            {"type": "order.updated", "subject": "events.updates"},
        ],
    },
}


@pytest.mark.parametrize("kind", sorted(ORDERED))
def test_an_ordered_route_refuses_an_event_without_a_key(kind: str) -> None:
    """An event whose route says `ordering = "key"` (for OJS, the sink) and that has no
    key is `MissingKey`, an `AppendError`, naming the event and its type; with a key it
    passes."""
    outbox = Outbox.from_sink(ORDERED[kind])
    event = define_event("order.changed", 1, OrderChangedV1).new({"order_ref": "order-1"})
    with pytest.raises(
        MissingKey, match=re.escape(f"event {event.id}: events of type 'order.changed'")
    ):
        outbox.prepare(event)
    assert issubclass(MissingKey, AppendError)
    assert outbox.prepare(event, key="order-1").key == "order-1"
    keyed = OrderChanged.new({"order_ref": "order-1"})
    assert outbox.prepare(keyed) == (keyed.id, keyed.job, "order-1")


@pytest.mark.parametrize("kind", ["webhook", "nats"])
def test_an_unordered_route_takes_an_event_with_or_without_a_key(kind: str) -> None:
    """Beside an ordered route, an unordered one needs no key; a key given is stored all the
    same (a keyed row is always delivered in order)."""
    outbox = Outbox.from_sink(ORDERED[kind])
    event = OrderUpdated.new({"order_id": 1, "status": "paid"})
    assert outbox.prepare(event) == (event.id, event.job, None)
    assert outbox.prepare(event, key="order-1") == (event.id, event.job, "order-1")


def test_a_route_may_be_unordered_on_an_ordered_sink() -> None:
    """`[sink] ordering = "key"` orders every route but one that says `ordering = "none"`."""
    outbox = Outbox.from_sink(
        {
            "kind": "webhook",
            "url": "https://hooks.example.com/all",
            "ordering": "key",
            "routes": [
                {"type": "order.updated", "url": "https://hooks.example.com/u", "ordering": "none"}
            ],
        }
    )
    updated = OrderUpdated.new({"order_id": 1, "status": "paid"})
    assert outbox.prepare(updated).key is None
    with pytest.raises(MissingKey):  # no route: the sink's url, and its ordering
        outbox.prepare(define_event("order.changed", 1, OrderChangedV1).new({"order_ref": "x"}))


def test_a_key_that_cannot_stand_in_its_subject_is_refused_at_append() -> None:
    """A NATS route whose subject holds the key (`events.orders.{key}`) takes only keys
    that are one subject token: another is `InvalidEvent` here, as the relay would
    dead-letter it `invalid_envelope`."""
    outbox = Outbox.from_sink(
        {
            "kind": "nats",
            "routes": [
                {"type": "order.changed", "subject": "events.orders.{key}", "ordering": "key"}
            ],
        }
    )
    event = define_event("order.changed", 1, OrderChangedV1).new({"order_ref": "x"})
    assert outbox.prepare(event, key="order-1").key == "order-1"
    with pytest.raises(InvalidEvent, match=re.escape("the ordering key 'order 1' cannot stand")):
        outbox.prepare(event, key="order 1")
    with pytest.raises(MissingKey):
        outbox.prepare(event)


def test_without_sink_settings_no_key_is_required() -> None:
    """`Outbox()` (the default sink's settings: nothing ordered) requires no key."""
    event = define_event("order.changed", 1, OrderChangedV1).new({"order_ref": "x"})
    assert Outbox().prepare(event).key is None


def test_from_config_reads_a_routes_ordering(tmp_path: Path) -> None:
    """An ordered route of the daemon's file is required a key, as `from_sink`'s is (its
    credential files are never read)."""
    config = tmp_path / "relayd.toml"
    config.write_text(
        '[database]\ndsn_file = "/nonexistent/dsn"\n\n'
        '[sink]\nkind = "nats"\nservers = ["nats://127.0.0.1:4222"]\nstream = "EVENTS"\n'
        'user = "relay"\npassword_file = "/nonexistent/password"\n\n'
        '[[sink.routes]]\ntype = "order.updated"\nsubject = "events.orders"\n\n'
        '[[sink.routes]]\ntype = "order.changed"\nsubject = "events.changes"\n'
        'ordering = "key"\non_exhausted = "skip"\n'
    )
    outbox = Outbox.from_config(config)
    with pytest.raises(MissingKey, match=re.escape("'order.changed'")):
        outbox.prepare(define_event("order.changed", 1, OrderChangedV1).new({"order_ref": "x"}))
    keyed = OrderChanged.new({"order_ref": "order-1"})
    assert outbox.prepare(keyed).key == "order-1"
    updated = OrderUpdated.new({"order_id": 1, "status": "paid"})
    assert outbox.prepare(updated).key is None
