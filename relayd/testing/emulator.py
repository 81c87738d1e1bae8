"""An in-memory OJS job server over aiohttp: the ground truth of relayd's correctness tests.

It owns the producer binding (enqueue, batch, get, cancel, manifest, health, queue stats,
events), the worker binding (fetch, ack, nack, heartbeat, with the guide gateway's
`lease_token`), the switches that reproduce how real servers differ (`EmulatorConfig`), the
scripted faults of `relayd.testing.faults`, and a ledger of what each job id went through.

Control API (no auth, no faults): ``GET /_emulator/ledger``, ``GET|POST|DELETE
/_emulator/faults``, ``POST /_emulator/reset``, ``POST /_emulator/clock`` (``{"advance_s":
N}``). The same operations are methods of `Emulator` for in-process tests.

Ledger JSON (``GET /_emulator/ledger``)::

    {"jobs": {"<id>": {"job": {...as GET shows it...} | null, "queue": "<effective queue>",
                       "created": 1, "overwrites": 0, "posts": 2, "post_statuses": [201, 409],
                       "gets": 1, "deliveries": 0, "purged": false}}}

`created` counts insertions (an overwrite counts), `posts` every POST (single or batch) that
carried the id whatever its outcome, `post_statuses` the answer to each (null: the connection
was dropped without one), `deliveries` the worker fetches. Time-driven transitions (scheduled
and retry promotion, lease expiry, retention purge) happen lazily at the next request, on the
emulator's clock, which tests can move forward instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import heapq
import itertools
import json
import logging
import math
import re
import secrets
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn, Self, get_args

from aiohttp import web

from relayd.testing.faults import FaultPlan, FaultRule

logger = logging.getLogger(__name__)

DuplicateMode = Literal["spec409", "overwrite", "pk500"]
QueueSource = Literal["options", "top_level", "either"]
DUPLICATE_MODES: tuple[str, ...] = get_args(DuplicateMode)
QUEUE_SOURCES: tuple[str, ...] = get_args(QueueSource)

OJS_MEDIA_TYPE = "application/openjobspec+json"
ACCEPTED_MEDIA_TYPES = frozenset({OJS_MEDIA_TYPE, "application/json"})
EMULATOR_VERSION = "0.1.0"
HEALTH_PATH = "/ojs/v1/health"
CONTROL_PREFIX = "/_emulator/"

# The reference servers' regex allows '-' in type segments (the spec's does not); the
# level-1 conformance cases rely on it, so the emulator accepts what the servers accept.
TYPE_PATTERN = re.compile(r"^[a-z][a-z0-9_\-]*(\.[a-z][a-z0-9_\-]*)*$")
QUEUE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9\-.]*$")
UUIDV7_PATTERN = re.compile(
    r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
)
_DURATION_PATTERN = re.compile(
    r"^P(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$"
)
MAX_TYPE_LENGTH = 255
MAX_QUEUE_LENGTH = 128
MAX_FETCH_QUEUES = 64
MAX_FETCH_COUNT = 100
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_VISIBILITY_TIMEOUT_MS = 30_000
_CONTROL_BODY_BYTES = 1 << 20
_EVENT_HISTORY = 10_000

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
# Request fields the server reads; everything else at the top level is kept and echoed.
_KNOWN_REQUEST_FIELDS = frozenset({"id", "type", "args", "meta", "schema", "options"})
# Fields a client cannot set (ojs-core §5.3): ignored rather than echoed.
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
_RETRYABLE_CODES = frozenset({"internal_error", "backend_error", "rate_limited", "queue_paused"})
_DEFAULT_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "invalid_request",
    422: "validation_error",
    429: "rate_limited",
    500: "internal_error",
}


@dataclass(frozen=True)
class EmulatorConfig:
    """How the emulator behaves where real OJS servers disagree (ojs-protocol.md §7)."""

    # A reused client id: 409 `duplicate` (conformance), silent overwrite (redis, lite),
    # or 500 `internal_error` retryable (postgres primary-key violation).
    duplicate_mode: DuplicateMode = "spec409"
    # Guide gateway: with spec409, reusing an id in *another* queue surfaces a storage
    # error (500 internal_error) instead of 409.
    cross_queue_500: bool = False
    # Where the job's queue is read: `options.queue` (OJS binding; a top-level `queue` is
    # echoed as an unknown field), top-level `queue` (guide gateway), or either (options
    # first).
    queue_source: QueueSource = "options"
    # True: validate and check every batch item before storing any. False (redis, lite):
    # check each item's id, type and args first, then validate and store the items one by
    # one; the first that fails answers for the batch and the earlier ones stay stored.
    batch_atomic: bool = True
    # Whether POST /ojs/v1/jobs/batch exists; advertised as capabilities.batch_enqueue.
    batch_enqueue: bool = True
    max_batch_jobs: int = 100
    # Terminal jobs are purged this long after they finish; afterwards GET is 404 and the
    # id may be inserted again.
    retention_s: float = 24 * 3600.0
    auth_token: str | None = field(default=None, repr=False)
    max_body_bytes: int = 1 << 20
    default_visibility_timeout_ms: int = DEFAULT_VISIBILITY_TIMEOUT_MS
    # The OJS-Version response header; the reference code sends its own constant.
    ojs_version: str = "1.0"

    def __post_init__(self) -> None:
        if self.duplicate_mode not in DUPLICATE_MODES:
            raise ValueError(f"duplicate_mode must be one of {', '.join(DUPLICATE_MODES)}")
        if self.queue_source not in QUEUE_SOURCES:
            raise ValueError(f"queue_source must be one of {', '.join(QUEUE_SOURCES)}")
        if self.max_batch_jobs < 1:
            raise ValueError("max_batch_jobs must be >= 1")
        if self.retention_s < 0 or math.isnan(self.retention_s):
            raise ValueError("retention_s must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.default_visibility_timeout_ms < 1:
            raise ValueError("default_visibility_timeout_ms must be >= 1")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty")

    @classmethod
    def guide_gateway(cls, **overrides: Any) -> EmulatorConfig:
        """The dialect of the guide's gateway (ojs-protocol.md §0)."""
        settings: dict[str, Any] = {
            "duplicate_mode": "spec409",
            "cross_queue_500": True,
            "queue_source": "top_level",
            "batch_atomic": True,
        }
        settings.update(overrides)
        return cls(**settings)


def config_from_options(
    *,
    duplicate_mode: str = "spec409",
    queue_source: str = "options",
    batch_atomic: bool = True,
    batch_enqueue: bool = True,
    cross_queue_500: bool = False,
    auth_token_file: str | None = None,
    retention_s: str | float | None = None,
    max_body_bytes: str | int | None = None,
    max_batch_jobs: str | int | None = None,
) -> EmulatorConfig:
    """An EmulatorConfig from command-line style options; ValueError names the bad one."""
    token: str | None = None
    if auth_token_file is not None:
        try:
            token = Path(auth_token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"auth_token_file: cannot read {auth_token_file}: {exc}") from exc
        if not token:
            raise ValueError(f"auth_token_file: {auth_token_file} is empty")
    if duplicate_mode not in DUPLICATE_MODES:
        raise ValueError(
            f"duplicate_mode must be one of {', '.join(DUPLICATE_MODES)} (got {duplicate_mode!r})"
        )
    if queue_source not in QUEUE_SOURCES:
        raise ValueError(
            f"queue_source must be one of {', '.join(QUEUE_SOURCES)} (got {queue_source!r})"
        )
    settings: dict[str, Any] = {
        "duplicate_mode": duplicate_mode,
        "queue_source": queue_source,
        "batch_atomic": batch_atomic,
        "batch_enqueue": batch_enqueue,
        "cross_queue_500": cross_queue_500,
        "auth_token": token,
    }
    if retention_s is not None:
        settings["retention_s"] = _float_option("retention_s", retention_s)
    if max_body_bytes is not None:
        settings["max_body_bytes"] = _int_option("max_body_bytes", max_body_bytes)
    if max_batch_jobs is not None:
        settings["max_batch_jobs"] = _int_option("max_batch_jobs", max_batch_jobs)
    return EmulatorConfig(**settings)


def _float_option(name: str, value: str | float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a number (got {value!r})") from exc


def _int_option(name: str, value: str | int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be an integer (got {value!r})") from exc


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6) for `serve`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen address must be HOST:PORT (got {value!r})")
    return host.removeprefix("[").removesuffix("]"), int(port)


# --- small wire helpers ------------------------------------------------------------------


def uuid7(now_s: float | None = None) -> str:
    """A UUIDv7 string (48-bit millisecond time, random rest); lowercase as OJS requires."""
    millis = int((time.time() if now_s is None else now_s) * 1000) & ((1 << 48) - 1)
    value = (millis << 80) | secrets.randbits(80)
    value = (value & ~(0xF << 76)) | (0x7 << 76)
    value = (value & ~(0x3 << 62)) | (0x2 << 62)
    return str(uuid.UUID(int=value))


def format_time(epoch_s: float) -> str:
    """RFC 3339 UTC with milliseconds, like the reference servers."""
    moment = datetime.fromtimestamp(epoch_s, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def parse_duration_s(text: str) -> float:
    """An ISO-8601 duration (``PT1S``, ``PT5M``, ``P1DT2H``) in seconds; ValueError if not."""
    match = _DURATION_PATTERN.match(text)
    if match is None or text in ("P", "PT") or text.endswith("T"):
        raise ValueError(f"not an ISO 8601 duration: {text!r}")
    parts = {key: float(value) for key, value in match.groupdict().items() if value}
    return (
        parts.get("d", 0.0) * 86400
        + parts.get("h", 0.0) * 3600
        + parts.get("m", 0.0) * 60
        + parts.get("s", 0.0)
    )


def _parse_instant(text: str, now_s: float) -> float:
    """RFC 3339 with a zone, or ``+PT5S`` relative to now (the servers accept both)."""
    if text.startswith("+P"):
        return now_s + parse_duration_s(text[1:])
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError("timestamp without a timezone")
    return moment.timestamp()


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class _Reject(Exception):
    """An OJS error answer, raised anywhere under a handler and rendered once."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        retryable: bool | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.retryable = code in _RETRYABLE_CODES if retryable is None else retryable
        self.extra = extra or {}

    def envelope(self, request_id: str) -> dict[str, Any]:
        error: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.details is not None:
            error["details"] = self.details
        error.update(self.extra)
        error["request_id"] = request_id
        return {"error": error}


def _internal_error() -> _Reject:
    # The reference servers sanitize non-OJS errors to this message, retryable.
    return _Reject(500, "internal_error", "an internal error occurred")


def _invalid(message: str, **details: Any) -> _Reject:
    return _Reject(400, "invalid_request", message, details=details or None)


def _not_found(kind: str, resource_id: str) -> _Reject:
    return _Reject(
        404,
        "not_found",
        f"{kind} '{resource_id}' not found.",
        details={"resource_type": kind.lower(), "resource_id": resource_id},
        extra={
            "hint": "The job may never have existed or may have been purged by retention.",
            "docs_url": "https://openjobspec.org/spec/ojs-http-binding#errors",
        },
    )


# --- jobs --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
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

    def view(self) -> dict[str, Any]:
        """The job as GET shows it (a fresh copy)."""
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
        return copy.deepcopy(out)


def _field_int(container: dict[str, Any], name: str, label: str) -> int | None:
    value = container.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"The '{label}' field must be an integer.", field=label)
    return value


def _field_instant(container: dict[str, Any], name: str, now_s: float) -> tuple[float, str] | None:
    """The instant and the text the server echoes for it."""
    value = container.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _invalid(f"The '{name}' field must be an RFC 3339 timestamp.", field=name)
    try:
        instant = _parse_instant(value, now_s)
        return instant, format_time(instant) if value.startswith("+") else value
    except ValueError as exc:
        raise _invalid(
            f"The '{name}' field must be an RFC 3339 timestamp with a timezone. Got: {value!r}",
            field=name,
        ) from exc


def _parse_retry(options: dict[str, Any]) -> dict[str, Any] | None:
    policy = options.get("retry")
    label = "retry"
    if policy is None:
        policy = options.get("retry_policy")
        label = "retry_policy"
    if policy is None:
        return None
    if not isinstance(policy, dict):
        raise _invalid(f"The '{label}' field must be an object.", field=label)
    max_attempts = _field_int(policy, "max_attempts", f"{label}.max_attempts")
    if max_attempts is not None and max_attempts < 0:
        raise _Reject(
            422,
            "validation_error",
            f"The '{label}.max_attempts' field must be non-negative. Got: {max_attempts}",
            details={"field": f"{label}.max_attempts", "expected": ">= 0"},
        )
    coefficient = policy.get("backoff_coefficient")
    if coefficient is not None:
        if isinstance(coefficient, bool) or not isinstance(coefficient, int | float):
            raise _invalid(f"The '{label}.backoff_coefficient' field must be a number.")
        # Zero means "unset" in the reference code; only 0 < c < 1 is a semantic error.
        if 0 < coefficient < 1 or coefficient < 0:
            raise _Reject(
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
            raise _invalid(f"The '{label}.{name}' field must be an ISO 8601 duration.")
        try:
            parse_duration_s(interval)
        except ValueError as exc:
            raise _invalid(
                f"The '{label}.{name}' field must be a valid ISO 8601 duration. Got: {interval!r}",
                field=f"{label}.{name}",
            ) from exc
    patterns = policy.get("non_retryable_errors")
    if patterns is not None and (
        not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns)
    ):
        raise _invalid(f"The '{label}.non_retryable_errors' field must be a list of strings.")
    return policy


def _backoff_s(policy: dict[str, Any] | None, attempt: int) -> float:
    """initial * coefficient^(attempt-1), capped; no jitter, so tests stay deterministic."""
    policy = policy or {}
    initial = policy.get("initial_interval")
    maximum = policy.get("max_interval")
    coefficient = policy.get("backoff_coefficient") or 2.0
    initial_s = parse_duration_s(initial) if isinstance(initial, str) and initial else 1.0
    max_s = parse_duration_s(maximum) if isinstance(maximum, str) and maximum else 300.0
    delay_s: float = initial_s * float(coefficient) ** max(attempt - 1, 0)
    return min(delay_s, max_s)


def _non_retryable(policy: dict[str, Any] | None, error_type: str, message: str) -> bool:
    for pattern in (policy or {}).get("non_retryable_errors") or ():
        if pattern.endswith("*") and (
            error_type.startswith(pattern[:-1]) or message.startswith(pattern[:-1])
        ):
            return True
        if pattern in (error_type, message):
            return True
    return False


def _parse_identity(payload: dict[str, Any], now: float) -> tuple[str, str, list[Any]]:
    """The id (generated if absent), type and args of an enqueue request."""
    job_type = payload.get("type")
    if job_type is None or job_type == "":
        raise _invalid("The 'type' field is required.", field="type", validation="required")
    if not isinstance(job_type, str):
        raise _invalid("The 'type' field must be a string.", field="type")
    if len(job_type) > MAX_TYPE_LENGTH:
        raise _invalid(
            f"The 'type' field must not exceed {MAX_TYPE_LENGTH} characters.", field="type"
        )
    if not TYPE_PATTERN.match(job_type):
        raise _invalid(
            f"The 'type' field must match pattern '{TYPE_PATTERN.pattern}'. Got: {job_type!r}",
            field="type",
        )
    args = payload.get("args")
    if not isinstance(args, list):
        raise _invalid("The 'args' field is required and must be a JSON array.", field="args")
    if "id" in payload:
        job_id = payload["id"]
        if not isinstance(job_id, str) or not UUIDV7_PATTERN.match(job_id):
            raise _invalid(
                f"The 'id' field must be a lowercase UUIDv7. Got: {job_id!r}", field="id"
            )
    else:
        job_id = uuid7(now)
    return job_id, job_type, args


def _batch_item_invalid(exc: _Reject, index: int, *, own_status: bool) -> _Reject:
    """A batch item's rejection as the batch's answer, naming the item's index. The atomic
    path answers 400 invalid_request whatever the item's own status, as the reference batch
    handler does; the push-one-by-one path keeps the item's status and code."""
    message = f"Batch validation failed: job at index {index}: {exc.message}"
    details = {**(exc.details or {}), "index": index}
    if not own_status:
        return _invalid(message, **details)
    return _Reject(exc.status, exc.code, message, details=details, retryable=exc.retryable)


def _check_lease_token(job: _Job, token: Any) -> None:
    """The guide gateway's fence: a token that is not the job's current lease is stale
    (also once the lease expired or the job finished). No token: no fence (public OJS)."""
    if token is not None and (job.state != "active" or job.lease_token != token):
        raise _Reject(
            409,
            "stale_lease",
            "The lease token is not the job's current lease.",
            details={"job_id": job.id, "current_state": job.state},
            retryable=False,
        )


# --- ledger ------------------------------------------------------------------------------


@dataclass
class _Counts:
    queue: str | None = None
    created: int = 0
    overwrites: int = 0
    posts: int = 0
    post_statuses: list[int | None] = field(default_factory=list)
    gets: int = 0
    deliveries: int = 0
    purged: bool = False


@dataclass(frozen=True)
class LedgerEntry:
    """What one job id went through (see the module docstring)."""

    job: dict[str, Any] | None
    queue: str | None
    created: int
    overwrites: int
    posts: int
    post_statuses: tuple[int | None, ...]
    gets: int
    deliveries: int
    purged: bool

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["post_statuses"] = list(self.post_statuses)
        return data


# --- requests ----------------------------------------------------------------------------


@dataclass
class _Call:
    method: str
    path: str
    params: dict[str, str]
    query: dict[str, str]
    request_id: str
    body: bytes
    payload: Any = None
    payload_ok: bool = False

    def json(self) -> Any:
        if not self.payload_ok:
            raise _invalid("Invalid JSON in request body.")
        return self.payload

    def json_object(self) -> dict[str, Any]:
        payload = self.json()
        if not isinstance(payload, dict):
            raise _invalid("The request body must be a JSON object.")
        return payload

    def job_ids(self) -> list[str]:
        """The job ids this request concerns, for fault matching and the ledger."""
        ids: list[str] = []
        if "id" in self.params:
            ids.append(self.params["id"])
        payload = self.payload if self.payload_ok and isinstance(self.payload, dict) else {}
        if self.path == "/ojs/v1/jobs" and isinstance(payload.get("id"), str):
            ids.append(payload["id"])
        elif self.path == "/ojs/v1/jobs/batch" and isinstance(payload.get("jobs"), list):
            ids.extend(
                item["id"]
                for item in payload["jobs"]
                if isinstance(item, dict) and isinstance(item.get("id"), str)
            )
        elif self.path.startswith("/ojs/v1/workers/"):
            if isinstance(payload.get("job_id"), str):
                ids.append(payload["job_id"])
            active = payload.get("active_jobs")
            if isinstance(active, list):
                ids.extend(item for item in active if isinstance(item, str))
        return ids


@dataclass
class _Reply:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None


_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"^/ojs/v1/jobs$"), "_enqueue"),
    ("POST", re.compile(r"^/ojs/v1/jobs/batch$"), "_enqueue_batch"),
    ("GET", re.compile(r"^/ojs/v1/jobs/(?P<id>[^/]+)$"), "_get_job"),
    ("DELETE", re.compile(r"^/ojs/v1/jobs/(?P<id>[^/]+)$"), "_cancel_job"),
    ("GET", re.compile(r"^/ojs/manifest$"), "_manifest"),
    ("GET", re.compile(r"^/ojs/v1/health$"), "_health"),
    ("GET", re.compile(r"^/ojs/v1/queues/(?P<name>[^/]+)/stats$"), "_queue_stats"),
    ("GET", re.compile(r"^/ojs/v1/events$"), "_events_list"),
    ("POST", re.compile(r"^/ojs/v1/workers/fetch$"), "_fetch"),
    ("POST", re.compile(r"^/ojs/v1/workers/ack$"), "_ack"),
    ("POST", re.compile(r"^/ojs/v1/workers/nack$"), "_nack"),
    ("POST", re.compile(r"^/ojs/v1/workers/heartbeat$"), "_heartbeat"),
    ("GET", re.compile(r"^/_emulator/ledger$"), "_control_ledger"),
    ("GET", re.compile(r"^/_emulator/faults$"), "_control_faults"),
    ("POST", re.compile(r"^/_emulator/faults$"), "_control_add_faults"),
    ("DELETE", re.compile(r"^/_emulator/faults$"), "_control_clear_faults"),
    ("POST", re.compile(r"^/_emulator/reset$"), "_control_reset"),
    ("POST", re.compile(r"^/_emulator/clock$"), "_control_clock"),
]


class Emulator:
    """The server's state and its aiohttp application; one instance per test or process."""

    def __init__(
        self, config: EmulatorConfig | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config or EmulatorConfig()
        self._clock = clock
        self._closing = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._started_s = clock()
        self._faults = FaultPlan()
        self._init_state()

    def _init_state(self) -> None:
        self._offset_s = 0.0
        self._jobs: dict[str, _Job] = {}
        self._ledger: dict[str, _Counts] = {}
        self._versions = itertools.count(1)
        self._sequence = itertools.count(1)
        # Per queue, a heap of (-priority, sequence, version, id); stale entries are skipped.
        self._ready: dict[str, list[tuple[int, int, int, str]]] = {}
        # (deadline, version, id): promotion, lease expiry and purge, applied lazily.
        self._timers: list[tuple[float, int, str]] = []
        self._events: deque[dict[str, Any]] = deque(maxlen=_EVENT_HISTORY)

    # --- Python control API ----------------------------------------------------------

    def now(self) -> float:
        """The emulator's clock (epoch seconds), including any advance."""
        return self._clock() + self._offset_s

    def advance_clock(self, seconds: float) -> None:
        """Move the emulator's clock forward, e.g. past a lease or the retention period."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self._offset_s += seconds
        self._advance()
        self._notify()

    def reset(self) -> None:
        """Forget every job, the ledger, the faults, the events and any clock advance."""
        self._faults.clear()
        self._init_state()
        self._notify()

    def add_fault(self, rule: FaultRule) -> str:
        """Arm a fault rule; returns its id."""
        rule_id = self._faults.add(rule)
        self._notify()
        return rule_id

    def clear_faults(self) -> int:
        """Disarm every fault rule; returns how many there were."""
        count = self._faults.clear()
        self._notify()
        return count

    def faults(self) -> list[dict[str, Any]]:
        """The armed rules with their fired counts (the JSON of GET /_emulator/faults)."""
        return self._faults.to_json()

    def fault_fired(self, rule_id: str) -> int:
        """How many times a rule fired."""
        return self._faults.fired(rule_id)

    def job(self, job_id: str) -> dict[str, Any] | None:
        """The stored job as GET would show it, or None."""
        self._advance()
        job = self._jobs.get(job_id)
        return None if job is None else job.view()

    def ledger(self) -> dict[str, LedgerEntry]:
        """A snapshot of the ledger, by job id."""
        self._advance()
        entries: dict[str, LedgerEntry] = {}
        for job_id, counts in self._ledger.items():
            job = self._jobs.get(job_id)
            entries[job_id] = LedgerEntry(
                job=None if job is None else job.view(),
                queue=counts.queue,
                created=counts.created,
                overwrites=counts.overwrites,
                posts=counts.posts,
                post_statuses=tuple(counts.post_statuses),
                gets=counts.gets,
                deliveries=counts.deliveries,
                purged=counts.purged,
            )
        return entries

    def ledger_json(self) -> dict[str, Any]:
        """The JSON of GET /_emulator/ledger."""
        return {"jobs": {job_id: e.to_json() for job_id, e in self.ledger().items()}}

    async def wait_until(self, predicate: Callable[[Emulator], bool]) -> None:
        """Return once predicate(self) holds; re-checked after every request and control
        call. Bound it with asyncio.timeout."""
        loop = asyncio.get_running_loop()
        while not predicate(self):
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            await waiter

    def close(self) -> None:
        """Wake every delayed answer so a server stop is not held up by scripted latency."""
        self._closing.set()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # --- HTTP ------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        """An aiohttp application serving this emulator's state."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or f"req_{uuid7(self.now())}"
        try:
            reply = await self._serve(request, request_id)
        except _Reject as exc:
            reply = _Reply(exc.status, exc.envelope(request_id))
        except Exception:
            logger.exception("emulator.handler_crashed path=%s", request.path)
            reply = _Reply(500, _internal_error().envelope(request_id))
        finally:
            self._notify()
        if reply is None:
            # The transport is gone; aiohttp's write of this response fails quietly.
            return web.Response(status=500)
        headers = {
            "Content-Type": OJS_MEDIA_TYPE,
            "OJS-Version": self.config.ojs_version,
            "X-Request-Id": request_id,
            **reply.headers,
        }
        body = reply.raw if reply.raw is not None else _dumps(reply.body)
        return web.Response(status=reply.status, body=body, headers=headers)

    async def _serve(self, request: web.Request, request_id: str) -> _Reply | None:
        path, method = request.path, request.method
        if path.startswith(CONTROL_PREFIX):
            body = await self._read_body(request, _CONTROL_BODY_BYTES)
            return self._dispatch(self._call(request, request_id, body))
        self._advance()
        self._check_auth(request)
        self._check_version(request)
        if method in ("POST", "PUT", "PATCH"):
            self._check_content_type(request)
        call = self._call(request, request_id, await self._read_body(request))
        job_ids = call.job_ids()
        posted = self._count_request(call, job_ids)
        rule = self._faults.take(method, path, job_ids)
        reply: _Reply | None
        if rule is not None and rule.action == "drop":
            self._drop(request)
            reply = None
        elif rule is not None and rule.action == "status":
            reply = self._fault_reply(rule, request_id)
        else:
            if rule is not None and rule.action == "latency":
                await self._pause(rule.delay_ms)
            reply = self._dispatch(call)
            if rule is not None and rule.action == "store_then_drop":
                self._drop(request)
                reply = None
            elif rule is not None and rule.action == "store_then_delay":
                await self._pause(rule.delay_ms)
            elif rule is not None and rule.action == "store_then_status":
                reply = self._fault_reply(rule, request_id)
        for job_id in posted:
            self._counts(job_id).post_statuses.append(None if reply is None else reply.status)
        return reply

    def _call(self, request: web.Request, request_id: str, body: bytes) -> _Call:
        call = _Call(
            method=request.method,
            path=request.path,
            params={},
            query=dict(request.query),
            request_id=request_id,
            body=body,
        )
        if body:
            try:
                call.payload = json.loads(body, parse_constant=_reject_constant)
                call.payload_ok = True
            except (ValueError, UnicodeDecodeError):
                call.payload_ok = False
        for method, pattern, _name in _ROUTES:
            match = pattern.match(request.path)
            if match and method == request.method:
                call.params = match.groupdict()
                break
        return call

    def _dispatch(self, call: _Call) -> _Reply:
        allowed: list[str] = []
        for method, pattern, name in _ROUTES:
            if pattern.match(call.path) is None:
                continue
            if method != call.method:
                allowed.append(method)
                continue
            if name == "_enqueue_batch" and not self.config.batch_enqueue:
                break
            handler: Callable[[_Call], _Reply] = getattr(self, name)
            try:
                return handler(call)
            except _Reject as exc:
                return _Reply(exc.status, exc.envelope(call.request_id))
        if allowed:
            refusal = _Reject(405, "invalid_request", f"Method {call.method} not allowed.")
            return _Reply(405, refusal.envelope(call.request_id), {"Allow": ", ".join(allowed)})
        refusal = _Reject(404, "not_found", f"No route for {call.method} {call.path}.")
        return _Reply(404, refusal.envelope(call.request_id))

    def _check_auth(self, request: web.Request) -> None:
        token = self.config.auth_token
        if token is None or request.path == HEALTH_PATH:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise _Reject(401, "unauthorized", "Missing or malformed Bearer token.")
        if not secrets.compare_digest(credentials.strip().encode(), token.encode()):
            raise _Reject(403, "forbidden", "The Bearer token is not valid for this server.")

    def _check_version(self, request: web.Request) -> None:
        asked = request.headers.get("OJS-Version")
        if asked is not None and asked.strip().split(".")[0] != "1":
            raise _Reject(
                422, "unsupported", f"OJS version {asked!r} is not supported.", retryable=False
            )

    def _check_content_type(self, request: web.Request) -> None:
        header = request.headers.get("Content-Type")
        if header is None or not header.strip():
            return  # the reference middleware accepts a POST without a Content-Type
        media_type = header.split(";", 1)[0].strip().lower()
        if media_type not in ACCEPTED_MEDIA_TYPES:
            raise _invalid(
                "Unsupported Content-Type. Expected 'application/openjobspec+json' or "
                "'application/json'.",
                received=header,
            )

    async def _read_body(self, request: web.Request, limit: int | None = None) -> bytes:
        limit = self.config.max_body_bytes if limit is None else limit
        too_large = _Reject(
            413,
            "invalid_request",
            f"The request body exceeds {limit} bytes.",
            details={"max_bytes": limit},
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        # Read with a bound rather than request.read(): an endless body must not be buffered.
        async for chunk in request.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _count_request(self, call: _Call, job_ids: list[str]) -> list[str]:
        """Count POSTs and GETs per job id; returns the ids whose POST outcome to record."""
        if call.method == "POST" and call.path in ("/ojs/v1/jobs", "/ojs/v1/jobs/batch"):
            for job_id in job_ids:
                self._counts(job_id).posts += 1
            return job_ids
        if call.method == "GET" and "id" in call.params:
            self._counts(call.params["id"]).gets += 1
        return []

    def _counts(self, job_id: str) -> _Counts:
        counts = self._ledger.get(job_id)
        if counts is None:
            counts = self._ledger[job_id] = _Counts()
        return counts

    def _fault_reply(self, rule: FaultRule, request_id: str) -> _Reply:
        headers: dict[str, str] = {}
        if rule.retry_after is not None:
            headers["Retry-After"] = rule.retry_after
        if rule.content_type is not None:
            headers["Content-Type"] = rule.content_type
        if rule.body is not None:
            return _Reply(rule.status, None, headers, raw=rule.body.encode())
        code = rule.code or _DEFAULT_CODES.get(
            rule.status, "backend_error" if rule.status >= 500 else "invalid_request"
        )
        retryable = rule.status == 429 or rule.status >= 500
        message = "an internal error occurred" if code == "internal_error" else "injected fault"
        exc = _Reject(rule.status, code, message, retryable=retryable)
        return _Reply(rule.status, exc.envelope(request_id), headers)

    @staticmethod
    def _drop(request: web.Request) -> None:
        # abort() closes the socket at once, so the client sees a disconnect, not an answer.
        if request.transport is not None:
            request.transport.abort()

    async def _pause(self, delay_ms: int) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_ms / 1000):
                await self._closing.wait()

    # --- state machine ---------------------------------------------------------------

    def _advance(self) -> None:
        """Apply every time-driven transition that is due on the emulator's clock."""
        now = self.now()
        while self._timers and self._timers[0][0] <= now:
            _deadline, version, job_id = heapq.heappop(self._timers)
            job = self._jobs.get(job_id)
            if job is None or job.version != version:
                continue
            if job.state in ("scheduled", "retryable"):
                self._enter(job, "available", now)
            elif job.state == "active":
                self._expire_lease(job, now)
            elif job.state in TERMINAL_STATES:
                del self._jobs[job_id]
                self._counts(job_id).purged = True

    def _enter(self, job: _Job, state: str, now: float) -> None:
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

    def _expire_lease(self, job: _Job, now: float) -> None:
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
            self._enter(job, "discarded", now)
            self._event("job.discarded", job, now)
        else:
            self._enter(job, "available", now)

    def _event(self, kind: str, job: _Job, now: float, **data: Any) -> None:
        self._events.append(
            {
                "id": uuid7(now),
                "type": kind,
                "time": format_time(now),
                "data": {
                    "job_id": job.id,
                    "job_type": job.type,
                    "queue": job.queue,
                    "attempt": job.attempt,
                    "state": job.state,
                    **data,
                },
            }
        )

    def _parse_job(self, payload: Any, now: float) -> _Job:
        """Validate one enqueue request (ojs-protocol.md §1.2) into an unstored job."""
        if not isinstance(payload, dict):
            raise _invalid("The request body must be a JSON object.")
        job_id, job_type, args = _parse_identity(payload, now)
        meta = payload.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise _invalid("The 'meta' field must be a JSON object.", field="meta")
        schema = payload.get("schema")
        if schema is not None and not isinstance(schema, str):
            raise _invalid("The 'schema' field must be a string.", field="schema")
        options = payload.get("options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise _invalid("The 'options' field must be a JSON object.", field="options")

        queue = self._effective_queue(payload, options)
        priority = _field_int(options, "priority", "priority")
        if priority is not None and not -100 <= priority <= 100:
            raise _invalid(
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
            raise _invalid("The 'tags' field must be a list of strings.", field="tags")
        visibility_ms = _field_int(options, "visibility_timeout_ms", "visibility_timeout_ms")
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
        if self.config.queue_source != "options":
            consumed = consumed | {"queue"}
        unknown = {
            key: value
            for key, value in payload.items()
            if key not in consumed and key not in _SYSTEM_FIELDS
        }
        return _Job(
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
            timeout_ms=_field_int(options, "timeout_ms", "timeout_ms"),
            scheduled_at=scheduled[0] if scheduled else None,
            expires_at=expires[0] if expires else None,
            times_as_sent=times_as_sent,
            visibility_timeout_ms=visibility_ms if visibility_ms and visibility_ms > 0 else None,
            unknown=unknown,
        )

    def _effective_queue(self, payload: dict[str, Any], options: dict[str, Any]) -> str:
        source = self.config.queue_source
        label = "options.queue"
        candidate = options.get("queue") if source != "top_level" else None
        if source == "top_level" or (source == "either" and candidate in (None, "")):
            candidate = payload.get("queue")
            label = "queue"
        if candidate is None or candidate == "":
            return "default"
        if not isinstance(candidate, str):
            raise _invalid(f"The '{label}' field must be a string.", field=label)
        if len(candidate) > MAX_QUEUE_LENGTH:
            raise _invalid(
                f"The '{label}' field must not exceed {MAX_QUEUE_LENGTH} characters.", field=label
            )
        if not QUEUE_PATTERN.match(candidate):
            raise _invalid(
                f"The '{label}' field must match pattern '{QUEUE_PATTERN.pattern}'. "
                f"Got: {candidate!r}",
                field=label,
            )
        return candidate

    def _conflict(self, job: _Job, earlier_queues: dict[str, str]) -> _Reject | None:
        """The answer to storing `job` if its id is taken (stored, or earlier in a batch)."""
        stored = self._jobs.get(job.id)
        taken_queue = earlier_queues.get(job.id, stored.queue if stored is not None else None)
        mode = self.config.duplicate_mode
        if taken_queue is None or mode == "overwrite":
            return None
        if mode == "pk500" or (self.config.cross_queue_500 and taken_queue != job.queue):
            return _internal_error()
        return _Reject(
            409, "duplicate", f"A job with ID '{job.id}' already exists.", retryable=False
        )

    def _store(self, job: _Job, now: float) -> None:
        counts = self._counts(job.id)
        if job.id in self._jobs:
            counts.overwrites += 1  # redis/lite: replace the hash, re-add to the queue
        self._jobs[job.id] = job
        counts.created += 1
        counts.queue = job.queue
        counts.purged = False
        if job.scheduled_at is not None and job.scheduled_at > now:
            job.enqueued_at = now
            self._enter(job, "scheduled", now)
        else:
            self._enter(job, "available", now)
        self._event("job.enqueued", job, now)

    def _pop_ready(self, queue: str, now: float) -> _Job | None:
        heap = self._ready.get(queue)
        while heap:
            _priority, _sequence, version, job_id = heapq.heappop(heap)
            job = self._jobs.get(job_id)
            if job is None or job.version != version or job.state != "available":
                continue
            if job.expires_at is not None and job.expires_at <= now:
                job.discarded_at = now  # never ran, so never completed
                job.error = {"type": "expired", "message": "The job expired before it started."}
                self._enter(job, "discarded", now)
                self._event("job.discarded", job, now)
                continue
            return job
        return None

    def _active_job(self, payload: dict[str, Any], verb: str) -> _Job:
        """The job an ack/nack names, checked against its lease (the gateway dialect) or,
        without a lease_token, only for being active (public OJS)."""
        job_id = payload.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise _invalid("The 'job_id' field is required.", field="job_id")
        job = self._jobs.get(job_id)
        if job is None:
            raise _not_found("Job", job_id)
        _check_lease_token(job, payload.get("lease_token"))
        if job.state != "active":
            raise _Reject(
                409,
                "conflict",
                f"Cannot {verb} job not in 'active' state. Current state: '{job.state}'.",
                details={"job_id": job_id, "current_state": job.state, "expected_state": "active"},
            )
        return job

    # --- producer handlers -----------------------------------------------------------

    def _enqueue(self, call: _Call) -> _Reply:
        now = self.now()
        job = self._parse_job(call.json_object(), now)
        conflict = self._conflict(job, {})
        if conflict is not None:
            raise conflict
        self._store(job, now)
        return _Reply(201, {"job": job.view()}, {"Location": f"/ojs/v1/jobs/{job.id}"})

    def _enqueue_batch(self, call: _Call) -> _Reply:
        now = self.now()
        items = call.json_object().get("jobs")
        if not isinstance(items, list) or not items:
            raise _invalid("The 'jobs' field is required and must not be empty.", field="jobs")
        if len(items) > self.config.max_batch_jobs:
            raise _invalid(
                f"The 'jobs' field must not contain more than {self.config.max_batch_jobs} jobs.",
                field="jobs",
                max=self.config.max_batch_jobs,
                received=len(items),
            )
        jobs: list[_Job] = []
        if self.config.batch_atomic:
            for index, item in enumerate(items):
                try:
                    jobs.append(self._parse_job(item, now))
                except _Reject as exc:
                    raise _batch_item_invalid(exc, index, own_status=False) from exc
            earlier: dict[str, str] = {}
            for index, job in enumerate(jobs):
                self._raise_batch_conflict(self._conflict(job, earlier), index)
                earlier[job.id] = job.queue
            for job in jobs:
                self._store(job, now)
        else:
            for index, item in enumerate(items):
                try:
                    if not isinstance(item, dict):
                        raise _invalid("The request body must be a JSON object.")
                    _parse_identity(item, now)  # a generated id is drawn again below
                except _Reject as exc:
                    raise _batch_item_invalid(exc, index, own_status=True) from exc
            for index, item in enumerate(items):
                try:
                    job = self._parse_job(item, now)
                except _Reject as exc:
                    raise _batch_item_invalid(exc, index, own_status=True) from exc
                self._raise_batch_conflict(self._conflict(job, {}), index)
                self._store(job, now)
                jobs.append(job)
        views = [job.view() for job in jobs]
        return _Reply(201, {"jobs": views, "count": len(views)})

    @staticmethod
    def _raise_batch_conflict(conflict: _Reject | None, index: int) -> None:
        if conflict is None:
            return
        if conflict.code == "internal_error":
            raise conflict
        raise _Reject(
            conflict.status,
            conflict.code,
            f"Batch failed: job at index {index}: {conflict.message}",
            details={"index": index},
            retryable=conflict.retryable,
        )

    def _get_job(self, call: _Call) -> _Reply:
        job = self._jobs.get(call.params["id"])
        if job is None:
            raise _not_found("Job", call.params["id"])
        return _Reply(200, {"job": job.view()})

    def _cancel_job(self, call: _Call) -> _Reply:
        now = self.now()
        job = self._jobs.get(call.params["id"])
        if job is None:
            raise _not_found("Job", call.params["id"])
        if job.state in TERMINAL_STATES:
            raise _Reject(
                409,
                "conflict",
                f"Cannot cancel job in terminal state '{job.state}'.",
                details={"job_id": job.id, "current_state": job.state},
            )
        job.cancelled_at = now
        self._enter(job, "cancelled", now)
        self._event("job.cancelled", job, now)
        return _Reply(200, {"job": job.view()})

    def _manifest(self, call: _Call) -> _Reply:
        del call
        return _Reply(
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
                    "batch_enqueue": self.config.batch_enqueue,
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

    def _health(self, call: _Call) -> _Reply:
        del call
        return _Reply(
            200,
            {
                "status": "ok",
                "version": self.config.ojs_version,
                "uptime_seconds": int(self._clock() - self._started_s),
                "backend": {"type": "memory", "status": "ok", "latency_ms": 0},
            },
        )

    def _queue_stats(self, call: _Call) -> _Reply:
        name = call.params["name"]
        counts = dict.fromkeys(JOB_STATES, 0)
        for job in self._jobs.values():
            if job.queue == name:
                counts[job.state] += 1
        return _Reply(200, {"queue": {"name": name, **counts, "paused": False}})

    def _events_list(self, call: _Call) -> _Reply:
        types = {t for t in call.query.get("types", "").split(",") if t}
        queues = {q for q in call.query.get("queues", "").split(",") if q}
        limit_text = call.query.get("limit", "100")
        limit = int(limit_text) if limit_text.isdigit() else 100
        events = [
            event
            for event in self._events
            if (not types or event["type"] in types)
            and (not queues or event["data"]["queue"] in queues)
        ]
        return _Reply(200, {"events": copy.deepcopy(events[:limit])})

    # --- worker handlers -------------------------------------------------------------

    def _fetch(self, call: _Call) -> _Reply:
        now = self.now()
        payload = call.json_object()
        queues = payload.get("queues")
        if (
            not isinstance(queues, list)
            or not queues
            or not all(isinstance(q, str) for q in queues)
        ):
            raise _invalid("The 'queues' field is required and must not be empty.")
        if len(queues) > MAX_FETCH_QUEUES:
            raise _invalid(f"The 'queues' field must not list more than {MAX_FETCH_QUEUES}.")
        count = _field_int(payload, "count", "count") or 1
        count = min(max(count, 1), MAX_FETCH_COUNT)
        worker_id = payload.get("worker_id")
        visibility_ms = _field_int(payload, "visibility_timeout_ms", "visibility_timeout_ms")
        claimed: list[dict[str, Any]] = []
        # Queues are served in the order given, not by one global priority (the guide's rule).
        for queue in queues:
            while len(claimed) < count:
                job = self._pop_ready(queue, now)
                if job is None:
                    break
                lease_ms = (
                    visibility_ms
                    if visibility_ms and visibility_ms > 0
                    else job.visibility_timeout_ms or self.config.default_visibility_timeout_ms
                )
                job.attempt += 1
                job.started_at = now
                job.worker_id = worker_id if isinstance(worker_id, str) else None
                job.lease_token = str(uuid.uuid4())
                job.lease_expires_at = now + lease_ms / 1000
                self._enter(job, "active", now)
                self._counts(job.id).deliveries += 1
                self._event("job.started", job, now)
                claimed.append({**job.view(), "lease_token": job.lease_token})
        body: dict[str, Any] = {"jobs": claimed}
        if claimed:
            body["job"] = claimed[0]
        return _Reply(200, body)

    def _ack(self, call: _Call) -> _Reply:
        now = self.now()
        payload = call.json_object()
        job = self._active_job(payload, "acknowledge")
        if "result" in payload and payload["result"] is not None:
            job.has_result = True
            job.result = payload["result"]
        job.error = None
        job.completed_at = now
        self._enter(job, "completed", now)
        started = job.started_at if job.started_at is not None else now
        self._event("job.completed", job, now, duration_ms=int((now - started) * 1000))
        return _Reply(
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

    def _nack(self, call: _Call) -> _Reply:
        now = self.now()
        payload = call.json_object()
        job = self._active_job(payload, "fail")
        reported = payload.get("error")
        if reported is not None and not isinstance(reported, dict):
            raise _invalid("The 'error' field must be an object.", field="error")
        reply: dict[str, Any] = {"id": job.id, "job_id": job.id}
        if payload.get("requeue") is True:
            job.lease_token = None
            job.lease_expires_at = None
            self._enter(job, "available", now)
            reply.update(state="available", attempt=job.attempt, max_attempts=job.max_attempts)
            reply["job"] = job.view()
            return _Reply(200, reply)
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
        permanent = reported.get("retryable") is False or _non_retryable(
            job.retry, error_type, message
        )
        if permanent or job.attempt >= job.max_attempts:
            job.discarded_at = job.completed_at = now
            self._enter(job, "discarded", now)
            self._event("job.discarded", job, now)
            reply.update(discarded_at=format_time(now), completed_at=format_time(now))
        else:
            delay_s = _backoff_s(job.retry, job.attempt)
            job.next_attempt_at = now + delay_s
            job.retry_delay_ms = int(delay_s * 1000)
            self._enter(job, "retryable", now)
            self._event("job.failed", job, now)
            reply.update(
                next_attempt_at=format_time(job.next_attempt_at),
                retry_delay_ms=job.retry_delay_ms,
            )
        reply.update(state=job.state, attempt=job.attempt, max_attempts=job.max_attempts)
        reply["job"] = job.view()
        return _Reply(200, reply)

    def _heartbeat(self, call: _Call) -> _Reply:
        now = self.now()
        payload = call.json_object()
        worker_id = payload.get("worker_id")
        if not isinstance(worker_id, str) or not worker_id:
            raise _invalid("The 'worker_id' field is required.", field="worker_id")
        active = payload.get("active_jobs")
        job_ids = [i for i in active if isinstance(i, str)] if isinstance(active, list) else []
        if not job_ids and isinstance(payload.get("job_id"), str):
            job_ids = [payload["job_id"]]
        token = payload.get("lease_token")
        visibility_ms = _field_int(payload, "visibility_timeout_ms", "visibility_timeout_ms")
        extended: list[str] = []
        directive = "running"
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            _check_lease_token(job, token)
            if job.state == "active":
                lease_ms = visibility_ms or job.visibility_timeout_ms
                lease_ms = lease_ms or self.config.default_visibility_timeout_ms
                job.lease_expires_at = now + lease_ms / 1000
                self._enter(job, "active", now)
                extended.append(job_id)
            # The reference servers let a job's meta.test_directive drive the answer, which
            # the conformance suite uses to exercise quiet/terminate.
            wanted = (job.meta or {}).get("test_directive")
            if directive == "running" and isinstance(wanted, str) and wanted:
                directive = wanted
        return _Reply(
            200,
            {
                "state": directive,
                "directive": directive,
                "jobs_extended": extended,
                "server_time": format_time(now),
            },
        )

    # --- control handlers ------------------------------------------------------------

    def _control_ledger(self, call: _Call) -> _Reply:
        del call
        return _Reply(200, self.ledger_json())

    def _control_faults(self, call: _Call) -> _Reply:
        del call
        return _Reply(200, {"rules": self.faults()})

    def _control_add_faults(self, call: _Call) -> _Reply:
        payload = call.json()
        if isinstance(payload, dict) and "rules" in payload:
            payload = payload["rules"]
        items = payload if isinstance(payload, list) else [payload]
        rules: list[FaultRule] = []
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                raise _invalid(f"fault rule {index} must be a JSON object")
            try:
                rules.append(FaultRule.from_json(item))
            except (TypeError, ValueError) as exc:
                raise _invalid(f"fault rule {index}: {exc}", index=index) from exc
        ids = [self.add_fault(rule) for rule in rules]
        armed = [rule for rule in self.faults() if rule["id"] in ids]
        return _Reply(201, {"rules": armed})

    def _control_clear_faults(self, call: _Call) -> _Reply:
        del call
        return _Reply(200, {"cleared": self.clear_faults()})

    def _control_reset(self, call: _Call) -> _Reply:
        del call
        self.reset()
        return _Reply(200, {"reset": True})

    def _control_clock(self, call: _Call) -> _Reply:
        advance = call.json_object().get("advance_s", 0)
        if isinstance(advance, bool) or not isinstance(advance, int | float) or advance < 0:
            raise _invalid("advance_s must be a non-negative number", field="advance_s")
        self.advance_clock(float(advance))
        return _Reply(200, {"now": format_time(self.now())})


# --- running it --------------------------------------------------------------------------


@dataclass
class RunningEmulator:
    """An emulator served on a loopback port; `stop()` (or leaving `async with`) ends it."""

    url: str
    emulator: Emulator
    _runner: web.AppRunner = field(repr=False)
    _stopped: bool = field(default=False, repr=False)

    async def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.emulator.close()
        await self._runner.cleanup()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def start_emulator(
    config: EmulatorConfig | None = None, *, host: str = "127.0.0.1", port: int = 0
) -> RunningEmulator:
    """Serve a fresh emulator on host:port (port 0: a free one) and return at once."""
    emulator = Emulator(config)
    # A short shutdown grace: in-flight answers are only scripted delays, woken by close().
    runner = web.AppRunner(emulator.make_app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return RunningEmulator(url=f"http://{shown}:{bound_port}", emulator=emulator, _runner=runner)


def serve(host: str, port: int, config: EmulatorConfig) -> None:
    """Run an emulator until SIGTERM or SIGINT, then stop cleanly (``relayd emulator``)."""
    asyncio.run(_serve_until_signal(host, port, config))


async def _serve_until_signal(host: str, port: int, config: EmulatorConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        async with await start_emulator(config, host=host, port=port) as running:
            # The one line a user (or a test that asked for port 0) needs: where it listens.
            print(f"ojs-emulator listening on {running.url}", flush=True)  # noqa: T201
            await stop.wait()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


__all__ = [
    "DUPLICATE_MODES",
    "QUEUE_SOURCES",
    "DuplicateMode",
    "Emulator",
    "EmulatorConfig",
    "FaultRule",
    "LedgerEntry",
    "QueueSource",
    "RunningEmulator",
    "config_from_options",
    "format_time",
    "parse_duration_s",
    "parse_listen",
    "serve",
    "start_emulator",
    "uuid7",
]
