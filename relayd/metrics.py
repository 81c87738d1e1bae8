"""Every Prometheus metric relayd exports, on an injectable registry (tests get their own).

Labels are bounded enumerations (outcome, reason, state); never ids.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relayd.models import DeadReason
from relayd.retry import BreakerState
from relayd.settlement import Settled

# Seconds; from a fast local sink to a backlog drained after an outage.
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)
_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RelayMetrics:
    """The relay's counters, histograms and gauges."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        r = self.registry
        self.outcomes = Counter(
            "relayd_outcomes",
            "Rows settled, by outcome (stale: the settle found another owner's lease).",
            ["outcome"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "relayd_dead_lettered", "Rows dead-lettered, by reason.", ["reason"], registry=r
        )
        self.claims = Counter("relayd_claims", "Claim statements run.", registry=r)
        self.claimed_rows = Counter("relayd_claimed_rows", "Rows leased by claims.", registry=r)
        self.claim_duration = Histogram(
            "relayd_claim_duration_seconds",
            "Duration of one claim statement.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.publish_duration = Histogram(
            "relayd_publish_duration_seconds",
            "Duration of one row's publish attempt (GET and POST), by outcome.",
            ["outcome"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.commit_to_publish = Histogram(
            "relayd_commit_to_publish_seconds",
            "From the producer's commit (created_at) to the sink's acceptance.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.breaker_state = Gauge(
            "relayd_breaker_state",
            "Sink circuit breaker: 0 closed, 1 half-open, 2 open.",
            registry=r,
        )
        self.breaker_opened = Counter(
            "relayd_breaker_opened", "Times the sink circuit breaker opened.", registry=r
        )
        self.database_errors = Counter(
            "relayd_database_errors",
            "Statements that failed because PostgreSQL was unreachable.",
            registry=r,
        )
        for settled in Settled:
            self.outcomes.labels(settled.value)
        for reason in DeadReason:
            self.dead_lettered.labels(reason.value)

    def set_breaker(self, state: BreakerState) -> None:
        self.breaker_state.set(state.value)
