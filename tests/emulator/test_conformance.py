"""The emulator against the OJS conformance suite (its JSON cases, run by our interpreter).

The suite is read in place, never copied: `RELAYD_TEST_OJS_CONFORMANCE`, default
`../shared/ojs-conformance` beside the repository root. Cases the emulator deliberately
diverges from are listed once, in DIVERGENT, and must keep failing (strict).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayd.testing.emulator import start_emulator
from tests.emulator.conformance import CaseFailure, CaseRunner, check, check_status, resolve


def _repository_root() -> Path:
    for directory in Path(__file__).resolve().parents:
        if (directory / "pyproject.toml").is_file():
            return directory
    raise RuntimeError("no pyproject.toml above the tests")


SUITE_ENV = "RELAYD_TEST_OJS_CONFORMANCE"
SUITE_DIR = (_repository_root() / os.environ.get(SUITE_ENV, "../shared/ojs-conformance")).resolve()
# The categories the emulator implements; each JSON file in them is one pytest case.
SELECTED = (
    "level-0-core/envelope",
    "level-0-core/events",
    "level-0-core/lifecycle",
    "level-0-core/operations",
    "level-1-reliable/visibility",
    "level-1-reliable/worker",
    "level-2-scheduled/delay",
    "level-2-scheduled/ttl",
    "level-4-advanced/bulk",
    "level-4-advanced/priority",
)
# path (relative to suites/) -> why the emulator deliberately answers otherwise.
DIVERGENT: dict[str, str] = {
    "level-0-core/operations/error-validation-invalid-payload.json": (
        "expects code invalid_payload for malformed JSON; the reference servers answer "
        "invalid_request, and so does the emulator"
    ),
}


def _case_files() -> list[str]:
    suites = SUITE_DIR / "suites"
    return sorted(
        path.relative_to(suites).as_posix()
        for category in SELECTED
        for path in (suites / category).glob("*.json")
    )


def _params() -> list[Any]:
    if not (SUITE_DIR / "suites").is_dir():
        reason = f"OJS conformance suite not found at {SUITE_DIR} (set {SUITE_ENV})"
        return [pytest.param(None, id="suite-missing", marks=pytest.mark.skip(reason=reason))]
    return [pytest.param(name, id=name) for name in _case_files()]


@pytest.mark.parametrize("case_path", _params())
async def test_conformance_case(case_path: str, http: aiohttp.ClientSession) -> None:
    """The emulator passes the conformance case, or fails it exactly as DIVERGENT says."""
    case = json.loads((SUITE_DIR / "suites" / case_path).read_text(encoding="utf-8"))
    async with await start_emulator() as running:
        try:
            await CaseRunner(http, running.url).run(case)
        except CaseFailure as failure:
            if case_path in DIVERGENT:
                pytest.xfail(f"{DIVERGENT[case_path]} [{failure}]")
            raise
    if case_path in DIVERGENT:
        pytest.fail(f"{case_path} passes: remove it from DIVERGENT")


@pytest.mark.skipif(
    not (SUITE_DIR / "suites").is_dir(),
    reason=f"OJS conformance suite not found at {SUITE_DIR} (set {SUITE_ENV})",
)
def test_selection_is_honest() -> None:
    """At least 40 cases run, and every divergence names a case that is actually run."""
    files = _case_files()
    assert len(files) >= 40
    assert set(DIVERGENT) <= set(files)


# --- the interpreter itself: it must be able to fail -------------------------------------


@pytest.mark.parametrize(
    ("found", "actual", "matcher", "ok"),
    [
        (True, "019461a8-1a2b-7c3d-8e4f-5a6b7c8d9e0f", "string:uuidv7", True),
        (True, "550e8400-e29b-41d4-a716-446655440000", "string:uuidv7", False),
        (True, "2026-01-01T00:00:00.000Z", "string:datetime", True),
        (True, "2026-01-01 00:00", "string:datetime", False),
        (True, "", "string:nonempty", False),
        (False, None, "absent", True),
        (True, "x", "absent", False),
        (True, 3, "number:range(1,5)", True),
        (True, 6, "number:range(1,5)", False),
        (True, 1400, "~1000", True),
        (True, 1600, "~1000", False),
        (True, [1, 2], "array:length:2", True),
        (True, [1, 2], "array:length(3)", False),
        (True, [], "array:empty", True),
        (True, ["a", "b"], "contains:b", True),
        (True, ["a", "b"], "not_contains:b", False),
        (True, "available", "available", True),
        (True, "active", "available", False),
        (True, 1, "1", True),
        (True, 0, 0, True),
        (True, False, 0, False),
        (True, None, None, True),
        (False, None, None, False),
        (True, [], [], True),
        (True, [1], [], False),
        (True, ["a", 1], ["string:nonempty", 1], True),
        (False, None, {"$exists": False}, True),
        (True, "x", {"$exists": True, "$type": "string"}, True),
        (True, 1, {"$exists": True, "$type": "string"}, False),
        (True, "Validation failed", {"$match": "^Valid"}, True),
        (True, "completed", {"$in": ["completed", "cancelled"]}, True),
        (True, "active", {"$in": ["completed", "cancelled"]}, False),
        (True, "x", {"$or": ["string:nonempty", {"$exists": False}]}, True),
        (True, [1, 2], {"$size": {"$gte": 1}}, True),
        (True, [], {"$size": {"$gte": 1}}, False),
        (True, 50, {"range": {"min": 0, "max": 100}}, True),
        (True, 150, {"range": {"max": 100}}, False),
    ],
)
def test_matchers(found: bool, actual: Any, matcher: Any, ok: bool) -> None:
    """Each DSL matcher accepts what it should and rejects what it should."""
    assert (check(found, actual, matcher) is None) is ok


@pytest.mark.parametrize(
    ("status", "matcher", "ok"),
    [
        (201, 201, True),
        (200, 201, False),
        (404, "number:range(400,422)", True),
        (500, "number:range(400,422)", False),
        (422, "one_of:400,422", True),
        (409, {"$in": [200, 409]}, True),
        (201, {"$in": [200, 409]}, False),
    ],
)
def test_status_matchers(status: int, matcher: Any, ok: bool) -> None:
    """Every status form of the DSL is honoured."""
    assert (check_status(status, matcher) is None) is ok


def test_jsonpath() -> None:
    """Dot, index, wildcard and filter paths resolve like the Go runner's."""
    body = {"jobs": [{"id": "a", "state": "active"}, {"id": "b", "state": "done"}], "n": 0}
    assert resolve(body, "$.jobs[1].id") == (True, "b")
    assert resolve(body, "$.jobs[*].id") == (True, ["a", "b"])
    assert resolve(body, "$.jobs[?(@.state=='done')].id") == (True, "b")
    assert resolve(body, "$.missing") == (False, None)
    assert resolve(body, "$.n") == (True, 0)


async def test_interpreter_reports_a_wrong_expectation(http: aiohttp.ClientSession) -> None:
    """A case whose expectation the server does not meet raises CaseFailure naming the step."""
    case = {
        "test_id": "SELF-1",
        "steps": [
            {
                "id": "enqueue",
                "action": "POST",
                "path": "/ojs/v1/jobs",
                "body": {"type": "a.b", "args": []},
                "assertions": {"status": 201, "body": {"$.job.state": "available"}},
            },
            {
                "id": "get",
                "action": "GET",
                "path": "/ojs/v1/jobs/{{steps.enqueue.response.body.job.id}}",
                "assertions": {"status": 200, "body": {"$.job.state": "completed"}},
            },
        ],
    }
    async with await start_emulator() as running:
        with pytest.raises(CaseFailure, match=r"SELF-1 step get: \$\.job\.state"):
            await CaseRunner(http, running.url).run(case)
