"""The suite's rule for system tools (tests/tools.py), run on itself: with a tool hidden
from PATH, its tests skip, naming the tool and its package, and the run's summary lists what
was not proven; with RELAYD_TEST_REQUIRE_TOOLS set (as in CI) the same tests fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import REQUIRE_ENV

ROOT = Path(__file__).resolve().parents[2]
# Two tests that need promtool and nothing else (no database, no other tool).
TESTS = (
    "tests/deploy/test_prometheus.py::test_promtool_check_rules",
    "tests/deploy/test_prometheus.py::test_promtool_test_rules",
)


def _pytest(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """This interpreter's pytest on TESTS, with a PATH that holds no tool at all."""
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV} | {"PATH": str(empty)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=ROOT,
        env=env | extra,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_a_missing_tool_skips_with_its_package_and_is_listed(tmp_path: Path) -> None:
    """Unset: exit 0, both tests skipped with the tool and its Debian package named, and
    the summary's "not proven on this machine" section counts them."""
    result = _pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout
    assert "needs promtool (Debian package prometheus): not installed" in result.stdout
    assert "not proven on this machine" in result.stdout
    assert "2 test(s) skipped: needs promtool (Debian package prometheus)" in result.stdout


@pytest.mark.slow
def test_a_missing_tool_fails_where_tools_are_required(tmp_path: Path) -> None:
    """RELAYD_TEST_REQUIRE_TOOLS=1 (CI): the same tests fail (in their tool fixture: pytest
    reports errors), saying what to install."""
    result = _pytest(tmp_path, **{REQUIRE_ENV: "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 errors" in result.stdout
    assert "skipped" not in result.stdout
    assert f"and {REQUIRE_ENV} is set: install it" in result.stdout
