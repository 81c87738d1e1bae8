"""The producer endpoints: enqueue, batch, get, cancel, manifest, health, queue stats and
events."""

from __future__ import annotations

import re
from typing import Any

from relayd.testing.emulator.jobs import (
    JOB_STATES,
    TERMINAL_STATES,
    Job,
    parse_identity,
    parse_job,
)
from relayd.testing.emulator.state import EmulatorState
from relayd.testing.emulator.wire import (
    EMULATOR_VERSION,
    Call,
    Reject,
    Reply,
    Route,
    dumps,
    invalid,
    not_found,
)


class ProducerEndpoints:
    """What a producer calls, served from the shared state."""

    def __init__(self, state: EmulatorState) -> None:
        self.state = state

    def routes(self) -> list[Route]:
        """The producer paths, in lookup order."""
        return [
            Route("POST", re.compile(r"^/ojs/v1/jobs$"), self.enqueue),
            Route(
                "POST",
                re.compile(r"^/ojs/v1/jobs/batch$"),
                self.enqueue_batch,
                enabled=self.state.config.batch_enqueue,
            ),
            Route("GET", re.compile(r"^/ojs/v1/jobs/(?P<id>[^/]+)$"), self.get_job),
            Route("DELETE", re.compile(r"^/ojs/v1/jobs/(?P<id>[^/]+)$"), self.cancel_job),
            Route("GET", re.compile(r"^/ojs/manifest$"), self.manifest),
            Route("GET", re.compile(r"^/ojs/v1/health$"), self.health),
            Route("GET", re.compile(r"^/ojs/v1/queues/(?P<name>[^/]+)/stats$"), self.queue_stats),
            Route("GET", re.compile(r"^/ojs/v1/events$"), self.events),
        ]

    def enqueue(self, call: Call) -> Reply:
        """POST /ojs/v1/jobs."""
        state = self.state
        now = state.now()
        job = parse_job(call.json_object(), now, state.config.queue_source)
        conflict = state.conflict(job, {})
        if conflict is not None:
            raise conflict
        state.store(job, now, call.received_at)
        body = dumps({"job": job.view(fresh=False)})
        return Reply(201, None, {"Location": f"/ojs/v1/jobs/{job.id}"}, raw=body)

    def enqueue_batch(self, call: Call) -> Reply:
        """POST /ojs/v1/jobs/batch, all or nothing or item by item (`batch_atomic`)."""
        config = self.state.config
        now = self.state.now()
        items = call.json_object().get("jobs")
        if not isinstance(items, list) or not items:
            raise invalid("The 'jobs' field is required and must not be empty.", field="jobs")
        if len(items) > config.max_batch_jobs:
            raise invalid(
                f"The 'jobs' field must not contain more than {config.max_batch_jobs} jobs.",
                field="jobs",
                max=config.max_batch_jobs,
                received=len(items),
            )
        if config.batch_atomic:
            jobs = self._store_all_or_none(items, now, call.received_at)
        else:
            jobs = self._store_one_by_one(items, now, call.received_at)
        # Encoded at once: a fault may delay the answer while workers change the jobs.
        views = [job.view(fresh=False) for job in jobs]
        return Reply(201, None, raw=dumps({"jobs": views, "count": len(views)}))

    def _store_all_or_none(self, items: list[Any], now: float, received_at: float) -> list[Job]:
        """Validate and check every item, then store them all."""
        state = self.state
        jobs: list[Job] = []
        for index, item in enumerate(items):
            try:
                jobs.append(parse_job(item, now, state.config.queue_source))
            except Reject as exc:
                raise _batch_item_invalid(exc, index, own_status=False) from exc
        earlier: dict[str, str] = {}
        for index, job in enumerate(jobs):
            _raise_batch_conflict(state.conflict(job, earlier), index)
            earlier[job.id] = job.queue
        for job in jobs:
            state.store(job, now, received_at)
        return jobs

    def _store_one_by_one(self, items: list[Any], now: float, received_at: float) -> list[Job]:
        """Check every item's id, type and args, then validate and store item by item: the
        first that fails answers for the batch and leaves the earlier ones stored."""
        state = self.state
        for index, item in enumerate(items):
            try:
                if not isinstance(item, dict):
                    raise invalid("The request body must be a JSON object.")
                parse_identity(item, now)  # a generated id is drawn again below
            except Reject as exc:
                raise _batch_item_invalid(exc, index, own_status=True) from exc
        jobs: list[Job] = []
        for index, item in enumerate(items):
            try:
                job = parse_job(item, now, state.config.queue_source)
            except Reject as exc:
                raise _batch_item_invalid(exc, index, own_status=True) from exc
            _raise_batch_conflict(state.conflict(job, {}), index)
            state.store(job, now, received_at)
            jobs.append(job)
        return jobs

    def get_job(self, call: Call) -> Reply:
        """GET /ojs/v1/jobs/{id}."""
        job = self.state.jobs.get(call.params["id"])
        if job is None:
            raise not_found("Job", call.params["id"])
        return Reply(200, {"job": job.view()})

    def cancel_job(self, call: Call) -> Reply:
        """DELETE /ojs/v1/jobs/{id}: 409 conflict once the job is terminal."""
        state = self.state
        now = state.now()
        job = state.jobs.get(call.params["id"])
        if job is None:
            raise not_found("Job", call.params["id"])
        if job.state in TERMINAL_STATES:
            raise Reject(
                409,
                "conflict",
                f"Cannot cancel job in terminal state '{job.state}'.",
                details={"job_id": job.id, "current_state": job.state},
            )
        job.cancelled_at = now
        state.enter(job, "cancelled", now)
        state.event("job.cancelled", job, now)
        return Reply(200, {"job": job.view()})

    def manifest(self, call: Call) -> Reply:
        """GET /ojs/manifest."""
        del call
        return Reply(
            200,
            {
                # `specversion` is what the code and conformance read; `ojs_version` the spec.
                "specversion": "1.0",
                "ojs_version": "1.0",
                "implementation": {
                    "name": "relayd-ojs-emulator",
                    "version": EMULATOR_VERSION,
                    "language": "python",
                },
                "conformance_level": 0,
                "protocols": ["http"],
                "backend": "memory",
                "capabilities": {
                    "batch_enqueue": self.state.config.batch_enqueue,
                    "cron_jobs": False,
                    "dead_letter": False,
                    "delayed_jobs": True,
                    "job_ttl": True,
                    "priority_queues": True,
                    "rate_limiting": False,
                    "schema_validation": False,
                    "unique_jobs": False,
                    "workflows": False,
                    "pause_resume": False,
                },
                "extensions": {},
            },
        )

    def health(self, call: Call) -> Reply:
        """GET /ojs/v1/health (served without auth)."""
        del call
        state = self.state
        return Reply(
            200,
            {
                "status": "ok",
                "version": state.config.ojs_version,
                "uptime_seconds": int(state.clock() - state.started_s),
                "backend": {"type": "memory", "status": "ok", "latency_ms": 0},
            },
        )

    def queue_stats(self, call: Call) -> Reply:
        """GET /ojs/v1/queues/{name}/stats: how many jobs of the queue are in each state."""
        name = call.params["name"]
        counts = dict.fromkeys(JOB_STATES, 0)
        for job in self.state.jobs.values():
            if job.queue == name:
                counts[job.state] += 1
        return Reply(200, {"queue": {"name": name, **counts, "paused": False}})

    def events(self, call: Call) -> Reply:
        """GET /ojs/v1/events, filtered by `types` and `queues`, at most `limit`."""
        types = {t for t in call.query.get("types", "").split(",") if t}
        queues = {q for q in call.query.get("queues", "").split(",") if q}
        limit_text = call.query.get("limit", "100")
        limit = int(limit_text) if limit_text.isdigit() else 100
        events = [
            event
            for event in self.state.events
            if (not types or event.kind in types) and (not queues or event.data["queue"] in queues)
        ]
        return Reply(200, {"events": [event.view() for event in events[:limit]]})


def _batch_item_invalid(exc: Reject, index: int, *, own_status: bool) -> Reject:
    """A batch item's rejection as the batch's answer, naming the item's index. The atomic
    path answers 400 invalid_request whatever the item's own status, as the reference batch
    handler does; the push-one-by-one path keeps the item's status and code."""
    message = f"Batch validation failed: job at index {index}: {exc.message}"
    details = {**(exc.details or {}), "index": index}
    if not own_status:
        return invalid(message, **details)
    return Reject(exc.status, exc.code, message, details=details, retryable=exc.retryable)


def _raise_batch_conflict(conflict: Reject | None, index: int) -> None:
    if conflict is None:
        return
    if conflict.code == "internal_error":
        raise conflict
    raise Reject(
        conflict.status,
        conflict.code,
        f"Batch failed: job at index {index}: {conflict.message}",
        details={"index": index},
        retryable=conflict.retryable,
    )
