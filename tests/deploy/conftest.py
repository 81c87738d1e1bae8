"""Fixtures of the deployment tests: the system tools they run (systemd-analyze, promtool),
found or skipped by the suite's one rule (tests/tools.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools import tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="session")
def systemd_analyze() -> Path:
    """systemd-analyze (Debian package systemd)."""
    return tool("systemd-analyze", "systemd")


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool (Debian package prometheus)."""
    return tool("promtool", "prometheus")


# Every metric relayd exports (docs/observe.md#metrics), with the standard ones a scrape
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
        "relayd_parked_keys",
        "relayd_oldest_parked_age_seconds",
        "relayd_build_info",
        "relayd_sink_requests_total",
        "relayd_housekeeping_failures_total",
        "relayd_housekeeping_failing",
        "relayd_poison_storm_trips_total",
        "relayd_poison_storm_local_holds",
        "relayd_sink_pauses_total",
        "relayd_sink_reconnects_total",
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
