"""Metric names in a PromQL expression, found without a PromQL parser: every identifier that
is not a function, keyword, label name or string (good enough for the expressions the rules
and the dashboard ship, which the tests also run through promtool)."""

from __future__ import annotations

import re

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABEL_BLOCKS = re.compile(r"\{[^}]*\}")
_GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_DURATIONS = re.compile(r"\[[^\]]*\]")
_IDENTIFIER = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")
_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "offset", "bool"})
_KEYWORDS |= {"group_left", "group_right", "inf", "nan", "time"}


def metric_names(expression: str) -> set[str]:
    """The metric (and recording rule) names `expression` selects."""
    text = _STRINGS.sub('""', expression)
    text = _LABEL_BLOCKS.sub("", text)
    text = _GROUPINGS.sub("", text)
    text = _DURATIONS.sub("", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in _KEYWORDS}
