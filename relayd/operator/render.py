"""How the operator surface shows what it read: text made safe for a terminal, tables, times.

Queue names, job types, pause reasons, hosts, errors and application names are written by
producers, sinks and other sessions, not by relayd. Printed raw, an escape sequence in one
of them is obeyed by the terminal (OSC 52 writes the clipboard, others retitle the window or
hide text), a newline forges a report line, and a bidirectional override reorders what the
operator reads. Every human rendering of the operator surface passes such text through
`printable`; JSON output needs no such care (its encoder escapes control characters).

Times have one form for scripts (`iso`: every `--json`, the audit trail) and one for people
(`stamp`, to the second), durations one (`age`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from datetime import UTC, datetime

_LATIN1 = 0xFF  # up to here, two hex digits
_BREAKS = frozenset("\t\n\v\f\r\u2028\u2029")
# C0 and C1 controls and DEL; Unicode's line and paragraph separators; the bidirectional
# marks, embeddings, overrides and isolates; the byte-order mark, which terminals draw as
# nothing.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _BREAKS:
        return " "  # a line break or a tab in free text: one line, still readable
    code = ord(char)
    return f"\\x{code:02x}" if code <= _LATIN1 else f"\\u{code:04x}"


def printable(value: object) -> str:
    """`str(value)` on one line that no terminal obeys: line breaks and tabs become spaces,
    every other character above a visible escape (`\\x1b`, `\\u202e`), so the operator
    still sees that something odd was there."""
    return _UNPRINTABLE.sub(_escape, str(value))


def columns(
    rows: Sequence[Sequence[str]], *, indent: str = "", right: Collection[int] = ()
) -> list[str]:
    """Rows (the first may be a header) as lines of columns two spaces apart, after `indent`:
    left-aligned, but for the columns numbered in `right`; the last column unpadded when
    left-aligned (it holds the long text: an error). Every cell is made printable first, so
    that the columns line up as the terminal shows them."""
    cells = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [
        (
            indent
            + "  ".join(
                cell.rjust(width) if i in right else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        ).rstrip()
        for row in cells
    ]


def iso(value: datetime | None) -> str | None:
    """A time for scripts (`--json`, the audit trail): ISO 8601 in UTC with its offset, as
    precise as stored; PostgreSQL's infinities as `infinity` and `-infinity`."""
    if value is None:
        return None
    return _infinity(value) or value.astimezone(UTC).isoformat()


def stamp(value: datetime | None) -> str:
    """A time for people: to the second, in UTC (`2025-12-01T06:07:52Z`); `-` for none."""
    if value is None:
        return "-"
    return _infinity(value) or value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _infinity(value: datetime) -> str | None:
    # asyncpg reads PostgreSQL's infinite timestamps as naive extremes.
    if value.tzinfo is not None:
        return None
    return "infinity" if value == datetime.max else "-infinity"


def age(seconds: float | None) -> str:
    """A duration for people: 1.5s, 2m03s, 4h05m, 3d02h; `-` for none, `infinite` for a time
    parked at infinity."""
    if seconds is None or math.isnan(seconds):
        return "-"
    seconds = max(seconds, 0.0)
    if math.isinf(seconds):
        return "infinite"
    if seconds < 60:  # noqa: PLR2004 - a minute
        return f"{seconds:.1f}s"
    whole = int(seconds)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"
