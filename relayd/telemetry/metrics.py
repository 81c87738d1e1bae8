"""Every Prometheus metric relayd exports, on an injectable registry (tests get their own).

Labels are bounded enumerations (outcome, reason, state, method, code); never ids. The
process collectors (RSS, open fds, start time, the Python build) are registered on this
registry too: relayd never exports prometheus_client's global registry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from relayd.core import __version__
from relayd.core.backlog import BACKLOG_BOUND, Backlog
from relayd.core.outcomes import DeadReason, Settled
from relayd.core.retry import BreakerState

# Seconds; from a fast local sink to a backlog drained after an outage.
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)
_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# No `*_created` series: they double the series count and no alert or dashboard of ours
# reads them. prometheus_client offers two switches, both process-wide: this function, and
# the PROMETHEUS_DISABLE_CREATED_SERIES environment variable, which it reads at import. The
# variable would be inherited by every process relayd starts (the emulator, `relayd demo`'s
# children) and by any Python process sharing a unit's or container's environment, changing
# their registries too; the call changes this interpreter only, which relayd owns when it
# exports metrics.
disable_created_metrics()  # type: ignore[no-untyped-call]  # the library leaves it unannotated


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
            "Duration of one publish attempt (one request's rows: a job, with its GET if any, "
            "or a batch), observed once per outcome among its rows.",
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
        self.sink_requests = Counter(
            "relayd_sink_requests",
            "Exchanges with the sink, by sink kind, operation and result. For an HTTP sink "
            "the operation is the method and the result the answer's status; 'error' for a "
            "transport failure without an answer (refused, reset, TLS), 'timeout' when the "
            "attempt's deadline ended it first.",
            ["sink", "operation", "code"],
            registry=r,
        )
        self._sink_request_children: dict[tuple[str, str, str], Counter] = {}
        self.sink_reconnects = Counter(
            "relayd_sink_reconnects",
            "Times the sink's client made its lost connection again, by sink kind. Only a "
            "sink that keeps a connection counts (NATS); the HTTP sinks (OJS, webhooks) open "
            "pooled connections as requests need them, and have none to lose.",
            ["sink"],
            registry=r,
        )
        # --- housekeeping (relayd/engine/chores.py) and the poison-storm guard ---
        self.housekeeping_failures = Counter(
            "relayd_housekeeping_failures",
            "Runs of a housekeeping chore (cleanup, sampler, heartbeat, storm_pause) whose "
            "statement PostgreSQL refused; publishing goes on.",
            ["chore"],
            registry=r,
        )
        self.housekeeping_failing = Gauge(
            "relayd_housekeeping_failing",
            "1 while a housekeeping chore's last run failed, else 0.",
            ["chore"],
            registry=r,
        )
        self.storm_trips = Counter(
            "relayd_poison_storm_trips",
            "Times the poison-storm guard tripped on a queue and job type.",
            registry=r,
        )
        self.sink_pauses = Counter(
            "relayd_sink_pauses",
            "Pauses the sink asked for and relayd stored: a webhook endpoint that answered "
            "410 Gone (its route is paused until an operator resumes it).",
            registry=r,
        )
        self.storm_local_holds = Gauge(
            "relayd_poison_storm_local_holds",
            "Queues and types the poison-storm guard holds in this process alone, because "
            "their pause could not be stored (other replicas do not hold them).",
            registry=r,
        )
        # --- the backlog, sampled every metrics.sample_interval_s (relayd/daemon/sampler.py) ---
        self.outbox_rows = Gauge(
            "relayd_outbox_rows",
            "Outbox rows by state at the last sample: ready (claimable now: the claim's "
            "predicate, pauses included), scheduled (waiting out a backoff), leased (claimed, "
            "in flight: lease_owner set, among the rows due within relay.lease_s), dead "
            "(dead-lettered, not discarded). Due rows of a paused queue are in no state. "
            f"Counted exactly up to {BACKLOG_BOUND} rows per index scan (pending rows: the "
            "claim index; dead: the dead-letter index); above that, PostgreSQL's estimate of "
            "the index's rows (pg_class.reltuples, as of the last VACUUM or ANALYZE) less the "
            "exact counts of the other states.",
            ["state"],
            registry=r,
        )
        self.oldest_claimable_age = Gauge(
            "relayd_outbox_oldest_claimable_age_seconds",
            "now() - available_at of the first row the claim would take (same predicate and "
            "order, pauses included): how long it has been claimable. 0 when none. A row "
            "waiting out a backoff does not count: this grows only when relayd is not "
            "keeping up. +Inf for a row whose available_at is -infinity.",
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "relayd_outbox_oldest_pending_age_seconds",
            "now() - created_at of the oldest row neither published nor dead-lettered, in "
            "backoff or not (from the index on created_at of pending rows). 0 when none.",
            registry=r,
        )
        self.backlog_sampled = Gauge(
            "relayd_backlog_sampled_timestamp_seconds",
            "Unix time of the last successful backlog sample (0 before the first): the "
            "backlog gauges are this old.",
            registry=r,
        )
        self.paused = Gauge(
            "relayd_paused",
            "1 while relayd_pauses holds any pause of this outbox (one queue or '*'), at the "
            "last sample; else 0.",
            registry=r,
        )
        self.parked_keys = Gauge(
            "relayd_parked_keys",
            "Keys of ordered delivery parked at the last sample, by route (the event type of "
            "the head that parked each): their rows wait until an operator retries, skips or "
            "releases the key (relayd keys). A route with no parked key has no series.",
            ["route"],
            registry=r,
        )
        self._parked_routes: set[str] = set()
        self.oldest_parked_age = Gauge(
            "relayd_oldest_parked_age_seconds",
            "now() - parked_at of the key parked longest, at the last sample. 0 when none.",
            registry=r,
        )
        self.build_info = Gauge(
            "relayd_build_info", "Always 1; the running relayd's version.", ["version"], registry=r
        )
        self.build_info.labels(__version__).set(1)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        # Children resolved once: the relay counts and observes them for every row, and a
        # label lookup costs more than the increment.
        self.settled = {settled: self.outcomes.labels(settled.value) for settled in Settled}
        self.dead_by_reason = {
            reason.value: self.dead_lettered.labels(reason.value) for reason in DeadReason
        }
        self.publish_duration_by = {
            label: self.publish_duration.labels(label)
            for label in (*(settled.value for settled in Settled), "sink_down")
        }

    def set_breaker(self, state: BreakerState) -> None:
        self.breaker_state.set(state.value)

    def sink_requests_of(self, kind: str) -> Callable[[str, str], None]:
        """What a sink of `kind` is told to call for each exchange, (operation, code): the
        sink is given this, not the registry."""

        def count(operation: str, code: str) -> None:
            key = (kind, operation, code)
            child = self._sink_request_children.get(key)
            if child is None:  # a bounded set: a few operations, statuses, "error", "timeout"
                child = self.sink_requests.labels(*key)
                self._sink_request_children[key] = child
            child.inc()

        return count

    def set_backlog(self, backlog: Backlog, *, sampled_at: float | None = None) -> None:
        """Publish one backlog sample; `sampled_at` is unix time (default: now)."""
        for state, rows in backlog.by_state().items():
            self.outbox_rows.labels(state).set(rows)
        self.oldest_claimable_age.set(_age(backlog.oldest_claimable_age_s))
        self.oldest_pending_age.set(_age(backlog.oldest_pending_age_s))
        self.paused.set(1 if backlog.any_pause else 0)
        routes = backlog.parked_keys
        for gone in self._parked_routes - routes.keys():
            self.parked_keys.remove(gone)
        for route, keys in routes.items():
            self.parked_keys.labels(route).set(keys)
        self._parked_routes = set(routes)
        self.oldest_parked_age.set(_age(backlog.oldest_parked_age_s))
        self.backlog_sampled.set(time.time() if sampled_at is None else sampled_at)


def _age(seconds: float | None) -> float:
    """None (no such row) is 0; a negative age (a time ahead of the database's clock) too."""
    if seconds is None or math.isnan(seconds):
        return 0.0
    return max(seconds, 0.0)
