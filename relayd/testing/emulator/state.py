"""What the emulated server holds: the stored jobs, per-queue ready heaps, timers, events and
the ledger, on a clock tests can move; and the transitions every endpoint shares."""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relayd.producer import uuid7
from relayd.testing.emulator.config import EmulatorConfig
from relayd.testing.emulator.jobs import TERMINAL_STATES, Job
from relayd.testing.emulator.wire import Reject, format_time, internal_error

_EVENT_HISTORY = 10_000


@dataclass(slots=True)
class Counts:
    """The ledger's running counts for one job id (see the package docstring)."""

    queue: str | None = None
    created: int = 0
    overwrites: int = 0
    posts: int = 0
    post_statuses: list[int | None] = field(default_factory=list)
    post_traceparents: list[str | None] = field(default_factory=list)
    gets: int = 0
    deliveries: int = 0
    purged: bool = False


@dataclass(slots=True)
class Event:
    """One event as recorded; its id and time are drawn when it is first shown (most are
    never read, and a busy emulator records one per job)."""

    kind: str
    at: float
    data: dict[str, Any]
    _shown: dict[str, Any] | None = None

    def view(self) -> dict[str, Any]:
        """The event as GET /ojs/v1/events shows it (a fresh copy; the same id every time)."""
        if self._shown is None:
            self._shown = {
                "id": uuid7(self.at),
                "type": self.kind,
                "time": format_time(self.at),
                "data": self.data,
            }
        return copy.deepcopy(self._shown)


@dataclass(frozen=True)
class LedgerEntry:
    """What one job id went through (see the package docstring)."""

    job: dict[str, Any] | None
    queue: str | None
    created: int
    overwrites: int
    posts: int
    post_statuses: tuple[int | None, ...]
    post_traceparents: tuple[str | None, ...]
    gets: int
    deliveries: int
    purged: bool

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["post_statuses"] = list(self.post_statuses)
        data["post_traceparents"] = list(self.post_traceparents)
        return data


class EmulatorState:
    """The jobs and their bookkeeping. Time-driven transitions (scheduled and retry
    promotion, lease expiry, retention purge) are applied lazily by `advance()`."""

    def __init__(self, config: EmulatorConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.started_s = clock()
        self.reset()

    def reset(self) -> None:
        """Forget every job, the ledger, the events and any clock advance."""
        self._offset_s = 0.0
        self.jobs: dict[str, Job] = {}
        self._ledger: dict[str, Counts] = {}
        self._versions = itertools.count(1)
        self._sequence = itertools.count(1)
        # Per queue, a heap of (-priority, sequence, version, id); stale entries are skipped.
        self._ready: dict[str, list[tuple[int, int, int, str]]] = {}
        # (deadline, version, id): promotion, lease expiry and purge, applied lazily.
        self._timers: list[tuple[float, int, str]] = []
        self.events: deque[Event] = deque(maxlen=_EVENT_HISTORY)
        # Every stored job's id, in the order the jobs were stored (overwrites included):
        # what an ordering check reads; and beside each, when its request was received
        # (what a latency measurement reads).
        self.arrivals: list[str] = []
        self.received_at: list[float] = []

    def now(self) -> float:
        """The emulator's clock (epoch seconds), including any advance."""
        return self.clock() + self._offset_s

    def advance_clock(self, seconds: float) -> None:
        """Move the clock forward and apply what became due."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self._offset_s += seconds
        self.advance()

    def job(self, job_id: str) -> dict[str, Any] | None:
        """The stored job as GET would show it, or None."""
        self.advance()
        job = self.jobs.get(job_id)
        return None if job is None else job.view()

    def ledger(self) -> dict[str, LedgerEntry]:
        """A snapshot of the ledger, by job id."""
        self.advance()
        entries: dict[str, LedgerEntry] = {}
        for job_id, counts in self._ledger.items():
            job = self.jobs.get(job_id)
            entries[job_id] = LedgerEntry(
                job=None if job is None else job.view(),
                queue=counts.queue,
                created=counts.created,
                overwrites=counts.overwrites,
                posts=counts.posts,
                post_statuses=tuple(counts.post_statuses),
                post_traceparents=tuple(counts.post_traceparents),
                gets=counts.gets,
                deliveries=counts.deliveries,
                purged=counts.purged,
            )
        return entries

    def counts(self, job_id: str) -> Counts:
        """The ledger counts of a job id, created at its first mention."""
        counts = self._ledger.get(job_id)
        if counts is None:
            counts = self._ledger[job_id] = Counts()
        return counts

    # --- transitions -----------------------------------------------------------------

    def advance(self) -> None:
        """Apply every time-driven transition that is due on the emulator's clock."""
        now = self.now()
        while self._timers and self._timers[0][0] <= now:
            _deadline, version, job_id = heapq.heappop(self._timers)
            job = self.jobs.get(job_id)
            if job is None or job.version != version:
                continue
            if job.state in ("scheduled", "retryable"):
                self.enter(job, "available", now)
            elif job.state == "active":
                self._expire_lease(job, now)
            elif job.state in TERMINAL_STATES:
                del self.jobs[job_id]
                self.counts(job_id).purged = True

    def enter(self, job: Job, state: str, now: float) -> None:
        """Move a job to a state and arm what that state waits for."""
        job.state = state
        job.version = next(self._versions)
        if state == "available":
            job.enqueued_at = now
            entry = (-job.priority, next(self._sequence), job.version, job.id)
            heapq.heappush(self._ready.setdefault(job.queue, []), entry)
        elif state == "scheduled" and job.scheduled_at is not None:
            heapq.heappush(self._timers, (job.scheduled_at, job.version, job.id))
        elif state == "retryable" and job.next_attempt_at is not None:
            heapq.heappush(self._timers, (job.next_attempt_at, job.version, job.id))
        elif state == "active" and job.lease_expires_at is not None:
            heapq.heappush(self._timers, (job.lease_expires_at, job.version, job.id))
        elif state in TERMINAL_STATES:
            job.lease_token = None
            job.lease_expires_at = None
            heapq.heappush(self._timers, (now + self.config.retention_s, job.version, job.id))

    def _expire_lease(self, job: Job, now: float) -> None:
        error = {
            "type": "visibility_timeout",
            "code": "visibility_timeout",
            "message": "The visibility timeout expired before an ack or nack.",
            "attempt": job.attempt,
            "occurred_at": format_time(now),
        }
        job.error = error
        job.errors.append(error)
        job.lease_token = None
        job.lease_expires_at = None
        if job.attempt >= job.max_attempts:
            job.discarded_at = job.completed_at = now
            self.enter(job, "discarded", now)
            self.event("job.discarded", job, now)
        else:
            self.enter(job, "available", now)

    def event(self, kind: str, job: Job, now: float, **data: Any) -> None:
        """Record an event for GET /ojs/v1/events (the most recent ones are kept)."""
        self.events.append(
            Event(
                kind,
                now,
                {
                    "job_id": job.id,
                    "job_type": job.type,
                    "queue": job.queue,
                    "attempt": job.attempt,
                    "state": job.state,
                    **data,
                },
            )
        )

    def conflict(self, job: Job, earlier_queues: dict[str, str]) -> Reject | None:
        """The answer to storing `job` if its id is taken (stored, or earlier in a batch)."""
        stored = self.jobs.get(job.id)
        taken_queue = earlier_queues.get(job.id, stored.queue if stored is not None else None)
        mode = self.config.duplicate_mode
        if taken_queue is None or mode == "overwrite":
            return None
        if mode == "pk500" or (self.config.cross_queue_500 and taken_queue != job.queue):
            return internal_error()
        return Reject(
            409, "duplicate", f"A job with ID '{job.id}' already exists.", retryable=False
        )

    def store(self, job: Job, now: float, received_at: float) -> None:
        """Insert a parsed job (replacing one with its id) as scheduled or available;
        `received_at`: when the request carrying it was received."""
        counts = self.counts(job.id)
        if job.id in self.jobs:
            counts.overwrites += 1  # redis/lite: replace the hash, re-add to the queue
        self.jobs[job.id] = job
        self.arrivals.append(job.id)
        self.received_at.append(received_at)
        counts.created += 1
        counts.queue = job.queue
        counts.purged = False
        if job.scheduled_at is not None and job.scheduled_at > now:
            job.enqueued_at = now
            self.enter(job, "scheduled", now)
        else:
            self.enter(job, "available", now)
        self.event("job.enqueued", job, now)

    def pop_ready(self, queue: str, now: float) -> Job | None:
        """The next available job of a queue by priority, then age; expired ones discarded."""
        heap = self._ready.get(queue)
        while heap:
            _priority, _sequence, version, job_id = heapq.heappop(heap)
            job = self.jobs.get(job_id)
            if job is None or job.version != version or job.state != "available":
                continue
            if job.expires_at is not None and job.expires_at <= now:
                job.discarded_at = now  # never ran, so never completed
                job.error = {"type": "expired", "message": "The job expired before it started."}
                self.enter(job, "discarded", now)
                self.event("job.discarded", job, now)
                continue
            return job
        return None
