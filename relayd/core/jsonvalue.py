"""JSON values as relayd reads and compares them: nesting bounded, integers of any length,
equality by meaning.

Two places parse JSON that relayd did not write: a stored envelope (the producer's) and a
sink's answer. Neither may crash a worker, whatever it holds: `loads` raises only
`JsonError` (a `ValueError`), and `equal` walks values with an explicit stack, so depth costs
memory, never Python frames.

msgspec decodes (several times faster than the standard library, and exact for the
integers it accepts); what it refuses for range or depth goes to the standard library's
decoder, which reads integers of any length exactly (as Decimal), so both paths give the same
values and the same verdicts.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import msgspec

# Deeper values are refused. Python's decoder recurses once per level and fails somewhere
# under the interpreter's recursion limit (about 1,000, less whatever is already on the
# stack); a fixed bound well below that makes the verdict the same in every call path, and
# a sink's answer wrapping an envelope (`{"job": ...}`) two levels deeper still parses.
MAX_DEPTH = 256
_NUMBER = (int, float, Decimal)


class JsonError(ValueError):
    """The text is not JSON relayd can read; the message says why."""


_DECODER = msgspec.json.Decoder()


def loads(text: str | bytes, *, bounded: bool = True) -> Any:
    """Parse JSON; `JsonError` if it is not JSON or, when `bounded`, nests deeper than
    `MAX_DEPTH`. An unbounded parse (a sink's answer, never compared deeper than the envelope
    it came from) still cannot recurse without bound: the decoders have their own limits."""
    try:
        value = _DECODER.decode(text)
    except (msgspec.ValidationError, RecursionError):
        # An integer or float out of msgspec's range, or nesting past its limit.
        value = _exact(text)
    except msgspec.DecodeError as exc:
        raise JsonError(f"not JSON: {exc}") from None
    if bounded and _may_nest_deeper(text) and depth(value) > MAX_DEPTH:
        raise JsonError(f"nested deeper than {MAX_DEPTH} levels")
    return value


def _exact(text: str | bytes) -> Any:
    try:
        return json.loads(text, parse_int=_integer)
    except RecursionError:
        raise JsonError(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes
        raise JsonError(f"not JSON: {exc}") from None


def _integer(digits: str) -> int | Decimal:
    # int() refuses more than sys.get_int_max_str_digits() digits (a guard against its
    # quadratic conversion); Decimal reads any length in linear time and compares exactly
    # with int and float, which is all relayd does with numbers.
    try:
        return int(digits)
    except ValueError:
        return Decimal(digits)


def _may_nest_deeper(text: str | bytes) -> bool:
    """Cheap pre-check: a value cannot be deeper than the brackets its text holds."""
    if isinstance(text, bytes):
        return text.count(b"[") + text.count(b"{") > MAX_DEPTH
    return text.count("[") + text.count("{") > MAX_DEPTH


def depth(value: Any) -> int:
    """Nesting depth: 0 for a scalar, 1 for a flat array or object."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            level += 1
            deepest = max(deepest, level)
            stack.extend((child, level) for child in item)
    return deepest


def equal(a: Any, b: Any) -> bool:
    """JSON value equality: 1 == 1.0, but true != 1 and key order never matters."""
    stack: list[tuple[Any, Any]] = [(a, b)]
    while stack:
        x, y = stack.pop()
        if isinstance(x, bool) or isinstance(y, bool):
            if type(x) is not type(y) or x != y:
                return False
        elif isinstance(x, _NUMBER) and isinstance(y, _NUMBER):
            if x != y:
                return False
        elif isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return False
            stack.extend((x[key], y[key]) for key in x)
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif type(x) is not type(y) or x != y:
            return False
    return True
