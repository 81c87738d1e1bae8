"""Envelope validation before any POST (ojs-protocol.md §1.2) and last_error hygiene."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from relayd.models import ClaimedRow, Envelope, InvalidEnvelope, clean_error
from relayd.producer import uuid7

ID = "019539a4-aaaa-7000-8000-111111111111"


def claimed(job_bytes: int = 0, **job: Any) -> ClaimedRow:
    """A claimed row for pure tests; `job_bytes` pads args to about that size."""
    event_id = uuid7()
    body: dict[str, Any] = {"id": event_id, "type": "t.x", "args": []} | job
    if job_bytes:
        filler = max(job_bytes - len(json.dumps(body)) - 4, 0)
        body["args"] = ["x" * filler]
    return ClaimedRow(
        event_id=event_id,
        job=json.dumps(body).encode(),
        attempts=1,
        previous_attempt_at=None,
        age_s=0.0,
        claimed_at=time.monotonic(),
    )


def _parse(**job: Any) -> Envelope:
    body: dict[str, Any] = {"id": ID, "type": "email.send", "args": []}
    body.update(job)
    return Envelope.parse(json.dumps({k: v for k, v in body.items() if v is not ...}), ID)


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ({"args": {"to": "x"}}, "args must be a JSON array, not an object"),
        ({"args": ...}, "args must be a JSON array, not null"),
        ({"type": "Email.Send"}, "type must match"),
        ({"type": "email-send"}, "type must match"),
        ({"type": ...}, "type must match"),
        ({"id": ID.upper()}, "id is not a lowercase UUID"),
        ({"meta": "x"}, "meta must be a JSON object, not a string"),
        ({"options": []}, "options must be a JSON object"),
        ({"options": {"queue": "Bad Queue"}}, "options.queue must match"),
        ({"queue": "UPPER"}, "queue must match"),
        ({"options": {"priority": 101}}, "options.priority must be an integer"),
        ({"options": {"priority": True}}, "options.priority must be an integer"),
    ],
)
def test_invalid_envelopes_say_what_is_wrong(job: dict[str, Any], message: str) -> None:
    """Each rule the sink would reject with a permanent 400 is caught before the POST (C6)."""
    with pytest.raises(InvalidEnvelope, match=message.replace(".", r"\.")):
        _parse(**job)


def test_not_json_and_not_an_object() -> None:
    """Stored text that is not a JSON object is invalid, not a crash."""
    with pytest.raises(InvalidEnvelope, match="not a JSON object"):
        Envelope.parse("[1]", ID)
    with pytest.raises(InvalidEnvelope, match="not JSON"):
        Envelope.parse("{", ID)


def test_effective_queue_and_batchability() -> None:
    """options.queue wins over a top-level queue; scheduling options are never batched."""
    assert _parse().queue == "default"
    assert _parse(queue="guide-jobs").queue == "guide-jobs"
    assert _parse(queue="a", options={"queue": "b"}).queue == "b"
    assert _parse().batchable
    assert not _parse(options={"delay_until": "2030-01-01T00:00:00Z"}).batchable
    assert not _parse(options={"unique": {"keys": ["type"]}}).batchable


def test_clean_error_strips_controls_and_bounds_bytes() -> None:
    """last_error holds no control characters and at most 512 UTF-8 bytes."""
    assert clean_error("a\x00b\nc\td") == "a b c d"
    long = clean_error("é" * 1000)
    assert len(long.encode()) <= 512
    assert long.endswith("...")


def test_uuid7_is_a_lowercase_version_7_uuid() -> None:
    """The producer helper's ids pass the OJS id rule."""
    value = uuid7()
    assert value == value.lower()
    assert value[14] == "7"
    assert value[19] in "89ab"
