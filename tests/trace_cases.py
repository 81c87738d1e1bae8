"""Trace metadata as rows may carry it: a valid producer context, and the kinds of bad
`meta.traceparent`/`meta.tracestate` values relayd must drop without delaying the row (the
unit table and the integration tests through the daemon share them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"
TRACESTATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"


@dataclass(frozen=True)
class BadTrace:
    """A row's meta entries, and what relayd sends on of them (`{}`: nothing)."""

    name: str
    meta: dict[str, Any]
    carried: dict[str, str]


def _bad_parent(name: str, value: Any) -> BadTrace:
    return BadTrace(name, {"traceparent": value, "tracestate": TRACESTATE}, {})


def _bad_state(name: str, value: Any) -> BadTrace:
    return BadTrace(
        name, {"traceparent": TRACEPARENT, "tracestate": value}, {"traceparent": TRACEPARENT}
    )


BAD_TRACES: tuple[BadTrace, ...] = (
    _bad_parent("null", None),
    _bad_parent("number", 42),
    _bad_parent("float", 1.5),
    _bad_parent("boolean", True),
    _bad_parent("list", [TRACEPARENT]),
    _bad_parent("object", {"traceparent": TRACEPARENT}),
    _bad_parent("empty", ""),
    _bad_parent("one char short", TRACEPARENT[:-1]),
    _bad_parent("one char long", TRACEPARENT + "0"),
    _bad_parent("bad hex", TRACEPARENT.replace("4bf9", "4bg9")),
    _bad_parent("upper case", TRACEPARENT.upper()),
    _bad_parent("version ff", "ff" + TRACEPARENT[2:]),
    _bad_parent("zero trace id", f"00-{'0' * 32}-{SPAN_ID}-01"),
    _bad_parent("zero span id", f"00-{TRACE_ID}-{'0' * 16}-01"),
    _bad_parent("CR LF injection", TRACEPARENT[:20] + "\r\nX-Evil: 1"),
    _bad_parent("LF inside, right length", TRACEPARENT[:20] + "\n" + TRACEPARENT[21:]),
    _bad_parent("non-ASCII digit", TRACEPARENT[:5] + "\u0664" + TRACEPARENT[6:]),
    _bad_parent("huge", "00-" + "a" * 100_000),
    _bad_parent("wrong separators", TRACEPARENT.replace("-", "_")),
    _bad_parent("future version with a suffix", "01" + TRACEPARENT[2:] + "-what-comes-next"),
    _bad_parent("surrounding spaces", f" {TRACEPARENT} "),
    BadTrace("tracestate without traceparent", {"tracestate": TRACESTATE}, {}),
    _bad_state("tracestate CR LF", "rojo=1\r\nX-Evil: 1"),
    _bad_state("tracestate huge", "a=" + "b" * 100_000),
    _bad_state("tracestate list", [TRACESTATE]),
    _bad_state("tracestate 33 members", ",".join(f"k{i}=v" for i in range(33))),
    _bad_state("tracestate duplicate key", "rojo=1,rojo=2"),
    _bad_state("tracestate upper-case key", "Rojo=1"),
    _bad_state("tracestate non-ASCII", "rojo=caf\u00e9"),
    _bad_state("tracestate tab", "rojo=1,\tcongo=2"),
)
