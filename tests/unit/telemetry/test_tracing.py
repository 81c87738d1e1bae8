"""The relay's spans and how `relayd run` sets them up: a claim span parents its publish and
settle spans, each publish span links to its rows' valid producer contexts, an unsampled
claim builds no links; the standard OTEL_* variables decide, and without them nothing of
OpenTelemetry is imported."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler
from opentelemetry.trace import SpanKind, StatusCode

from relayd.telemetry.tracing import (
    SPAN_CLAIM,
    SPAN_PUBLISH,
    SPAN_SETTLE,
    ClaimSpan,
    RelayTracing,
    Sent,
    TracingUnavailable,
    configured,
    from_environment,
    provider_from_environment,
)
from tests.trace_cases import BAD_TRACES, SPAN_ID, TRACE_ID, TRACEPARENT


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    yield exported
    exported.shutdown()


def _tracing(exporter: InMemorySpanExporter, sampler: Sampler = ALWAYS_ON) -> RelayTracing:
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RelayTracing(provider, sink="ojs")


EVENT_ID = "01900000-0000-7000-8000-000000000001"


def _sent(
    metas: Sequence[Mapping[str, Any]],
    *,
    published: int,
    failed: bool = False,
    requests: int = 1,
    message_id: str | None = None,
) -> Sent:
    """What a claim's publish step did, as the relay tells its span: these rows' metas."""
    return Sent(
        rows=len(metas),
        requests=requests,
        published=published,
        failed=failed,
        message_id=message_id,
        metas=iter(metas),
    )


def _claim(tracing: RelayTracing, rows: int = 1) -> ClaimSpan:
    claim = tracing.claimed(0.002, 100, rows, "w0")
    assert claim is not None
    return claim


def _by_name(spans: Sequence[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def test_publish_links_each_rows_producer_context(exporter: InMemorySpanExporter) -> None:
    """One publish span for the claim's requests, a link per distinct valid context, none
    for rows without one; claim -> publish and settle, timed from the measured durations."""
    tracing = _tracing(exporter)
    others = [f"00-{n:032x}-{n:016x}-01" for n in range(1, 4)]
    metas = [
        {"traceparent": TRACEPARENT},
        *({"traceparent": other} for other in others),
        *(case.meta for case in BAD_TRACES),
    ]
    rows = len(metas)
    claim = _claim(tracing, rows=rows)
    tracing.published(claim, 0.01, _sent(metas, published=rows, requests=2))
    tracing.settled(claim, 0.003, {"published": rows, "retried": 0, "dead": 0, "released": 0})
    spans = _by_name(exporter.get_finished_spans())
    [claim_span], [publish], [settle] = spans[SPAN_CLAIM], spans[SPAN_PUBLISH], spans[SPAN_SETTLE]
    assert claim_span.parent is None
    assert publish.parent is not None
    assert settle.parent is not None
    assert publish.parent.span_id == settle.parent.span_id == claim_span.context.span_id
    assert publish.kind is SpanKind.PRODUCER
    # One link for the many rows that carry the same valid context, none for bad ones.
    assert [(link.context.trace_id, link.context.span_id) for link in publish.links] == [
        (int(TRACE_ID, 16), int(SPAN_ID, 16)),
        *((n, n) for n in range(1, 4)),
    ]
    assert all(
        link.context.is_remote and link.context.trace_flags.sampled for link in publish.links
    )
    assert publish.attributes is not None
    assert publish.attributes["messaging.batch.message_count"] == rows
    assert publish.attributes["relayd.rows.published"] == rows
    assert publish.attributes["relayd.requests"] == 2
    assert publish.end_time is not None
    assert publish.start_time is not None
    assert publish.end_time - publish.start_time == pytest.approx(10_000_000, abs=2)
    assert settle.attributes is not None
    assert settle.attributes["relayd.rows.published"] == rows
    assert settle.attributes["relayd.rows.released"] == 0


def test_a_failed_request_is_an_error_span(exporter: InMemorySpanExporter) -> None:
    """A publish span whose request the sink failed has an error status."""
    tracing = _tracing(exporter)
    claim = _claim(tracing)
    tracing.published(claim, 0.001, _sent([{}], published=0, failed=True, message_id=EVENT_ID))
    [publish] = _by_name(exporter.get_finished_spans())[SPAN_PUBLISH]
    assert publish.status.status_code is StatusCode.ERROR
    assert publish.attributes is not None
    assert publish.attributes["messaging.message.id"] == EVENT_ID


class _BrokenTracer:
    def start_span(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("the tracer is broken")


class _BrokenProvider(TracerProvider):
    def get_tracer(self, *args: object, **kwargs: object) -> _BrokenTracer:  # type: ignore[override]
        return _BrokenTracer()


def test_a_failing_tracer_costs_spans_never_a_row() -> None:
    """A tracer that raises: no span, one warning, and nothing raised into the relay."""
    tracing = RelayTracing(_BrokenProvider(), sink="ojs")
    with structlog.testing.capture_logs() as logs:
        assert tracing.claimed(0.001, 1, 1, "w0") is None
        claim = _claim(_tracing(InMemorySpanExporter()))
        tracing.published(claim, 0.001, _sent([{"traceparent": TRACEPARENT}], published=1))
    assert [log["event"] for log in logs] == ["tracing.failed"]
    assert logs[0]["error"] == "RuntimeError: the tracer is broken"


def test_an_unsampled_claim_records_nothing(exporter: InMemorySpanExporter) -> None:
    """With the claim span not sampled, its publish span is not either, and builds no links."""
    tracing = _tracing(exporter, ALWAYS_OFF)
    claim = _claim(tracing)
    assert not claim.sampled

    def metas() -> Iterator[Mapping[str, Any]]:
        raise AssertionError("an unsampled span read the rows' metas")
        yield {}

    sent = Sent(rows=1, requests=1, published=1, failed=False, message_id=None, metas=metas())
    tracing.published(claim, 0.001, sent)
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "relayd"}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": " "}, False),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_named(
    environ: dict[str, str], expected: bool
) -> None:
    """OTEL_TRACES_EXPORTER asks for spans (`none`: recorded, not exported)."""
    assert configured(environ) is expected


def _clean_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def test_the_provider_follows_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampler, service name and exporters come from OTEL_*; relayd names the service."""
    _clean_otel_environment(monkeypatch)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = provider_from_environment()
    assert isinstance(provider, TracerProvider)
    assert provider.sampler.get_description() == ALWAYS_OFF.get_description()
    assert provider.resource.attributes["service.name"] == "relayd"
    provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "orders-relay")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    tracing = from_environment("nats")
    assert tracing is not None
    named = provider_from_environment()
    assert named.resource.attributes["service.name"] == "orders-relay"
    named.shutdown()
    asyncio.run(tracing.close())


def test_an_exporter_that_is_not_installed_warns_and_runs_without_spans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A named exporter that is missing: one warning, no tracing, no traceback."""
    _clean_otel_environment(monkeypatch)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "no_such_exporter")
    with structlog.testing.capture_logs() as logs:
        tracing = from_environment("ojs")
    assert tracing is None
    [warning] = [log for log in logs if log["event"] == "tracing.unavailable"]
    assert "'no_such_exporter'" in warning["error"]
    assert "\n" not in warning["error"]


@pytest.mark.parametrize(
    ("protocol", "said"),
    [
        (None, "no span exporter 'otlp_proto_http' is installed"),
        ("http/protobuf", "no span exporter 'otlp_proto_http' is installed"),
        ("grpc", "no span exporter 'otlp_proto_grpc' is installed"),
        ("http/json", "unknown OTLP protocol 'http/json'"),
    ],
)
def test_otlp_follows_the_protocol_variable(
    monkeypatch: pytest.MonkeyPatch, protocol: str | None, said: str
) -> None:
    """`otlp` means OTLP over http/protobuf unless OTEL_EXPORTER_OTLP_PROTOCOL says grpc."""
    _clean_otel_environment(monkeypatch)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    if protocol is not None:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    known = {entry.name for entry in metadata.entry_points(group="opentelemetry_traces_exporter")}
    if "otlp_proto_http" in known and protocol in (None, "http/protobuf"):
        provider_from_environment().shutdown()  # the extra's exporter, where installed
        return
    with pytest.raises(TracingUnavailable) as raised:
        provider_from_environment()
    assert said in str(raised.value)


_NOTHING_IMPORTED = """
import json, sys
import relayd.cli, relayd.daemon.lifecycle, relayd.engine.relay
import relayd.sinks.ojs.sink, relayd.sinks.nats.sink
from relayd.core.trace_context import carried, producer_meta
from relayd.telemetry.tracing import from_environment
assert from_environment("ojs") is None
assert producer_meta() == {}
carried({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))
"""


def test_without_otel_variables_nothing_of_opentelemetry_is_imported() -> None:
    """relayd's daemon, relay and sinks import no OpenTelemetry module unless asked to."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", _NOTHING_IMPORTED],
        env=environ,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == []
