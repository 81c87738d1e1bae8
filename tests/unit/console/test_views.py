"""How the console shows what it read: an envelope without its payload, free text without a
URL's secrets, times as `<time>` elements, the dead letters' keyset cursor."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from relayd.console import views


def test_an_envelope_hides_its_payload_but_its_size_and_top_level_keys() -> None:
    """args and meta are summarised; id, type and options are shown whole."""
    job = {
        "id": "0193a1b2-0000-7000-8000-000000000001",
        "type": "order.created",
        "args": [{"card": "4111 1111", "total": 5}, 3],
        "meta": {"trace": "t-secret", "tenant": "acme"},
        "options": {"queue": "orders"},
    }
    shown = dict(views.envelope(json.dumps(job), show_payloads=False).members)
    assert "4111" not in shown["args"]
    assert shown["args"].startswith("array of 2 items, ")
    assert shown["args"].endswith("object keys: card, total")
    assert "t-secret" not in shown["meta"]
    assert shown["meta"].endswith("keys: trace, tenant")
    assert json.loads(shown["options"]) == {"queue": "orders"}
    whole = dict(views.envelope(json.dumps(job), show_payloads=True).members)
    assert "4111 1111" in whole["args"]


def test_an_envelope_that_is_not_an_object_is_summarised_whole() -> None:
    """Text the envelope check refused (a dead letter of invalid_envelope) shows its size."""
    envelope = views.envelope("[1, 2]", show_payloads=False)
    assert envelope.members == [("envelope", "not a JSON object (6 bytes)")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "POST https://hooks.example/h/AbCdEf0123456789xyz?token=s3 refused",
            "POST https://hooks.example/h/***?*** refused",
        ),
        ("connect nats://user:pw@10.0.0.1:4222 failed", "connect nats://***@10.0.0.1:4222 failed"),
        ("no URL here", "no URL here"),
        (None, "-"),
    ],
)
def test_free_text_never_shows_a_urls_secrets(text: str | None, expected: str) -> None:
    """A token in a URL's path, query or user information is hidden wherever text shows."""
    assert views.shown(text) == expected


def test_a_time_is_utc_in_its_text_and_title() -> None:
    """The browser's script turns the text into its own zone; the title keeps UTC."""
    at = datetime(2026, 12, 4, 22, 10, 5, tzinfo=UTC)
    assert str(views.when(at)) == (
        '<time datetime="2026-12-04T22:10:05+00:00" title="2026-12-04T22:10:05Z">'
        "2026-12-04T22:10:05Z</time>"
    )
    assert "none" in str(views.when(None))


def test_the_keyset_cursor_round_trips_and_refuses_anything_else() -> None:
    """(dead_at, event_id) as text for a URL, and back; anything else is a ValueError."""
    at = datetime(2026, 12, 4, 22, 10, 5, 123456, tzinfo=UTC)
    event_id = "0193a1b2-0000-7000-8000-000000000001"
    assert views.parse_cursor(views.cursor(at, event_id)) == (at, event_id)
    for bad in ("", "2026-12-04", "2026-12-04T22:10:05~nope", f"2026-12-04T22:10:05~{event_id}"):
        with pytest.raises(ValueError):  # noqa: PT011 - each a different parser's message
            views.parse_cursor(bad)
