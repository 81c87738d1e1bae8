"""Text from the database or the network, made safe to print on an operator's terminal.

Queue names, job types, pause reasons, hosts, errors and application names are written by
producers, sinks and other sessions, not by relayd. Printed raw, an escape sequence in one
of them is obeyed by the terminal (OSC 52 writes the clipboard, others retitle the window or
hide text), a newline forges a report line, and a bidirectional override reorders what the
operator reads. Every human rendering of the operator surface passes such text through
`printable`; JSON output needs no such care (its encoder escapes control characters).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows (the first is the header) as lines of left-aligned columns two spaces apart, the
    last column unpadded (it holds the long text: an error); every cell made printable."""
    cells = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]) - 1)]
    return [
        "  ".join(
            [*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]
        ).rstrip()
        for row in cells
    ]
