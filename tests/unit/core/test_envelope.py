"""Envelope validation before any POST (docs/ojs.md#the-request) and last_error hygiene."""

from __future__ import annotations

import json
import sys
from decimal import Decimal
from typing import Any

import pytest

from relayd.core.envelope import Envelope, InvalidEnvelope
from relayd.core.outcomes import clean_error
from relayd.producer import uuid7
from relayd.sinks.ojs.answers import batchable

ID = "019539a4-aaaa-7000-8000-111111111111"


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
    assert _parse(queue="gateway-jobs").queue == "gateway-jobs"
    assert _parse(queue="a", options={"queue": "b"}).queue == "b"
    assert batchable(_parse())
    assert not batchable(_parse(options={"delay_until": "2030-01-01T00:00:00Z"}))
    assert not batchable(_parse(options={"unique": {"keys": ["type"]}}))


def test_clean_error_strips_controls_and_bounds_bytes() -> None:
    """last_error holds no control characters and at most 512 UTF-8 bytes."""
    assert clean_error("a\x00b\nc\td") == "a b c d"
    # C1 controls (a terminal's CSI is \x9b) and Unicode's line and paragraph separators.
    assert clean_error("a\x9b31mb\u2028c\u2029d\x7f") == "a 31mb c d "
    long = clean_error("é" * 1000)
    assert len(long.encode()) <= 512
    assert long.endswith("...")


def test_uuid7_is_a_lowercase_version_7_uuid() -> None:
    """The producer helper's ids pass the OJS id rule."""
    value = uuid7()
    assert value == value.lower()
    assert value[14] == "7"
    assert value[19] in "89ab"


def _nested(levels: int, leaf: str = "1") -> str:
    """A JSON array nested `levels` deep around `leaf`."""
    return "[" * levels + leaf + "]" * levels


@pytest.mark.parametrize("levels", [257, 500, 1000, 5000, 100_000])
def test_deep_nesting_is_an_invalid_envelope_whatever_the_depth(levels: int) -> None:
    """C6: an envelope nested deeper than relayd reads is that row's problem, whether
    Python's decoder would recurse out (1,000 levels) or not (500): never a RecursionError."""
    text = f'{{"id": "{ID}", "type": "t.x", "args": {_nested(levels - 1)}}}'
    with pytest.raises(InvalidEnvelope, match="nested deeper than 256 levels"):
        Envelope.parse(text, ID)


def test_nesting_up_to_the_bound_parses() -> None:
    """256 levels (the object, `args` and 254 arrays inside) is still an envelope."""
    text = f'{{"id": "{ID}", "type": "t.x", "args": {_nested(255)}}}'
    envelope = Envelope.parse(text.encode(), ID)
    assert envelope.type == "t.x"


def test_an_integer_longer_than_pythons_limit_is_read_exactly() -> None:
    """A 5,000-digit integer is valid JSON: it parses (as an exact Decimal), not 'not JSON'."""
    digits = "7" * 5000
    assert len(digits) > sys.get_int_max_str_digits()
    envelope = Envelope.parse(f'{{"id": "{ID}", "type": "t.x", "args": [{digits}, 1]}}', ID)
    assert envelope.args == [Decimal(digits), 1]


def test_a_huge_integer_is_not_a_priority() -> None:
    """Priority must be a small integer even when the number is too long for int()."""
    text = f'{{"id": "{ID}", "type": "t.x", "args": [], "options": {{"priority": {"9" * 5000}}}}}'
    with pytest.raises(InvalidEnvelope, match=r"options\.priority"):
        Envelope.parse(text, ID)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"\xff\xfe", "not JSON"),
        ("{", "not JSON"),
        ("", "not JSON"),
    ],
)
def test_unreadable_bytes_are_an_invalid_envelope(text: str | bytes, message: str) -> None:
    """Invalid UTF-8 or broken JSON raises InvalidEnvelope, nothing else."""
    with pytest.raises(InvalidEnvelope, match=message):
        Envelope.parse(text, ID)
