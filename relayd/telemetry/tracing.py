"""The relay's spans, with OpenTelemetry (the `relayd[otel]` extra): for each claim that
leased rows, one span for the claim (`relayd.claim`), one for sending its rows to the sink
(`relayd.publish`: every request of the claim, one job, batches or NATS messages, sent
concurrently) and one for the settle (`relayd.settle`), the last two children of the first.
Three spans per claim whatever the sink or mode: a span per row or per request would cost
the SDK's ~44 µs of CPU for each row a sink sends alone.

The publish span *links* to the producer context stored in each of its rows' meta
(`meta.traceparent`), rather than being a child of it: a claim carries rows of many
producers' traces and a span has one parent; the relay's work happens later (after a
backlog, a retry, an outage) under its own sampling decision; and the sink's side of the
trace is continued by the context the row itself carries, which every sink sends on
unchanged (`relayd/core/trace_context.py`), with or without this module.

Spans are recorded once the step is over, from its measured duration: the relay calls three
methods per claim that leased rows (none per row), and a claim whose span is not sampled
builds no links. Without OpenTelemetry, or without `OTEL_TRACES_EXPORTER`, the relay holds
no `RelayTracing` at all and nothing of OpenTelemetry is imported: this module imports it
only when a `RelayTracing` is built. Nothing here changes what is claimed, sent or settled.

A test (or an embedding application) hands `RelayTracing` a `TracerProvider` of its own;
`relayd run` builds one from the standard `OTEL_*` variables (`from_environment`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from relayd.core import __version__
from relayd.core.trace_context import META_TRACEPARENT, TRACEPARENT_CHARS, TRACEPARENT_FORM
from relayd.telemetry.logs import get_logger

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.trace import Link, TracerProvider


SPAN_CLAIM = "relayd.claim"
SPAN_PUBLISH = "relayd.publish"
SPAN_SETTLE = "relayd.settle"
# The exporter entry points of the OpenTelemetry SDK and its exporter packages.
_EXPORTER_GROUP = "opentelemetry_traces_exporter"
# `otlp` as the standard defines it: OTLP over HTTP with protobuf unless the protocol
# variables say grpc (which needs the grpc exporter, not in the extra).
_OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


class TracingUnavailable(Exception):
    """`OTEL_*` asks for tracing that cannot be set up; the relay runs without spans."""


@dataclass(frozen=True, slots=True)
class Sent:
    """What a claim's publish step did, as its span records it: rows sent in how many
    requests, how many of them published, whether the sink failed, the one row's id when a
    single row was sent, and each row's stored meta (read for the links only when the span
    is sampled)."""

    rows: int
    requests: int
    published: int
    failed: bool
    message_id: str | None
    metas: Iterable[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class ClaimSpan:
    """A claim's recorded span, as its publish and settle spans need it: their parent
    context, and whether it was sampled (when not, they are not either, and build no
    links)."""

    context: Any
    sampled: bool


class RelayTracing:
    """Records the relay's spans on a tracer from `provider`."""

    def __init__(self, provider: TracerProvider, *, sink: str, owned: bool = False) -> None:
        """`sink`: the sink's kind (`messaging.system`); `owned`: `close()` shuts the
        provider down (one built from the environment)."""
        from opentelemetry import trace  # noqa: PLC0415 - only when tracing is on
        from opentelemetry.trace import (  # noqa: PLC0415
            Link,
            SpanContext,
            SpanKind,
            StatusCode,
            TraceFlags,
        )

        self._provider = provider
        self._owned = owned
        self._tracer = provider.get_tracer("relayd", __version__)
        self._sink = sink
        self._in_context = trace.set_span_in_context
        self._link, self._span_context = Link, SpanContext
        # Each row's flags as the SDK's value, looked up rather than built: links are per row.
        self._flags = {f"{flags:02x}": TraceFlags(flags) for flags in range(256)}
        self._internal, self._producer = SpanKind.INTERNAL, SpanKind.PRODUCER
        self._error = StatusCode.ERROR
        self._failing = False

    # Each step's span is recorded under a guard: a failure of tracing (an SDK's, an
    # exporter's, a processor's) is logged once and costs the relay that span, never a row.

    def claimed(self, elapsed_s: float, limit: int, rows: int, worker: str) -> ClaimSpan | None:
        """The span of a claim statement that leased `rows` rows and took `elapsed_s`; None
        if it could not be recorded (the claim's other spans are then not either)."""
        try:
            return self._claim_span(elapsed_s, limit, rows, worker)
        except Exception as exc:
            self._failed(exc)
            return None

    def published(self, claim: ClaimSpan, elapsed_s: float, sent: Sent) -> None:
        """The span of sending a claim's rows to the sink, linked to each row's producer
        context."""
        try:
            self._publish_span(claim, elapsed_s, sent)
        except Exception as exc:
            self._failed(exc)

    def settled(self, claim: ClaimSpan, elapsed_s: float, rows: Mapping[str, int]) -> None:
        """The span of the fenced updates that recorded a claim's outcomes; `rows`: how many
        rows each recorded, by what it recorded (published, retried, dead, released)."""
        try:
            self._settle_span(claim, elapsed_s, rows)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        if not self._failing:  # once: a broken tracer would fail on every claim
            self._failing = True
            get_logger("relay").warning("tracing.failed", error=f"{type(exc).__name__}: {exc}")

    def _claim_span(self, elapsed_s: float, limit: int, rows: int, worker: str) -> ClaimSpan:
        end_ns = time.time_ns()
        span = self._tracer.start_span(
            SPAN_CLAIM,
            kind=self._internal,
            start_time=end_ns - int(elapsed_s * 1e9),
            attributes={"relayd.worker": worker, "relayd.claim.limit": limit, "relayd.rows": rows},
        )
        span.end(end_time=end_ns)
        sampled = span.get_span_context().trace_flags.sampled
        return ClaimSpan(self._in_context(span), sampled)

    def _publish_span(self, claim: ClaimSpan, elapsed_s: float, sent: Sent) -> None:
        end_ns = time.time_ns()
        links = self._links(sent.metas) if claim.sampled else None
        attributes: dict[str, str | int] = {
            "messaging.system": self._sink,
            "messaging.operation.type": "send",
            "messaging.batch.message_count": sent.rows,
            "relayd.requests": sent.requests,
            "relayd.rows.published": sent.published,
        }
        if sent.message_id is not None:
            attributes["messaging.message.id"] = sent.message_id
        span = self._tracer.start_span(
            SPAN_PUBLISH,
            context=claim.context,
            kind=self._producer,
            start_time=end_ns - int(elapsed_s * 1e9),
            attributes=attributes,
            links=links,
        )
        if sent.failed:
            span.set_status(self._error, "the sink failed")
        span.end(end_time=end_ns)

    def _settle_span(self, claim: ClaimSpan, elapsed_s: float, rows: Mapping[str, int]) -> None:
        end_ns = time.time_ns()
        span = self._tracer.start_span(
            SPAN_SETTLE,
            context=claim.context,
            kind=self._internal,
            start_time=end_ns - int(elapsed_s * 1e9),
            attributes={f"relayd.rows.{group}": count for group, count in rows.items()},
        )
        span.end(end_time=end_ns)

    async def close(self) -> None:
        """Export what is buffered and stop, for a provider built from the environment
        (off the event loop: an exporter may take its timeout)."""
        if self._owned:
            import asyncio  # noqa: PLC0415 - only at shutdown

            shutdown = getattr(self._provider, "shutdown", None)
            if shutdown is not None:
                await asyncio.to_thread(shutdown)

    def _links(self, metas: Iterable[Mapping[str, Any]]) -> list[Link]:
        """A link to each distinct stored producer context of the rows (the events one
        producer span appended share one); rows without a valid one have none. (The SDK
        keeps the first OTEL_SPAN_LINK_COUNT_LIMIT, 128 by default.)"""
        links: list[Link] = []
        seen: set[str] = set()
        form = TRACEPARENT_FORM.fullmatch
        for meta in metas:
            value = meta.get(META_TRACEPARENT) if meta else None
            # The checks of trace_context.valid_traceparent, inline: they run for every row.
            if type(value) is not str or len(value) != TRACEPARENT_CHARS or value in seen:
                continue
            match = form(value)
            if match is None:
                continue
            seen.add(value)
            trace_id, span_id, flags = match.groups()
            context = self._span_context(
                int(trace_id, 16), int(span_id, 16), True, self._flags[flags]
            )
            links.append(self._link(context))
        return links


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the `OTEL_*` variables ask for spans: `OTEL_TRACES_EXPORTER` is set (`none`
    records spans and exports none) and `OTEL_SDK_DISABLED` is not `true`."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(environ.get("OTEL_TRACES_EXPORTER", "").strip())


def from_environment(sink: str) -> RelayTracing | None:
    """The relay's tracing as the `OTEL_*` variables configure it, or None: not asked for,
    or not possible (then one warning says why, and the relay runs without spans)."""
    if not configured():
        return None
    try:
        provider = provider_from_environment()
    except TracingUnavailable as exc:
        get_logger("daemon").warning("tracing.unavailable", error=str(exc))
        return None
    return RelayTracing(provider, sink=sink, owned=True)


def provider_from_environment() -> SdkTracerProvider:
    """An SDK `TracerProvider` from the standard variables: the sampler from
    `OTEL_TRACES_SAMPLER`(`_ARG`), the resource from `OTEL_SERVICE_NAME` and
    `OTEL_RESOURCE_ATTRIBUTES` (service name `relayd` by default), a batch span processor
    (`OTEL_BSP_*`) for each exporter named in `OTEL_TRACES_EXPORTER`; `TracingUnavailable`
    when the SDK or a named exporter is not installed. (The SDK reads the process's
    environment itself: so does this.)"""
    try:
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider as SdkProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    except ImportError:
        raise TracingUnavailable(
            "OTEL_TRACES_EXPORTER is set but the OpenTelemetry SDK is not installed "
            "(install relayd[otel]: docs/install.md)"
        ) from None
    exporters = [_exporter(name) for name in _exporter_names()]
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "relayd"}))
    provider = SdkProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporter_names() -> list[str]:
    names = [name.strip() for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    return [name for name in names if name and name != "none"]


def _exporter(name: str) -> Any:
    """A new span exporter of the entry point `name` (`otlp`: by the OTLP protocol)."""
    if name == "otlp":
        protocol = (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        ).strip()
        if protocol not in _OTLP_BY_PROTOCOL:
            raise TracingUnavailable(f"unknown OTLP protocol {protocol!r} (http/protobuf, grpc)")
        name = _OTLP_BY_PROTOCOL[protocol]
    found = metadata.entry_points(group=_EXPORTER_GROUP, name=name)
    if not found:
        raise TracingUnavailable(
            f"no span exporter {name!r} is installed (OTEL_TRACES_EXPORTER; relayd[otel] "
            "installs otlp over http/protobuf)"
        )
    try:
        return next(iter(found)).load()()
    except Exception as exc:
        raise TracingUnavailable(f"the span exporter {name!r} failed to start: {exc}") from None
