"""The system tools some tests run (promtool, prometheus, systemd-analyze, nftables and
iproute2, libfaketime, Chromium and its chromedriver), found by one rule.

On a user's machine a missing tool skips the tests that need it, naming the tool and the
Debian package that provides it, and the run's summary lists what was not proven there. In
CI (`.ci/run` installs every tool and sets RELAYD_TEST_REQUIRE_TOOLS=1) a missing tool fails
instead: CI skips nothing it could have run. Tools that come as Python packages are dev
dependencies and are never looked up here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from glob import glob
from pathlib import Path

import pytest

# Set by .ci/run: a missing tool is a failure, not a skip (RELAYD_TEST_* is the test
# suite's prefix, which relayd itself ignores).
REQUIRE_ENV = "RELAYD_TEST_REQUIRE_TOOLS"
# How a skip for a missing tool begins: the run's summary gathers these.
SKIP_PREFIX = "needs "


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def missing(what: str, package: str, why: str = "not installed") -> None:
    """Skip the test (or fail it where tools are required): `what` is missing here."""
    reason = f"{SKIP_PREFIX}{what} (Debian package {package}): {why}"
    if required():
        pytest.fail(f"{reason}, and {REQUIRE_ENV} is set: install it (.ci/run does)")
    pytest.skip(reason)


def tool(name: str, package: str) -> Path:
    """The executable `name` on PATH; else skip (or fail) naming it and its package."""
    found = shutil.which(name)
    if found is None:
        missing(name, package)
    assert found is not None
    return Path(found)


def library(name: str, package: str, patterns: Sequence[str]) -> str:
    """The first file matching one of `patterns` (a shared library); else skip or fail."""
    for pattern in patterns:
        found = sorted(glob(pattern))
        if found:
            return found[0]
    missing(name, package)
    raise AssertionError("unreachable: missing() skips or fails")


def root(what: str) -> None:
    """Skip (or fail, where tools are required) unless this process runs as root."""
    if os.geteuid() != 0:
        reason = f"{SKIP_PREFIX}root for {what}"
        if required():
            pytest.fail(f"{reason}, and {REQUIRE_ENV} is set (CI runs as root)")
        pytest.skip(reason)
