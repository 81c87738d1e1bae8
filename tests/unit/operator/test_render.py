"""Text printed on an operator's terminal: escape sequences, forged lines and reordering
marks made harmless and visible; ordinary text, accents and emoji untouched. Tables, and the
one form of a time for scripts and for people."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest

from relayd.operator.render import age, columns, iso, printable, stamp


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


def test_columns_indent_and_align_right() -> None:
    """Columns numbered in `right` align right, the others left; every line is indented."""
    lines = columns([["state", "rows"], ["ready", "1,820"], ["dead", "3"]], indent="  ", right=(1,))
    assert lines == [
        "  state   rows",
        "  ready  1,820",
        "  dead       3",
    ]


@pytest.mark.parametrize(
    ("value", "for_scripts", "for_people"),
    [
        (
            datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
            "2026-01-02T03:04:05.678901+00:00",
            "2026-01-02T03:04:05Z",
        ),
        (
            datetime(2026, 1, 2, 4, 4, 5, tzinfo=timezone(timedelta(hours=1))),
            "2026-01-02T03:04:05+00:00",
            "2026-01-02T03:04:05Z",
        ),
        (datetime.max, "infinity", "infinity"),  # asyncpg's reading of PostgreSQL's infinity
        (datetime.min, "-infinity", "-infinity"),
        (None, None, "-"),
    ],
)
def test_times_have_one_form_for_scripts_and_one_for_people(
    value: datetime | None, for_scripts: str | None, for_people: str
) -> None:
    """`iso` (every --json) keeps the instant whole, in UTC; `stamp` shows it to the second."""
    assert iso(value) == for_scripts
    assert stamp(value) == for_people


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (math.nan, "-"),
        (-3.0, "0.0s"),  # ahead of the database's clock
        (1.25, "1.2s"),
        (123.0, "2m03s"),
        (4 * 3600 + 5 * 60, "4h05m"),
        (3 * 86_400 + 2 * 3600, "3d02h"),
        (math.inf, "infinite"),
    ],
)
def test_ages(seconds: float | None, shown: str) -> None:
    """A duration in its two largest units."""
    assert age(seconds) == shown
