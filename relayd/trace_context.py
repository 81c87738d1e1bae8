"""The producer's trace, carried in an event's meta: at append, when OpenTelemetry is in use
and a span is active, the W3C `traceparent` and `tracestate` of that span are stored under
`meta.traceparent` and `meta.tracestate` (the keys the OJS tracing extension uses). The relay
hands them on, unchanged, to the sink.

Nothing here imports OpenTelemetry: an application that uses it has already imported
`opentelemetry.trace`; one that does not pays nothing and stores nothing.
"""

from __future__ import annotations

import sys
from typing import Any

META_TRACEPARENT = "traceparent"
META_TRACESTATE = "tracestate"


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
