"""The producer's trace context as a row carries it: valid W3C values are sent on exactly as
stored, every kind of bad value is dropped without raising, and a NATS message carries the
valid ones as headers, the same bytes on every attempt, with no way to break its header
block."""

from __future__ import annotations

import json
from typing import Any

import pytest

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION, Envelope
from relayd.core.trace_context import (
    MAX_TRACESTATE_CHARS,
    carried,
    valid_traceparent,
    valid_tracestate,
)
from relayd.producer import new_job
from relayd.sinks.nats.message import NatsMessage, Route, Routes, header_block, message_for
from tests.trace_cases import BAD_TRACES, TRACEPARENT, TRACESTATE, BadTrace


@pytest.mark.parametrize("case", BAD_TRACES, ids=lambda case: case.name)
def test_bad_trace_metadata_is_dropped_never_raised(case: BadTrace) -> None:
    """A bad traceparent drops the whole context, a bad tracestate only itself."""
    assert carried(case.meta) == case.carried


def test_the_table_holds_twenty_kinds_of_bad_traceparent() -> None:
    """The table covers at least twenty kinds of bad traceparent."""
    assert sum(case.carried == {} for case in BAD_TRACES) >= 20


@pytest.mark.parametrize(
    "value",
    [
        TRACEPARENT,
        TRACEPARENT[:-2] + "00",  # not sampled
        "01" + TRACEPARENT[2:],  # a later version, in the version 00 form
        f"00-{'f' * 32}-{'f' * 16}-ff",
    ],
)
def test_valid_traceparents_pass_unchanged(value: str) -> None:
    """A traceparent of the W3C form is taken as it is."""
    assert valid_traceparent(value) == value


@pytest.mark.parametrize(
    "value",
    [
        TRACESTATE,
        "rojo=1 , congo=2",  # optional spaces around members
        "rojo=1,,congo=2",  # an empty member
        "tenant@vendor=x,a1/b*_-=ok",
        ",".join(f"k{i}=v" for i in range(32)),
        "a=" + "b" * 255 + "," + "c=" + "d" * (MAX_TRACESTATE_CHARS - 260),
    ],
)
def test_valid_tracestates_pass_unchanged(value: str) -> None:
    """A tracestate within the standard's grammar and relayd's bounds is taken as it is."""
    assert len(value) <= MAX_TRACESTATE_CHARS
    assert valid_tracestate(value) == value


def test_a_valid_context_is_carried_whole() -> None:
    """Both values, exactly as stored; nothing for a row without them."""
    meta = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE, "other": 1}
    assert carried(meta) == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert carried({}) == {}
    assert carried({"version": 1}) == {}


def _event_envelope(meta: dict[str, Any]) -> Envelope:
    job = new_job(
        "order.updated",
        [{"order_id": 1}],
        meta={META_VERSION: 1, META_OCCURRED_AT: "2024-05-01T12:00:00Z"} | meta,
    )
    return Envelope.parse(json.dumps(job), job["id"])


def _message(envelope: Envelope) -> NatsMessage:
    message = message_for(
        envelope,
        Routes([Route("order.updated", "events.orders")]),
        stream="EVENTS",
        source="/orders",
        max_body_bytes=1024,
    )
    assert isinstance(message, NatsMessage)
    return message


def test_a_nats_message_carries_the_context_the_same_on_every_attempt() -> None:
    """traceparent and tracestate headers from the row's meta, the same message each time."""
    envelope = _event_envelope({"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    message = _message(envelope)
    assert message.headers["traceparent"] == TRACEPARENT
    assert message.headers["tracestate"] == TRACESTATE
    again = _message(Envelope.parse(json.dumps(_job_of(envelope)), envelope.id))
    assert again == message
    assert header_block(again.headers) == header_block(message.headers)


def _job_of(envelope: Envelope) -> dict[str, Any]:
    return {
        "id": envelope.id,
        "type": envelope.type,
        "args": envelope.args,
        "meta": envelope.meta,
        "options": envelope.options,
    }


@pytest.mark.parametrize("case", BAD_TRACES, ids=lambda case: case.name)
def test_bad_trace_metadata_cannot_break_a_nats_header_block(case: BadTrace) -> None:
    """A bad value is left out of the message; its header block stays one line per header."""
    message = _message(_event_envelope(case.meta))
    trace = {k: v for k, v in message.headers.items() if k in ("traceparent", "tracestate")}
    assert trace == case.carried
    block = header_block(message.headers)
    assert block.count(b"\r\n") == len(message.headers) + 2
    assert block.isascii()
