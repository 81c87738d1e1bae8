"""The OJS wire as the emulator speaks it: media types, the error envelope (`Reject`), a
request as an endpoint sees it (`Call`) and its answer (`Reply`), JSON, times and durations."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn

OJS_MEDIA_TYPE = "application/openjobspec+json"
ACCEPTED_MEDIA_TYPES = frozenset({OJS_MEDIA_TYPE, "application/json"})
EMULATOR_VERSION = "0.1.0"
HEALTH_PATH = "/ojs/v1/health"
CONTROL_PREFIX = "/_emulator/"

_DURATION_PATTERN = re.compile(
    r"^P(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$"
)
_RETRYABLE_CODES = frozenset({"internal_error", "backend_error", "rate_limited", "queue_paused"})
# The code an error answer carries when only its status is known (a scripted fault).
DEFAULT_CODES = {
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


# --- times and JSON ----------------------------------------------------------------------


def format_time(epoch_s: float) -> str:
    """RFC 3339 UTC with milliseconds, like the reference servers."""
    return _format_millis(math.floor(epoch_s * 1000))


@functools.lru_cache(maxsize=4096)
def _format_millis(millis: int) -> str:
    """Cached: a batch stamps every job, and every event, with the same millisecond."""
    seconds, rest = divmod(millis, 1000)
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{rest:03d}Z"


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


def parse_instant(text: str, now_s: float) -> float:
    """RFC 3339 with a zone, or ``+PT5S`` relative to now (the servers accept both)."""
    if text.startswith("+P"):
        return now_s + parse_duration_s(text[1:])
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError("timestamp without a timezone")
    return moment.timestamp()


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def loads(body: bytes) -> Any:
    """Parse a request body; NaN and Infinity are not JSON (ValueError, like any bad body)."""
    return json.loads(body, parse_constant=_reject_constant)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, as the answers are sent."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


# --- errors ------------------------------------------------------------------------------


class Reject(Exception):
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
        """The wrapped error body: ``{"error": {code, message, retryable, …, request_id}}``."""
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


def internal_error() -> Reject:
    """The answer to anything that is not an OJS error (a storage failure, a crash)."""
    # The reference servers sanitize non-OJS errors to this message, retryable.
    return Reject(500, "internal_error", "an internal error occurred")


def invalid(message: str, **details: Any) -> Reject:
    """400 invalid_request, with the details given (none: no details)."""
    return Reject(400, "invalid_request", message, details=details or None)


def not_found(kind: str, resource_id: str) -> Reject:
    """404 not_found for a resource (a job) that does not exist or was purged."""
    return Reject(
        404,
        "not_found",
        f"{kind} '{resource_id}' not found.",
        details={"resource_type": kind.lower(), "resource_id": resource_id},
        extra={
            "hint": "The job may never have existed or may have been purged by retention.",
            "docs_url": "https://openjobspec.org/spec/ojs-http-binding#errors",
        },
    )


def field_int(container: dict[str, Any], name: str, label: str) -> int | None:
    """An optional integer field of a request body; 400 naming `label` if it is not one."""
    value = container.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"The '{label}' field must be an integer.", field=label)
    return value


# --- requests and answers ----------------------------------------------------------------


@dataclass
class Call:
    """One request as an endpoint sees it: path parameters, query, and the parsed body."""

    method: str
    path: str
    params: dict[str, str]
    query: dict[str, str]
    request_id: str
    body: bytes
    payload: Any = None
    payload_ok: bool = False
    # The emulator's clock when the request was received (its handler began, before its
    # body was read): the receipt time of the jobs it stores.
    received_at: float = 0.0

    def json(self) -> Any:
        """The parsed body; 400 if it was not JSON."""
        if not self.payload_ok:
            raise invalid("Invalid JSON in request body.")
        return self.payload

    def json_object(self) -> dict[str, Any]:
        """The parsed body, which must be a JSON object."""
        payload = self.json()
        if not isinstance(payload, dict):
            raise invalid("The request body must be a JSON object.")
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
class Reply:
    """An endpoint's answer: status and JSON body (or `raw` bytes, already encoded: a
    fault's body, or an answer that shares values with the stored jobs), extra headers."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None


@dataclass(frozen=True)
class Route:
    """An endpoint: the method, a path pattern whose named groups become `Call.params`, and
    the handler. A disabled route ends the lookup, so the path answers 404."""

    method: str
    pattern: re.Pattern[str]
    handler: Callable[[Call], Reply]
    enabled: bool = True
