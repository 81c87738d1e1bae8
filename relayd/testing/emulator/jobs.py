"""One job: its stored record and the view GET shows (`Job`), its retry policy and backoff,
and an enqueue request parsed and validated into a job not yet stored."""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass, field
from typing import Any

from relayd.producer import uuid7
from relayd.testing.emulator.config import QueueSource
from relayd.testing.emulator.wire import (
    Reject,
    field_int,
    format_time,
    invalid,
    parse_duration_s,
    parse_instant,
)

TERMINAL_STATES = frozenset({"completed", "cancelled", "discarded"})
JOB_STATES = (
    "scheduled",
    "available",
    "pending",
    "active",
    "retryable",
    "completed",
    "cancelled",
    "discarded",
)
DEFAULT_MAX_ATTEMPTS = 3
# The reference servers' regex allows '-' in type segments (the spec's does not); the
# level-1 conformance cases rely on it, so the emulator accepts what the servers accept.
TYPE_PATTERN = re.compile(r"^[a-z][a-z0-9_\-]*(\.[a-z][a-z0-9_\-]*)*$")
QUEUE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9\-.]*$")
UUIDV7_PATTERN = re.compile(
    r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
)
MAX_TYPE_LENGTH = 255
MAX_QUEUE_LENGTH = 128
# Request fields the server reads; everything else at the top level is kept and echoed.
_KNOWN_REQUEST_FIELDS = frozenset({"id", "type", "args", "meta", "schema", "options"})
# Fields only the server sets: ignored if a client sends them, rather than echoed.
_SYSTEM_FIELDS = frozenset(
    {
        "state",
        "attempt",
        "created_at",
        "enqueued_at",
        "started_at",
        "completed_at",
        "cancelled_at",
        "discarded_at",
        "result",
        "error",
        "errors",
        "worker_id",
        "lease_token",
        "retry_delay_ms",
        "next_attempt_at",
    }
)


# --- the job -----------------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """A stored job: what the client sent, as parsed, and where its lifecycle stands."""

    id: str
    type: str
    args: list[Any]
    queue: str
    priority: int
    max_attempts: int
    created_at: float
    meta: dict[str, Any] | None = None
    schema: str | None = None
    retry: dict[str, Any] | None = None
    unique: Any = None
    tags: list[str] | None = None
    timeout_ms: int | None = None
    scheduled_at: float | None = None
    expires_at: float | None = None
    # The reference servers echo these options as sent (a relative "+PT5S" resolved).
    times_as_sent: dict[str, str] = field(default_factory=dict)
    visibility_timeout_ms: int | None = None
    unknown: dict[str, Any] = field(default_factory=dict)
    state: str = "available"
    attempt: int = 0
    version: int = 0
    enqueued_at: float | None = None
    started_at: float | None = None
    completed_at: float | None = None
    cancelled_at: float | None = None
    discarded_at: float | None = None
    next_attempt_at: float | None = None
    retry_delay_ms: int | None = None
    has_result: bool = False
    result: Any = None
    error: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    worker_id: str | None = None
    lease_token: str | None = None
    lease_expires_at: float | None = None

    def view(self, *, fresh: bool = True) -> dict[str, Any]:
        """The job as GET shows it: a fresh copy, or (`fresh=False`, for an answer encoded at
        once) a dict that shares the job's values."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": self.type,
            "state": self.state,
            "queue": self.queue,
            "args": self.args,
        }
        if self.meta is not None:
            out["meta"] = self.meta
        if self.schema is not None:
            out["schema"] = self.schema
        out["priority"] = self.priority
        out["attempt"] = self.attempt
        out["max_attempts"] = self.max_attempts
        if self.timeout_ms is not None:
            out["timeout_ms"] = self.timeout_ms
        out["created_at"] = format_time(self.created_at)
        for name in (
            "enqueued_at",
            "started_at",
            "completed_at",
            "cancelled_at",
            "discarded_at",
            "next_attempt_at",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = format_time(value)
        out.update(self.times_as_sent)
        if self.retry_delay_ms is not None:
            out["retry_delay_ms"] = self.retry_delay_ms
        if self.worker_id is not None:
            out["worker_id"] = self.worker_id
        if self.has_result:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        if self.errors:
            out["errors"] = self.errors
        if self.tags:
            out["tags"] = self.tags
        if self.retry is not None:
            out["retry"] = self.retry
        if self.unique is not None:
            out["unique"] = self.unique
        # Unknown fields are written last, as the reference MarshalJSON does: a top-level
        # `queue` or `priority` sent flat-envelope style shadows the real one in the output.
        out.update(self.unknown)
        return copy.deepcopy(out) if fresh else out


# --- parsing an enqueue request ----------------------------------------------------------


def _field_instant(container: dict[str, Any], name: str, now_s: float) -> tuple[float, str] | None:
    """The instant and the text the server echoes for it."""
    value = container.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise invalid(f"The '{name}' field must be an RFC 3339 timestamp.", field=name)
    try:
        instant = parse_instant(value, now_s)
        return instant, format_time(instant) if value.startswith("+") else value
    except ValueError as exc:
        raise invalid(
            f"The '{name}' field must be an RFC 3339 timestamp with a timezone. Got: {value!r}",
            field=name,
        ) from exc


def parse_identity(payload: dict[str, Any], now: float) -> tuple[str, str, list[Any]]:
    """The id (generated if absent), type and args of an enqueue request."""
    job_type = payload.get("type")
    if job_type is None or job_type == "":
        raise invalid("The 'type' field is required.", field="type", validation="required")
    if not isinstance(job_type, str):
        raise invalid("The 'type' field must be a string.", field="type")
    if len(job_type) > MAX_TYPE_LENGTH:
        raise invalid(
            f"The 'type' field must not exceed {MAX_TYPE_LENGTH} characters.", field="type"
        )
    if not TYPE_PATTERN.match(job_type):
        raise invalid(
            f"The 'type' field must match pattern '{TYPE_PATTERN.pattern}'. Got: {job_type!r}",
            field="type",
        )
    args = payload.get("args")
    if not isinstance(args, list):
        raise invalid("The 'args' field is required and must be a JSON array.", field="args")
    if "id" in payload:
        job_id = payload["id"]
        if not isinstance(job_id, str) or not UUIDV7_PATTERN.match(job_id):
            raise invalid(f"The 'id' field must be a lowercase UUIDv7. Got: {job_id!r}", field="id")
    else:
        job_id = uuid7(now)
    return job_id, job_type, args


def parse_job(payload: Any, now: float, queue_source: QueueSource) -> Job:
    """Validate one enqueue request into a job not yet stored; Reject names the field."""
    if not isinstance(payload, dict):
        raise invalid("The request body must be a JSON object.")
    job_id, job_type, args = parse_identity(payload, now)
    meta = payload.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise invalid("The 'meta' field must be a JSON object.", field="meta")
    schema = payload.get("schema")
    if schema is not None and not isinstance(schema, str):
        raise invalid("The 'schema' field must be a string.", field="schema")
    options = payload.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise invalid("The 'options' field must be a JSON object.", field="options")

    queue = _effective_queue(payload, options, queue_source)
    priority = field_int(options, "priority", "priority")
    if priority is not None and not -100 <= priority <= 100:
        raise invalid(
            f"The 'priority' field must be between -100 and 100. Got: {priority}",
            field="priority",
        )
    retry = _parse_retry(options)
    max_attempts = DEFAULT_MAX_ATTEMPTS
    if retry is not None and isinstance(retry.get("max_attempts"), int):
        max_attempts = retry["max_attempts"]
    tags = options.get("tags")
    if tags is not None and (
        not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags)
    ):
        raise invalid("The 'tags' field must be a list of strings.", field="tags")
    visibility_ms = field_int(options, "visibility_timeout_ms", "visibility_timeout_ms")
    if visibility_ms is None and isinstance(options.get("visibility_timeout"), str):
        with contextlib.suppress(ValueError):
            visibility_ms = int(parse_duration_s(options["visibility_timeout"]) * 1000)
    scheduled = _field_instant(options, "scheduled_at", now)
    if scheduled is None:
        scheduled = _field_instant(options, "delay_until", now)
    expires = _field_instant(options, "expires_at", now)
    times_as_sent = {"scheduled_at": scheduled[1]} if scheduled else {}
    if expires:
        times_as_sent["expires_at"] = expires[1]
    metadata = options.get("metadata")
    if isinstance(metadata, dict) and metadata:
        meta = metadata  # the reference servers let a non-empty options.metadata win

    consumed = _KNOWN_REQUEST_FIELDS
    if queue_source != "options":
        consumed = consumed | {"queue"}
    unknown = {
        key: value
        for key, value in payload.items()
        if key not in consumed and key not in _SYSTEM_FIELDS
    }
    return Job(
        id=job_id,
        type=job_type,
        args=args,
        queue=queue,
        priority=priority or 0,
        max_attempts=max_attempts,
        created_at=now,
        meta=meta,
        schema=schema,
        retry=retry,
        unique=options.get("unique"),
        tags=tags,
        timeout_ms=field_int(options, "timeout_ms", "timeout_ms"),
        scheduled_at=scheduled[0] if scheduled else None,
        expires_at=expires[0] if expires else None,
        times_as_sent=times_as_sent,
        visibility_timeout_ms=visibility_ms if visibility_ms and visibility_ms > 0 else None,
        unknown=unknown,
    )


def _effective_queue(payload: dict[str, Any], options: dict[str, Any], source: QueueSource) -> str:
    label = "options.queue"
    candidate = options.get("queue") if source != "top_level" else None
    if source == "top_level" or (source == "either" and candidate in (None, "")):
        candidate = payload.get("queue")
        label = "queue"
    if candidate is None or candidate == "":
        return "default"
    if not isinstance(candidate, str):
        raise invalid(f"The '{label}' field must be a string.", field=label)
    if len(candidate) > MAX_QUEUE_LENGTH:
        raise invalid(
            f"The '{label}' field must not exceed {MAX_QUEUE_LENGTH} characters.", field=label
        )
    if not QUEUE_PATTERN.match(candidate):
        raise invalid(
            f"The '{label}' field must match pattern '{QUEUE_PATTERN.pattern}'. Got: {candidate!r}",
            field=label,
        )
    return candidate


# --- retry policy ------------------------------------------------------------------------


def _parse_retry(options: dict[str, Any]) -> dict[str, Any] | None:
    """`options.retry` (or `retry_policy`) checked; a semantic error is 422 validation_error."""
    policy = options.get("retry")
    label = "retry"
    if policy is None:
        policy = options.get("retry_policy")
        label = "retry_policy"
    if policy is None:
        return None
    if not isinstance(policy, dict):
        raise invalid(f"The '{label}' field must be an object.", field=label)
    max_attempts = field_int(policy, "max_attempts", f"{label}.max_attempts")
    if max_attempts is not None and max_attempts < 0:
        raise Reject(
            422,
            "validation_error",
            f"The '{label}.max_attempts' field must be non-negative. Got: {max_attempts}",
            details={"field": f"{label}.max_attempts", "expected": ">= 0"},
        )
    coefficient = policy.get("backoff_coefficient")
    if coefficient is not None:
        if isinstance(coefficient, bool) or not isinstance(coefficient, int | float):
            raise invalid(f"The '{label}.backoff_coefficient' field must be a number.")
        # Zero means "unset" in the reference code; only 0 < c < 1 is a semantic error.
        if 0 < coefficient < 1 or coefficient < 0:
            raise Reject(
                422,
                "validation_error",
                f"The '{label}.backoff_coefficient' field must be >= 1.0. Got: {coefficient}",
                details={"field": f"{label}.backoff_coefficient", "expected": ">= 1.0"},
            )
    for name in ("initial_interval", "max_interval"):
        interval = policy.get(name)
        if interval is None or interval == "":
            continue
        if not isinstance(interval, str):
            raise invalid(f"The '{label}.{name}' field must be an ISO 8601 duration.")
        try:
            parse_duration_s(interval)
        except ValueError as exc:
            raise invalid(
                f"The '{label}.{name}' field must be a valid ISO 8601 duration. Got: {interval!r}",
                field=f"{label}.{name}",
            ) from exc
    patterns = policy.get("non_retryable_errors")
    if patterns is not None and (
        not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns)
    ):
        raise invalid(f"The '{label}.non_retryable_errors' field must be a list of strings.")
    return policy


def backoff_s(policy: dict[str, Any] | None, attempt: int) -> float:
    """initial * coefficient^(attempt-1), capped; no jitter, so tests stay deterministic."""
    policy = policy or {}
    initial = policy.get("initial_interval")
    maximum = policy.get("max_interval")
    coefficient = policy.get("backoff_coefficient") or 2.0
    initial_s = parse_duration_s(initial) if isinstance(initial, str) and initial else 1.0
    max_s = parse_duration_s(maximum) if isinstance(maximum, str) and maximum else 300.0
    delay_s: float = initial_s * float(coefficient) ** max(attempt - 1, 0)
    return min(delay_s, max_s)


def non_retryable(policy: dict[str, Any] | None, error_type: str, message: str) -> bool:
    """Whether the policy's non_retryable_errors (exact, or a `prefix*`) name this error."""
    for pattern in (policy or {}).get("non_retryable_errors") or ():
        if pattern.endswith("*") and (
            error_type.startswith(pattern[:-1]) or message.startswith(pattern[:-1])
        ):
            return True
        if pattern in (error_type, message):
            return True
    return False
