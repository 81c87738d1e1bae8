"""The worker endpoints: fetch, ack, nack and heartbeat, with the `lease_token` fence of the
gateway dialect."""

from __future__ import annotations

import re
import uuid
from typing import Any

from relayd.testing.emulator.jobs import Job, backoff_s, non_retryable
from relayd.testing.emulator.state import EmulatorState
from relayd.testing.emulator.wire import (
    Call,
    Reject,
    Reply,
    Route,
    field_int,
    format_time,
    invalid,
    not_found,
)

MAX_FETCH_QUEUES = 64
MAX_FETCH_COUNT = 100


class WorkerEndpoints:
    """What a worker calls, served from the shared state."""

    def __init__(self, state: EmulatorState) -> None:
        self.state = state

    def routes(self) -> list[Route]:
        """The worker paths, in lookup order."""
        return [
            Route("POST", re.compile(r"^/ojs/v1/workers/fetch$"), self.fetch),
            Route("POST", re.compile(r"^/ojs/v1/workers/ack$"), self.ack),
            Route("POST", re.compile(r"^/ojs/v1/workers/nack$"), self.nack),
            Route("POST", re.compile(r"^/ojs/v1/workers/heartbeat$"), self.heartbeat),
        ]

    def fetch(self, call: Call) -> Reply:
        """POST /ojs/v1/workers/fetch: claim up to `count` jobs, queue by queue."""
        state = self.state
        now = state.now()
        payload = call.json_object()
        queues = payload.get("queues")
        if (
            not isinstance(queues, list)
            or not queues
            or not all(isinstance(q, str) for q in queues)
        ):
            raise invalid("The 'queues' field is required and must not be empty.")
        if len(queues) > MAX_FETCH_QUEUES:
            raise invalid(f"The 'queues' field must not list more than {MAX_FETCH_QUEUES}.")
        count = field_int(payload, "count", "count") or 1
        count = min(max(count, 1), MAX_FETCH_COUNT)
        worker_id = payload.get("worker_id")
        visibility_ms = field_int(payload, "visibility_timeout_ms", "visibility_timeout_ms")
        claimed: list[dict[str, Any]] = []
        # Queues are served in the order given, not by one global priority.
        for queue in queues:
            while len(claimed) < count:
                job = state.pop_ready(queue, now)
                if job is None:
                    break
                lease_ms = (
                    visibility_ms
                    if visibility_ms and visibility_ms > 0
                    else job.visibility_timeout_ms or state.config.default_visibility_timeout_ms
                )
                job.attempt += 1
                job.started_at = now
                job.worker_id = worker_id if isinstance(worker_id, str) else None
                job.lease_token = str(uuid.uuid4())
                job.lease_expires_at = now + lease_ms / 1000
                state.enter(job, "active", now)
                state.counts(job.id).deliveries += 1
                state.event("job.started", job, now)
                claimed.append({**job.view(), "lease_token": job.lease_token})
        body: dict[str, Any] = {"jobs": claimed}
        if claimed:
            body["job"] = claimed[0]
        return Reply(200, body)

    def ack(self, call: Call) -> Reply:
        """POST /ojs/v1/workers/ack: the active job completes."""
        state = self.state
        now = state.now()
        payload = call.json_object()
        job = self._active_job(payload, "acknowledge")
        if "result" in payload and payload["result"] is not None:
            job.has_result = True
            job.result = payload["result"]
        job.error = None
        job.completed_at = now
        state.enter(job, "completed", now)
        started = job.started_at if job.started_at is not None else now
        state.event("job.completed", job, now, duration_ms=int((now - started) * 1000))
        return Reply(
            200,
            {
                "acknowledged": True,
                "id": job.id,
                "job_id": job.id,
                "state": "completed",
                "completed_at": format_time(now),
                "job": job.view(),
            },
        )

    def nack(self, call: Call) -> Reply:
        """POST /ojs/v1/workers/nack: requeue, retry after a backoff, or discard."""
        state = self.state
        now = state.now()
        payload = call.json_object()
        job = self._active_job(payload, "fail")
        reported = payload.get("error")
        if reported is not None and not isinstance(reported, dict):
            raise invalid("The 'error' field must be an object.", field="error")
        reply: dict[str, Any] = {"id": job.id, "job_id": job.id}
        if payload.get("requeue") is True:
            job.lease_token = None
            job.lease_expires_at = None
            state.enter(job, "available", now)
            reply.update(state="available", attempt=job.attempt, max_attempts=job.max_attempts)
            reply["job"] = job.view()
            return Reply(200, reply)
        reported = reported or {}
        error_type = str(reported.get("type") or reported.get("code") or "handler_error")
        message = str(reported.get("message") or "")
        error: dict[str, Any] = {
            "type": error_type,
            "message": message,
            "attempt": job.attempt,
            "occurred_at": format_time(now),
        }
        if "code" in reported:
            error["code"] = reported["code"]
        for key in ("retryable", "details"):
            if key in reported:
                error[key] = reported[key]
        job.error = error
        job.errors.append(error)
        job.lease_token = None
        job.lease_expires_at = None
        permanent = reported.get("retryable") is False or non_retryable(
            job.retry, error_type, message
        )
        if permanent or job.attempt >= job.max_attempts:
            job.discarded_at = job.completed_at = now
            state.enter(job, "discarded", now)
            state.event("job.discarded", job, now)
            reply.update(discarded_at=format_time(now), completed_at=format_time(now))
        else:
            delay_s = backoff_s(job.retry, job.attempt)
            job.next_attempt_at = now + delay_s
            job.retry_delay_ms = int(delay_s * 1000)
            state.enter(job, "retryable", now)
            state.event("job.failed", job, now)
            reply.update(
                next_attempt_at=format_time(job.next_attempt_at),
                retry_delay_ms=job.retry_delay_ms,
            )
        reply.update(state=job.state, attempt=job.attempt, max_attempts=job.max_attempts)
        reply["job"] = job.view()
        return Reply(200, reply)

    def heartbeat(self, call: Call) -> Reply:
        """POST /ojs/v1/workers/heartbeat: extend the leases of the listed active jobs."""
        state = self.state
        now = state.now()
        payload = call.json_object()
        worker_id = payload.get("worker_id")
        if not isinstance(worker_id, str) or not worker_id:
            raise invalid("The 'worker_id' field is required.", field="worker_id")
        active = payload.get("active_jobs")
        job_ids = [i for i in active if isinstance(i, str)] if isinstance(active, list) else []
        if not job_ids and isinstance(payload.get("job_id"), str):
            job_ids = [payload["job_id"]]
        token = payload.get("lease_token")
        visibility_ms = field_int(payload, "visibility_timeout_ms", "visibility_timeout_ms")
        extended: list[str] = []
        directive = "running"
        for job_id in job_ids:
            job = state.jobs.get(job_id)
            if job is None:
                continue
            _check_lease_token(job, token)
            if job.state == "active":
                lease_ms = visibility_ms or job.visibility_timeout_ms
                lease_ms = lease_ms or state.config.default_visibility_timeout_ms
                job.lease_expires_at = now + lease_ms / 1000
                state.enter(job, "active", now)
                extended.append(job_id)
            # The reference servers let a job's meta.test_directive drive the answer, which
            # the conformance suite uses to exercise quiet/terminate.
            wanted = (job.meta or {}).get("test_directive")
            if directive == "running" and isinstance(wanted, str) and wanted:
                directive = wanted
        return Reply(
            200,
            {
                "state": directive,
                "directive": directive,
                "jobs_extended": extended,
                "server_time": format_time(now),
            },
        )

    def _active_job(self, payload: dict[str, Any], verb: str) -> Job:
        """The job an ack/nack names, checked against its lease (the gateway dialect) or,
        without a lease_token, only for being active (public OJS)."""
        job_id = payload.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise invalid("The 'job_id' field is required.", field="job_id")
        job = self.state.jobs.get(job_id)
        if job is None:
            raise not_found("Job", job_id)
        _check_lease_token(job, payload.get("lease_token"))
        if job.state != "active":
            raise Reject(
                409,
                "conflict",
                f"Cannot {verb} job not in 'active' state. Current state: '{job.state}'.",
                details={"job_id": job_id, "current_state": job.state, "expected_state": "active"},
            )
        return job


def _check_lease_token(job: Job, token: Any) -> None:
    """The gateway dialect's fence: a token that is not the job's current lease is stale
    (also once the lease expired or the job finished). No token: no fence (public OJS)."""
    if token is not None and (job.state != "active" or job.lease_token != token):
        raise Reject(
            409,
            "stale_lease",
            "The lease token is not the job's current lease.",
            details={"job_id": job.id, "current_state": job.state},
            retryable=False,
        )
