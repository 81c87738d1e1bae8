"""How the console shows what it read: times for people and machines, durations, free text
with any URL's secrets hidden, an envelope with or without its payload, the keyset cursor of
the dead-letter pages. Pure: tested as a table."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup, escape

from relayd.core import jsonvalue
from relayd.operator.render import age, iso, stamp
from relayd.sinks.http.urls import redact_url

# A URL inside free text (an error, a breaker's reason): shown through redact_url, so that a
# token in it never reaches a page, even from a text written before relayd redacted there.
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>]+")
# The envelope's members that carry the application's data: hidden unless payloads are shown.
PAYLOAD_MEMBERS = ("args", "meta")
_KEYS_SHOWN = 30


def when(value: datetime | None) -> Markup:
    """A time as a `<time>` element: UTC in its text and its title (the hover), turned into
    the browser's own zone by the console's script, which keeps the UTC title."""
    if value is None:
        return Markup('<span class="none">-</span>')
    text = stamp(value)
    machine = iso(value) or text
    return Markup('<time datetime="{0}" title="{1}">{1}</time>').format(machine, text)


def duration(seconds: float | None) -> str:
    return age(seconds)


def shown(value: object) -> str:
    """Free text from producers, sinks or operators, with every URL's secrets hidden
    (autoescaping then makes it inert HTML)."""
    if value is None:
        return "-"
    return _URL.sub(lambda match: redact_url(match.group()), str(value))


@dataclass(frozen=True, slots=True)
class Envelope:
    """An event's envelope as a page shows it: every member, the payload's members either in
    full or as their size and top-level keys."""

    members: list[tuple[str, str]]  # (name, JSON text or a summary)
    size: int  # the envelope's bytes, as stored
    hidden: bool  # whether the payload members are summarised


def envelope(text: str, *, show_payloads: bool) -> Envelope:
    """The envelope's members: `args` and `meta` summarised unless `show_payloads`."""
    try:
        data = jsonvalue.loads(text)
    except (ValueError, TypeError, RecursionError):
        data = None
    if not isinstance(data, dict):
        summary = text if show_payloads else f"not a JSON object ({len(text.encode()):,} bytes)"
        return Envelope([("envelope", summary)], len(text.encode()), not show_payloads)
    members: list[tuple[str, str]] = []
    for name, value in data.items():
        if name in PAYLOAD_MEMBERS and not show_payloads:
            members.append((name, summary_of(value)))
        else:
            members.append((name, _pretty(value)))
    return Envelope(members, len(text.encode()), not show_payloads)


def summary_of(value: Any) -> str:
    """A payload member without its content: its size, and its top-level keys (those of an
    object, or of each object in an array)."""
    size = len(_compact(value).encode())
    if isinstance(value, dict):
        return f"object, {size:,} bytes, keys: {_keys(value.keys())}"
    if isinstance(value, list):
        keys = dict.fromkeys(k for item in value if isinstance(item, dict) for k in item)
        described = f"array of {len(value):,} items, {size:,} bytes"
        return described + (f", object keys: {_keys(keys)}" if keys else "")
    return f"{type(value).__name__}, {size:,} bytes"


def _keys(keys: Any) -> str:
    names = [str(k) for k in keys]
    more = len(names) - _KEYS_SHOWN
    listed = ", ".join(names[:_KEYS_SHOWN]) or "(none)"
    return listed + (f" and {more:,} more" if more > 0 else "")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _pretty(value: Any) -> str:
    try:
        return json.dumps(value, indent=2, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return str(value)


# --- the dead letters' keyset cursor --------------------------------------------------------


def cursor(dead_at: datetime | None, event_id: str) -> str:
    """The cursor of the page after a row: its (dead_at, event_id), as text for a URL."""
    at = (dead_at or datetime.min.replace(tzinfo=UTC)).astimezone(UTC)
    return f"{at.isoformat()}~{event_id}"


def parse_cursor(text: str) -> tuple[datetime, str]:
    """A cursor made by `cursor`; ValueError if it is not one."""
    at_text, sep, id_text = text.partition("~")
    if not sep:
        raise ValueError("not a page cursor")
    at = datetime.fromisoformat(at_text)
    if at.tzinfo is None:
        raise ValueError("not a page cursor")
    return at, str(uuid.UUID(id_text))


def highlight_none(value: object) -> Markup:
    """A value, or a muted dash for none."""
    if value is None or value == "":
        return Markup('<span class="none">-</span>')
    return escape(shown(value))


def sort_key(value: datetime | None) -> datetime:
    """A time to order a timeline by: PostgreSQL's infinities (naive extremes) and none at
    the ends."""
    if value is None:
        return datetime.max.replace(tzinfo=UTC)
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value
