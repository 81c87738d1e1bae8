"""Text printed on an operator's terminal: escape sequences, forged lines and reordering
marks made harmless and visible; ordinary text, accents and emoji untouched."""

from __future__ import annotations

import pytest

from relayd.operator.render import columns, printable


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("orders", "orders"),
        ("café ☕ 注文", "café ☕ 注文"),
        ("\x1b]52;c;cm0gLXJmIH4=\x07", "\\x1b]52;c;cm0gLXJmIH4=\\x07"),  # OSC 52: clipboard
        ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # clear the screen
        ("\x9b31m", "\\x9b31m"),  # a C1 CSI
        ("a\nb\r\nc\td", "a b  c d"),  # one line, still readable
        ("x\u2028y\u2029z", "x y z"),
        ("admin\u202egnp.exe", "admin\\u202egnp.exe"),  # a right-to-left override
        ("\u2066isolate\u2069", "\\u2066isolate\\u2069"),
        ("\ufeffbom", "\\ufeffbom"),
        ("del\x7f", "del\\x7f"),
        ("nul\x00", "nul\\x00"),
    ],
)
def test_printable(raw: str, shown: str) -> None:
    """Each unprintable character becomes a space (line breaks, tabs) or its escape."""
    assert printable(raw) == shown
    assert printable(printable(raw)) == printable(raw)  # idempotent


def test_columns_align_what_the_terminal_shows() -> None:
    """Widths are those of the printable cells; the last column is not padded."""
    lines = columns([["ID", "QUEUE", "ERROR"], ["1", "a\x1bb", "boom\n"], ["22", "c", "x"]])
    assert lines == [
        "ID  QUEUE   ERROR",
        "1   a\\x1bb  boom",
        "22  c       x",
    ]
