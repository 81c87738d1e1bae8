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


# Every metric relayd exports (docs/operations.md#metrics), with the standard ones a scrape
# adds (`up`) or prometheus_client exports (process_*). Histograms also yield _bucket, _sum
# and _count series. The rules and the dashboard may use these names and no others.
RELAYD_METRICS = frozenset(
    {
        "relayd_outcomes_total",
        "relayd_dead_lettered_total",
        "relayd_claims_total",
        "relayd_claimed_rows_total",
        "relayd_breaker_state",
        "relayd_breaker_opened_total",
        "relayd_database_errors_total",
        "relayd_outbox_rows",
        "relayd_outbox_oldest_claimable_age_seconds",
        "relayd_outbox_oldest_pending_age_seconds",
        "relayd_backlog_sampled_timestamp_seconds",
        "relayd_paused",
        "relayd_build_info",
        "relayd_sink_requests_total",
        "relayd_housekeeping_failures_total",
        "relayd_housekeeping_failing",
        "relayd_poison_storm_trips_total",
        "relayd_poison_storm_local_holds",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
        "up",
    }
)
RELAYD_HISTOGRAMS = frozenset(
    {
        "relayd_claim_duration_seconds",
        "relayd_publish_duration_seconds",
        "relayd_commit_to_publish_seconds",
    }
)


def known_series(name: str, recorded: frozenset[str] = frozenset()) -> bool:
    """Whether a PromQL expression may name `name` (a metric, a histogram's series, or a
    recording rule of deploy/prometheus/relayd.rules.yml)."""
    if name in RELAYD_METRICS or name in recorded:
        return True
    base, _, suffix = name.rpartition("_")
    return base in RELAYD_HISTOGRAMS and suffix in ("bucket", "sum", "count")
