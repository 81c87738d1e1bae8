"""The producer's trace, carried in an event's meta: at append, when OpenTelemetry is in use
and a span is active, the W3C `traceparent` and `tracestate` of that span are stored under
`meta.traceparent` and `meta.tracestate` (the keys the OJS tracing extension uses). The relay
hands them on, unchanged, to the sink (`carried`): a value that is not exactly the W3C form
is left behind, never "repaired", and never stops or delays the row.

Nothing here imports OpenTelemetry: an application that uses it has already imported
`opentelemetry.trace`; one that does not pays nothing and stores nothing. The relay reads
stored values with plain string checks, so a sink sends them with or without OpenTelemetry.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

META_TRACEPARENT = "traceparent"
META_TRACESTATE = "tracestate"

# W3C Trace Context, level 1. A traceparent is exactly `vv-<32 hex>-<16 hex>-<2 hex>`, lower
# case, 55 characters; version ff and all-zero ids are invalid. relayd takes no longer form
# (a future version's suffix): it hands the value on unchanged or not at all.
TRACEPARENT_CHARS = 55
# One match checks it all: version (not ff), trace id and span id (not all zero), flags.
TRACEPARENT_FORM = re.compile(
    r"(?!ff)[0-9a-f]{2}-(?!0{32})([0-9a-f]{32})-(?!0{16})([0-9a-f]{16})-([0-9a-f]{2})"
)
# A tracestate is at most 32 `key=value` members; 512 characters is what the standard asks
# every vendor to pass on whole, and all relayd passes on.
MAX_TRACESTATE_CHARS = 512
MAX_TRACESTATE_MEMBERS = 32
_KEY = r"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(rf"({_KEY})={_VALUE}")


def producer_meta() -> dict[str, str]:
    """The current span's W3C trace context as meta entries; `{}` without OpenTelemetry in
    use or without a valid active span."""
    trace: Any = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415 - in use already
        TraceContextTextMapPropagator,
    )

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return {key: carrier[key] for key in (META_TRACEPARENT, META_TRACESTATE) if carrier.get(key)}


def valid_traceparent(value: object) -> str | None:
    """`value` if it is a valid W3C traceparent, else None (never raises)."""
    if (
        type(value) is not str
        or len(value) != TRACEPARENT_CHARS
        or TRACEPARENT_FORM.fullmatch(value) is None
    ):
        return None
    return value


def valid_tracestate(value: object) -> str | None:
    """`value` if it is a valid W3C tracestate within relayd's bounds, else None (never
    raises). Printable ASCII only: no control character (CR, LF, tab) can reach a header."""
    if (
        type(value) is not str
        or not value
        or len(value) > MAX_TRACESTATE_CHARS
        or not value.isascii()
        or not value.isprintable()
    ):
        return None
    members = [member.strip(" ") for member in value.split(",")]
    members = [member for member in members if member]  # empty members are allowed
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    keys: set[str] = set()
    for member in members:
        match = _MEMBER.fullmatch(member)
        if match is None or match[1] in keys:
            return None
        keys.add(match[1])
    return value


def carried(meta: Mapping[str, Any]) -> dict[str, str]:
    """The producer's trace context a row carries, as headers to send with it: `traceparent`
    and `tracestate` from its meta, each exactly as stored, or left out if invalid (a
    tracestate without a valid traceparent too). `{}` for a row without one."""
    if not meta:
        return {}
    traceparent = valid_traceparent(meta.get(META_TRACEPARENT))
    if traceparent is None:
        return {}
    tracestate = valid_tracestate(meta.get(META_TRACESTATE))
    if tracestate is None:
        return {META_TRACEPARENT: traceparent}
    return {META_TRACEPARENT: traceparent, META_TRACESTATE: tracestate}
