"""A small interpreter of the OJS conformance DSL (ojs-conformance
`docs/test-case-reference.md`): runs one JSON test case against a server over HTTP.

Supported: setup/steps/teardown; GET/POST/PUT/PATCH/DELETE with headers, `body` or
`raw_body`; `delay_ms`; WAIT (`duration_ms`); `parallel_with`; `captures`; ASSERT
`equality` and `exclusive_claim`; assertions `status` (int, `number:range(a,b)`,
`one_of:a,b`, `{"$in"}`), `status_in`, `status_one_of`, `headers`, `body` (JSONPath → matcher,
top-level `$or` and `$empty`), `body_absent`, `body_contains`, `timing_ms`; templates
``{{steps.<id>.response.body.<path>}}`` and captured ``{{name}}``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

_TEMPLATE = re.compile(r"\{\{\s*([^{}]+?)\s*\}\}")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_UUIDV7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
_PATH_TOKEN = re.compile(
    r"\.(?P<field>[^.\[\]]+)"
    r"|\[(?P<index>-?\d+)\]"
    r"|\[(?P<wild>\*)\]"
    r"|\[\?\(@\.(?P<fkey>[^=]+?)\s*==\s*(?P<fval>[^)]+?)\)\]"
    r"|\[['\"](?P<quoted>[^'\"]*)['\"]\]"
)
_TYPE_CHECKS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


class CaseFailure(AssertionError):
    """A conformance case did not hold; the message lists every failed assertion of the step."""


@dataclass
class Response:
    status: int
    headers: Mapping[str, str]
    body: Any
    raw: str
    elapsed_ms: float


# --- JSONPath ----------------------------------------------------------------------------


def _tokens(path: str) -> list[tuple[str, Any]]:
    if not path.startswith("$"):
        raise ValueError(f"JSONPath must start with '$': {path!r}")
    tokens: list[tuple[str, Any]] = []
    position = 1
    while position < len(path):
        match = _PATH_TOKEN.match(path, position)
        if match is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {position}")
        if match["field"] is not None:
            tokens.append(("field", match["field"]))
        elif match["quoted"] is not None:
            tokens.append(("field", match["quoted"]))
        elif match["index"] is not None:
            tokens.append(("index", int(match["index"])))
        elif match["wild"] is not None:
            tokens.append(("wild", None))
        else:
            literal = match["fval"].strip()
            if len(literal) >= 2 and literal[0] == literal[-1] and literal[0] in "'\"":
                literal = literal[1:-1]
            tokens.append(("filter", (match["fkey"].strip(), literal)))
        position = match.end()
    return tokens


def resolve(root: Any, path: str) -> tuple[bool, Any]:
    """(found, value) of a JSONPath; a wildcard collects every match into a list."""
    values = [root]
    collected = False
    for kind, argument in _tokens(path):
        following: list[Any] = []
        for value in values:
            if (kind == "field" and isinstance(value, dict) and argument in value) or (
                kind == "index" and isinstance(value, list) and -len(value) <= argument < len(value)
            ):
                following.append(value[argument])
            elif kind == "wild":
                collected = True
                if isinstance(value, list):
                    following.extend(value)
                elif isinstance(value, dict):
                    following.extend(value.values())
            elif kind == "filter" and isinstance(value, list):
                key, literal = argument
                following.extend(
                    [
                        item
                        for item in value
                        if isinstance(item, dict)
                        and key in item
                        and go_format(item[key]) == literal
                    ][:1]
                )
        values = following
    if collected:
        return True, values
    return (True, values[0]) if values else (False, None)


# --- matchers ----------------------------------------------------------------------------


def go_format(value: Any) -> str:
    """How the Go runner prints a JSON value (%v / template conversion)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return value
    if value is None:
        return "<nil>"
    return json.dumps(value, separators=(",", ":"))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _describe(found: bool, actual: Any) -> str:
    return "absent" if not found else json.dumps(actual)[:200]


def check(found: bool, actual: Any, expected: Any, *, tolerance_pct: float = 50.0) -> str | None:
    """None if the value satisfies the matcher, else why not."""
    if isinstance(expected, dict):
        return _check_object(found, actual, expected, tolerance_pct)
    if isinstance(expected, list):
        if not found or not isinstance(actual, list) or len(actual) != len(expected):
            return f"expected an array of {len(expected)}, got {_describe(found, actual)}"
        for index, (item, wanted) in enumerate(zip(actual, expected, strict=True)):
            failure = check(True, item, wanted, tolerance_pct=tolerance_pct)
            if failure is not None:
                return f"[{index}]: {failure}"
        return None
    if expected is None:
        return (
            None if found and actual is None else f"expected null, got {_describe(found, actual)}"
        )
    if isinstance(expected, bool):
        ok = found and isinstance(actual, bool) and actual is expected
        return None if ok else f"expected {expected}, got {_describe(found, actual)}"
    if _number(expected):
        ok = found and _number(actual) and actual == expected
        return None if ok else f"expected {expected}, got {_describe(found, actual)}"
    if isinstance(expected, str):
        return _check_string(found, actual, expected, tolerance_pct)
    return f"unsupported matcher {expected!r}"


def _check_string(found: bool, actual: Any, expected: str, tolerance_pct: float) -> str | None:
    ok = _string_matcher(found, actual, expected, tolerance_pct)
    return None if ok else f"expected {expected!r}, got {_describe(found, actual)}"


def _string_matcher(found: bool, actual: Any, expected: str, tolerance_pct: float) -> bool:
    text = actual if isinstance(actual, str) else None
    items = actual if isinstance(actual, list) else None
    if expected == "any":
        return found and actual is not None
    if expected == "absent":
        return not found or actual is None
    if expected == "exists":
        return found
    if expected in ("string:nonempty", "string:non_empty"):
        return bool(text)
    if expected == "string:uuid":
        return text is not None and _UUID.match(text) is not None
    if expected == "string:uuidv7":
        return text is not None and _UUIDV7.match(text) is not None
    if expected == "string:datetime":
        return text is not None and _DATETIME.match(text) is not None
    if expected.startswith("string:contains:"):
        return text is not None and expected.removeprefix("string:contains:") in text
    if expected.startswith("string:pattern(") and expected.endswith(")"):
        return text is not None and re.search(expected[15:-1], text) is not None
    if expected == "number:positive":
        return _number(actual) and actual > 0
    if expected == "number:non_negative":
        return _number(actual) and actual >= 0
    if expected.startswith("number:range(") and expected.endswith(")"):
        low, high = (float(part) for part in expected[13:-1].split(","))
        return _number(actual) and low <= actual <= high
    if expected.startswith("~") and _is_float(expected[1:]):
        wanted = float(expected[1:])
        tolerance = max(wanted * tolerance_pct / 100, 100.0)
        return _number(actual) and abs(actual - wanted) <= tolerance
    if expected == "array:nonempty":
        return bool(items)
    if expected == "array:empty":
        return items is not None and not items
    for prefix, exact in (
        ("array:length:", True),
        ("array:length(", True),
        ("array:min_length:", False),
        ("array:min:", False),
    ):
        if expected.startswith(prefix):
            size = int(expected.removeprefix(prefix).rstrip(")"))
            return items is not None and (len(items) == size if exact else len(items) >= size)
    if expected.startswith("contains:"):
        wanted_text = expected.removeprefix("contains:")
        return items is not None and any(go_format(item) == wanted_text for item in items)
    if expected.startswith("not_contains:"):
        wanted_text = expected.removeprefix("not_contains:")
        return items is not None and all(go_format(item) != wanted_text for item in items)
    if not found:
        return False
    return actual == expected if isinstance(actual, str) else go_format(actual) == expected


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _compare(actual: Any, bounds: Mapping[str, Any]) -> bool:
    operators = {
        "$gte": lambda a, b: a >= b,
        "$gt": lambda a, b: a > b,
        "$lte": lambda a, b: a <= b,
        "$lt": lambda a, b: a < b,
        "$eq": lambda a, b: a == b,
        "$ne": lambda a, b: a != b,
    }
    if not _number(actual) or not set(bounds) <= set(operators):
        return False
    return all(operators[name](actual, bound) for name, bound in bounds.items())


def _check_object(
    found: bool, actual: Any, spec: Mapping[str, Any], tolerance_pct: float
) -> str | None:
    if not any(key.startswith("$") or key == "range" for key in spec):
        # A plain object literal: the value must equal it.
        return (
            None if found and actual == spec else f"expected {spec}, got {_describe(found, actual)}"
        )
    for name, argument in spec.items():
        failure: str | None = None
        if name == "$exists":
            if found != bool(argument):
                failure = f"expected exists={argument}, got {_describe(found, actual)}"
        elif name == "$type":
            if not found or not _TYPE_CHECKS.get(argument, lambda _v: False)(actual):
                failure = f"expected type {argument}, got {_describe(found, actual)}"
        elif name == "$match":
            if not isinstance(actual, str) or re.search(argument, actual) is None:
                failure = f"expected to match {argument!r}, got {_describe(found, actual)}"
        elif name in ("$in", "$or"):
            if all(check(found, actual, alt, tolerance_pct=tolerance_pct) for alt in argument):
                failure = f"expected one of {argument}, got {_describe(found, actual)}"
        elif name == "$size":
            size = len(actual) if isinstance(actual, list) else None
            ok = size is not None and (
                _compare(size, argument) if isinstance(argument, dict) else size == argument
            )
            if not ok:
                failure = f"expected size {argument}, got {_describe(found, actual)}"
        elif name == "$empty":
            empty = not found or actual in (None, "", [], {})
            if empty != bool(argument):
                failure = f"expected empty={argument}, got {_describe(found, actual)}"
        elif name == "range":
            low, high = argument.get("min", -math.inf), argument.get("max", math.inf)
            if not (_number(actual) and low <= actual <= high):
                failure = f"expected range {argument}, got {_describe(found, actual)}"
        elif name in ("$gte", "$gt", "$lte", "$lt", "$eq", "$ne"):
            if not _compare(actual, {name: argument}):
                failure = f"expected {name} {argument}, got {_describe(found, actual)}"
        else:
            failure = f"unsupported operator {name}"
        if failure is not None:
            return failure
    return None


def check_status(status: int, expected: Any) -> str | None:
    """None if the status satisfies the `status` assertion, else why not."""
    ok: bool
    if isinstance(expected, bool):
        ok = False
    elif isinstance(expected, int):
        ok = status == expected
    elif isinstance(expected, dict) and "$in" in expected:
        ok = status in expected["$in"]
    elif isinstance(expected, str) and expected.startswith("number:range("):
        low, high = (int(part) for part in expected[13:-1].split(","))
        ok = low <= status <= high
    elif isinstance(expected, str) and expected.startswith("one_of:"):
        ok = status in {int(part) for part in expected[7:].split(",")}
    elif isinstance(expected, str) and expected.isdigit():
        ok = status == int(expected)
    else:
        return f"unsupported status matcher {expected!r}"
    return None if ok else f"status {status}, expected {expected}"


# --- the runner --------------------------------------------------------------------------


class CaseRunner:
    """Runs conformance cases against one base URL; keeps step results for templates."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, *, tolerance_pct: float = 50.0
    ) -> None:
        self._session = session
        self._base_url = base_url.rstrip("/")
        self._tolerance_pct = tolerance_pct
        self._steps: dict[str, dict[str, Any]] = {}
        self._captured: dict[str, Any] = {}

    async def run(self, case: Mapping[str, Any]) -> None:
        """Run setup, steps and teardown; raise CaseFailure at the first failing step."""
        self._steps.clear()
        self._captured.clear()
        label = str(case.get("test_id", case.get("name", "case")))
        try:
            await self._run_steps(label, _phase(case.get("setup")))
            await self._run_steps(label, list(case.get("steps", [])))
        finally:
            await self._run_steps(label, _phase(case.get("teardown")))

    async def _run_steps(self, label: str, steps: Sequence[Mapping[str, Any]]) -> None:
        index = 0
        while index < len(steps):
            group = [steps[index]]
            # Steps joined by `parallel_with` run concurrently (e.g. competing fetches).
            while index + len(group) < len(steps):
                following = steps[index + len(group)]
                ids = {str(step.get("id")) for step in group}
                partners = {str(step.get("parallel_with")) for step in group}
                if following.get("parallel_with") in ids or following.get("id") in partners:
                    group.append(following)
                else:
                    break
            outcomes = await asyncio.gather(*(self._run_step(step) for step in group))
            for step, failures in zip(group, outcomes, strict=True):
                if failures:
                    raise CaseFailure(f"{label} step {step.get('id')}: " + "; ".join(failures))
            index += len(group)

    async def _run_step(self, step: Mapping[str, Any]) -> list[str]:
        action = str(step.get("action", "")).upper()
        delay_ms = step.get("delay_ms") or 0
        if action == "WAIT":
            await asyncio.sleep((step.get("duration_ms") or delay_ms) / 1000)
            return []
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        assertions: Mapping[str, Any] = step.get("assertions") or {}
        if action == "ASSERT":
            return self._cross_step(assertions)
        try:
            response = await self._request(action, step)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return [f"request failed: {exc!r}"]
        step_id = str(step.get("id"))
        self._steps[step_id] = {
            "response": {
                "status": response.status,
                "headers": dict(response.headers),
                "body": response.body,
            }
        }
        for name, path in (step.get("captures") or step.get("capture") or {}).items():
            found, value = resolve(response.body, path)
            if found:
                self._captured[name] = value
        return self._check_response(response, self._render(assertions))

    async def _request(self, method: str, step: Mapping[str, Any]) -> Response:
        headers = {
            str(name): self.substitute(str(value))
            for name, value in (step.get("headers") or {}).items()
        }
        data: bytes | None = None
        if "raw_body" in step:
            data = self.substitute(str(step["raw_body"])).encode()
        elif "body" in step:
            data = json.dumps(self._render(step["body"])).encode()
        if data is not None and not any(name.lower() == "content-type" for name in headers):
            headers["Content-Type"] = "application/json"
        skip = () if data is not None else ("Content-Type",)
        url = self._base_url + self.substitute(str(step.get("path", "")))
        started = time.monotonic()
        async with self._session.request(
            method, url, data=data, headers=headers, skip_auto_headers=skip
        ) as answer:
            raw = await answer.text()
            elapsed_ms = (time.monotonic() - started) * 1000
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                body = None
            return Response(answer.status, answer.headers.copy(), body, raw, elapsed_ms)

    # --- templates -------------------------------------------------------------------

    def _lookup(self, expression: str) -> tuple[bool, Any]:
        if expression in self._captured:
            return True, self._captured[expression]
        if not expression.startswith("steps."):
            return False, None
        rest = expression.removeprefix("steps.")
        for step_id in sorted(self._steps, key=len, reverse=True):
            if rest == step_id or rest.startswith(step_id + "."):
                tail = rest.removeprefix(step_id).lstrip(".")
                path = "$" + "".join(
                    f"[{part}]" if part.isdigit() else f".{part}"
                    for part in tail.split(".")
                    if part
                )
                return resolve(self._steps[step_id], path)
        return False, None

    def substitute(self, text: str) -> str:
        """Replace every resolvable template by its string form; leave the others as is."""

        def replace(match: re.Match[str]) -> str:
            found, value = self._lookup(match.group(1))
            return go_format(value) if found else match.group(0)

        return _TEMPLATE.sub(replace, text)

    def _value(self, text: Any) -> Any:
        """A whole-template string as its raw value (for ASSERT), else substituted text."""
        if isinstance(text, str):
            match = _TEMPLATE.fullmatch(text.strip())
            if match is not None:
                found, value = self._lookup(match.group(1))
                if found:
                    return value
            return self.substitute(text)
        return text

    def _render(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.substitute(value)
        if isinstance(value, list):
            return [self._render(item) for item in value]
        if isinstance(value, dict):
            return {self.substitute(str(k)): self._render(v) for k, v in value.items()}
        return value

    # --- assertions ------------------------------------------------------------------

    def _check_response(self, response: Response, assertions: Mapping[str, Any]) -> list[str]:
        failures: list[str] = []
        if "status" in assertions:
            failure = check_status(response.status, assertions["status"])
            if failure:
                failures.append(failure)
        for key in ("status_in", "status_one_of"):
            if key in assertions and response.status not in assertions[key]:
                failures.append(f"status {response.status}, expected one of {assertions[key]}")
        for name, expected in (assertions.get("headers") or {}).items():
            actual = response.headers.get(name)
            if isinstance(expected, str):
                if actual != expected:
                    failures.append(f"header {name}: {actual!r}, expected {expected!r}")
            else:
                failure = check(actual is not None, actual, expected)
                if failure:
                    failures.append(f"header {name}: {failure}")
        failures.extend(self._check_body(response, assertions.get("body") or {}))
        for path in assertions.get("body_absent") or ():
            found, value = resolve(response.body, path)
            if found and value is not None:
                failures.append(f"{path}: expected absent, got {_describe(True, value)}")
        for text in assertions.get("body_contains") or ():
            if text not in response.raw:
                failures.append(f"body does not contain {text!r}")
        failures.extend(self._check_timing(response.elapsed_ms, assertions.get("timing_ms")))
        return failures

    def _check_body(self, response: Response, spec: Mapping[str, Any]) -> list[str]:
        failures: list[str] = []
        for key, expected in spec.items():
            if key == "$or":
                alternatives = [self._check_body(response, alt) for alt in expected]
                if all(alternatives):
                    failures.append(
                        "no $or alternative held: "
                        + " | ".join("; ".join(alt) for alt in alternatives)
                    )
            elif key == "$empty":
                raw = response.raw.strip()
                empty = raw in ("", "null") or response.body in ({}, [])
                if empty != bool(expected):
                    failures.append(f"expected body empty={expected}")
            else:
                found, actual = resolve(response.body, key)
                failure = check(found, actual, expected, tolerance_pct=self._tolerance_pct)
                if failure:
                    failures.append(f"{key}: {failure}")
        return failures

    def _check_timing(self, elapsed_ms: float, spec: Mapping[str, Any] | None) -> list[str]:
        if not spec:
            return []
        failures: list[str] = []
        if "less_than" in spec and not elapsed_ms < spec["less_than"]:
            failures.append(f"took {elapsed_ms:.0f} ms, expected < {spec['less_than']}")
        if "greater_than" in spec and not elapsed_ms > spec["greater_than"]:
            failures.append(f"took {elapsed_ms:.0f} ms, expected > {spec['greater_than']}")
        if "approximate" in spec:
            wanted = float(spec["approximate"])
            if abs(elapsed_ms - wanted) > max(wanted * self._tolerance_pct / 100, 100.0):
                failures.append(f"took {elapsed_ms:.0f} ms, expected ~{wanted:.0f}")
        return failures

    def _cross_step(self, assertions: Mapping[str, Any]) -> list[str]:
        failures: list[str] = []
        context = {"steps": self._steps}
        for left, right in (assertions.get("equality") or {}).items():
            if left.startswith("$"):
                found, actual = resolve(context, left)
            else:
                found, actual = True, self._value(left)
            expected = self._value(right)
            if not found or actual != expected:
                failures.append(f"equality {left}: {_describe(found, actual)} != {expected!r}")
        claim = assertions.get("exclusive_claim")
        if claim:
            job_id = self._value(claim.get("job_id"))
            fetches = [self._value(item) for item in claim.get("fetches", [])]
            # An unresolved template means the fetch returned no jobs array (e.g. 204).
            lists = [fetched if isinstance(fetched, list) else [] for fetched in fetches]
            holders = sum(
                any(isinstance(j, dict) and j.get("id") == job_id for j in jobs) for jobs in lists
            )
            empties = sum(not jobs for jobs in lists)
            if claim.get("exactly_one_has_job") and holders != 1:
                failures.append(f"exclusive_claim: {holders} fetches got job {job_id}")
            if claim.get("exactly_one_empty") and empties != 1:
                failures.append(f"exclusive_claim: {empties} fetches were empty")
        return failures


def _phase(value: Any) -> list[Mapping[str, Any]]:
    """setup/teardown may be a list of steps or an object holding `steps`."""
    if isinstance(value, Mapping):
        return list(value.get("steps", []))
    return list(value or [])
