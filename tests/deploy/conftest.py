"""Fixtures of the deployment tests: the Debian tools they run (systemd-analyze, promtool).

A missing tool fails the test where it could be installed (Debian, as root: `.ci/run`
installs it) and skips it, saying why, only where it cannot.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _tool(name: str, package: str) -> Path:
    found = shutil.which(name)
    if found is not None:
        return Path(found)
    if shutil.which("apt-get") is not None and os.geteuid() == 0:
        pytest.fail(f"{name} is missing: `apt-get install {package}` (as .ci/run does)")
    pytest.skip(
        f"{name} is not installed and cannot be installed here: it comes from the Debian "
        f"package {package}, and this machine has no apt-get usable as root"
    )


@pytest.fixture(scope="session")
def systemd_analyze() -> Path:
    """systemd-analyze (Debian package systemd)."""
    return _tool("systemd-analyze", "systemd")


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool (Debian package prometheus)."""
    return _tool("promtool", "prometheus")
