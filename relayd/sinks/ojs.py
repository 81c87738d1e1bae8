"""The OJS HTTP sink: POST /ojs/v1/jobs (and /jobs/batch), GET-first reconciliation, and the
classification of every answer into an outcome value (ojs-protocol.md §1.10).

aiohttp exceptions stop here: they become `SinkDown` values. The pure functions
(`classify_post`, `classify_get`, `differences`, `parse_error`) are tested as tables; the
class only moves bytes and remembers whether the server offers batches.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp

from relayd import __version__, jsonvalue
from relayd.config import SinkSettings
from relayd.jsonvalue import equal
from relayd.models import (
    DEFAULT_QUEUE,
    ClaimedRow,
    DeadLetter,
    DeadReason,
    Envelope,
    NotStarted,
    Outcome,
    Published,
    Reconcile,
    RetryLater,
    SinkDown,
)
from relayd.retry import parse_retry_after

MEDIA_TYPE = "application/openjobspec+json"
JOBS_PATH = "/ojs/v1/jobs"
BATCH_PATH = "/ojs/v1/jobs/batch"
MANIFEST_PATH = "/ojs/manifest"
_BATCH_OVERHEAD_BYTES = len(b'{"jobs":[]}')
_MAX_RESPONSE_BYTES = 16 * 1024 * 1024
_MANIFEST_TTL_S = 300.0
_MANIFEST_RETRY_S = 30.0
_MESSAGE_CHARS = 200
_ALIASES = {"duplicate_job": "duplicate"}  # ojs-errors.md's SCREAMING_SNAKE taxonomy
_O = TypeVar("_O")


class SinkHealth(Protocol):
    """Where the sink reports each exchange: the circuit breaker."""

    def sink_ok(self) -> None: ...

    def sink_failed(self, *, severe: bool) -> None: ...


# --- pure classification ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    retry_after: str | None


@dataclass(frozen=True, slots=True)
class SinkError:
    """An error body, parsed leniently (wrapped, unwrapped or a bare string code)."""

    code: str | None
    message: str | None
    details: Mapping[str, Any]

    def describe(self, status: int) -> str:
        parts = [f"HTTP {status}"]
        if self.code:
            parts.append(self.code)
        if self.message:
            parts.append(self.message[:_MESSAGE_CHARS])
        return ": ".join(parts) if len(parts) > 1 else parts[0]


@dataclass(frozen=True, slots=True)
class NotFound:
    """GET answered 404: the sink does not hold the id (never did, or purged it)."""


def parse_json(body: bytes) -> Any:
    """The body as JSON, or None if it is not JSON relayd can read (never raises)."""
    try:
        return jsonvalue.loads(body)
    except jsonvalue.JsonError:
        return None


def parse_error(body: bytes) -> SinkError:
    """`{"error": {...}}`, `{"code": ...}` or `{"error": "Code", "message": ...}` (§1.4)."""
    data = parse_json(body)
    if not isinstance(data, dict):
        return SinkError(code=None, message=None, details={})
    inner = data.get("error")
    source = inner if isinstance(inner, dict) else data
    code = inner if isinstance(inner, str) else source.get("code")
    message = source.get("message")
    details = source.get("details")
    normal = code.lower() if isinstance(code, str) else None
    return SinkError(
        code=_ALIASES.get(normal, normal) if normal else None,
        message=message if isinstance(message, str) else None,
        details=details if isinstance(details, dict) else {},
    )


def _job_of(body: bytes) -> dict[str, Any] | None:
    data = parse_json(body)
    job = data.get("job") if isinstance(data, dict) else None
    return job if isinstance(job, dict) and isinstance(job.get("id"), str) else None


def classify_post(response: Response, event_id: str) -> Outcome | Reconcile:
    """What one POST /ojs/v1/jobs answer means for the row (ojs-protocol.md §1.10)."""
    status = response.status
    if 200 <= status < 300:
        job = _job_of(response.body)
        if job is None:
            # Accepted, but by whom? A proxy's 200 page is not an OJS acceptance: reconcile.
            return RetryLater(f"HTTP {status} with an unreadable body")
        state = str(job.get("state") or "accepted")
        if job["id"] == event_id:
            return Published(sink_state=state)
        # 200 with another id: the sink's unique policy kept an existing job instead.
        return Published(sink_state="deduplicated", sink_job_id=job["id"])
    error = parse_error(response.body)
    text = error.describe(status)
    if error.code == "queue_paused":
        return RetryLater(text, parse_retry_after(response.retry_after))
    if status == 409:
        existing = error.details.get("existing_job_id")
        return Reconcile(text, existing if isinstance(existing, str) else None)
    if status == 400:
        return DeadLetter(DeadReason.SINK_REJECTED, text)
    if status == 413:
        return DeadLetter(DeadReason.SINK_TOO_LARGE, text)
    if status == 422:
        return DeadLetter(DeadReason.SINK_UNPROCESSABLE, text)
    return _failure(status, text, parse_retry_after(response.retry_after), method="POST")


def _failure(status: int, text: str, retry_after_s: float | None, *, method: str) -> Outcome:
    """Statuses that say nothing about the row itself."""
    if status in (401, 403):
        return SinkDown(f"{text} (check sink.token_file)", severe=True)
    if (status in (404, 405) and method == "POST") or status == 415 or 300 <= status < 400:
        return SinkDown(f"{text} (check sink.url)", severe=True)
    if status in (408, 429) or status >= 500:
        return SinkDown(text, retry_after_s=retry_after_s)
    return RetryLater(text, retry_after_s)


def classify_get(response: Response, envelope: Envelope) -> Outcome | NotFound:
    """What GET /ojs/v1/jobs/{id} says about our envelope (C2)."""
    if response.status == 404:
        return NotFound()
    if response.status == 200:
        job = _job_of(response.body)
        if job is None:
            return RetryLater("GET: HTTP 200 with an unreadable body")
        diff = differences(envelope, job)
        if diff:
            return DeadLetter(
                DeadReason.CONFLICT,
                f"the sink holds a different job under this id ({', '.join(diff)} differ)",
            )
        return Published(sink_state=str(job.get("state") or "unknown"), reconciled=True)
    error = parse_error(response.body)
    return _failure(
        response.status,
        "GET: " + error.describe(response.status),
        parse_retry_after(response.retry_after),
        method="GET",
    )


def differences(envelope: Envelope, job: Mapping[str, Any]) -> list[str]:
    """The immutable fields on which the sink's job differs from ours, compared by meaning
    (ojs-protocol.md §1.6): id and type exactly, the effective queue, args by value, only the
    meta keys we sent, and the priority and tags we sent."""
    found: list[str] = []
    if job.get("id") != envelope.id:
        found.append("id")
    if job.get("type") != envelope.type:
        found.append("type")
    if (job.get("queue") or DEFAULT_QUEUE) != envelope.queue:
        found.append("queue")
    if not equal(job.get("args"), envelope.args):
        found.append("args")
    meta = job.get("meta")
    meta = meta if isinstance(meta, dict) else {}
    if any(key not in meta or not equal(meta[key], v) for key, v in envelope.meta.items()):
        found.append("meta")
    if envelope.priority is not None and not equal(job.get("priority"), envelope.priority):
        found.append("priority")
    if envelope.tags is not None and not equal(job.get("tags"), envelope.tags):
        found.append("tags")
    return found


def classify_exception(exc: BaseException) -> SinkDown:
    """A transport failure. `reached` is False only when no byte can have been stored."""
    if isinstance(exc, aiohttp.ClientSSLError):
        return SinkDown(f"TLS failure: {type(exc).__name__}", reached=False, severe=True)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return SinkDown("connect timed out", reached=False)
    if isinstance(exc, aiohttp.ClientConnectorError):
        reason = exc.os_error.strerror or type(exc.os_error).__name__
        return SinkDown(f"cannot connect: {reason}", reached=False)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return SinkDown("the server closed the connection without an answer")
    if isinstance(exc, aiohttp.ClientOSError):
        return SinkDown(f"connection failed mid-request: {exc.strerror or type(exc).__name__}")
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return SinkDown("read timed out")
    return SinkDown(f"HTTP client error: {type(exc).__name__}")


def timed_out(elapsed_s: float) -> SinkDown:
    """The attempt's deadline passed mid-exchange: the server may have stored the job."""
    return SinkDown(f"no answer within the attempt deadline ({elapsed_s:.1f}s)")


def request_id(event_id: str, attempt: int, suffix: str = "") -> str:
    """`X-Request-Id`, stable per row and attempt, so sink logs can be joined to ours."""
    return f"relayd-{event_id}-{attempt}{suffix}"


def batch_body(rows: Sequence[ClaimedRow]) -> bytes:
    """The stored envelopes, unchanged, inside `{"jobs": [...]}`."""
    return b'{"jobs":[' + b",".join(row.job for row in rows) + b"]}"


def plan_batches(
    rows: Sequence[ClaimedRow], *, max_jobs: int, max_bytes: int
) -> list[list[ClaimedRow]]:
    """Split rows into batch requests of at most `max_jobs` jobs and `max_bytes` bytes."""
    batches: list[list[ClaimedRow]] = []
    current: list[ClaimedRow] = []
    size = _BATCH_OVERHEAD_BYTES
    for row in rows:
        row_bytes = len(row.job) + 1
        if current and (len(current) >= max_jobs or size + row_bytes > max_bytes):
            batches.append(current)
            current, size = [], _BATCH_OVERHEAD_BYTES
        current.append(row)
        size += row_bytes
    if current:
        batches.append(current)
    return batches


# --- the sink --------------------------------------------------------------------------


class OjsSink:
    """Publishes rows to one OJS server over a keep-alive connection pool.

    Every POST is sent only while its attempt may still start (`send_by`, loop time): a
    claim whose lease ran out while relayd was waiting (for PostgreSQL's answer, a free
    connection, an earlier request) must not write to the sink (C4). A GET changes nothing
    on the sink, so it needs no such check.
    """

    def __init__(self, settings: SinkSettings, url: str, health: SinkHealth) -> None:
        self._settings = settings
        self._url = url
        self._health = health
        self._session: aiohttp.ClientSession | None = None
        self._batch_known: bool | None = {"on": True, "off": False}.get(settings.batch)
        self._batch_checked_at = float("-inf")
        token = settings.token.get_secret_value() if settings.token is not None else None
        self._secrets = secret_forms(token) if token else ()

    async def start(self) -> None:
        headers = {"Accept": MEDIA_TYPE, "User-Agent": f"relayd/{__version__}"}
        if self._settings.token is not None:
            headers["Authorization"] = f"Bearer {self._settings.token.get_secret_value()}"
        ssl_context = ssl.create_default_context(
            cafile=str(self._settings.ca_file) if self._settings.ca_file else None
        )
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(
                limit=self._settings.concurrency, ssl=ssl_context, keepalive_timeout=30
            ),
            # The relay bounds each attempt with one outer deadline; only connecting has its
            # own, shorter limit so a dead host fails fast.
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self._settings.connect_timeout_s
            ),
            auto_decompress=True,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- single rows ---

    async def publish(self, row: ClaimedRow, envelope: Envelope, *, send_by: float) -> Outcome:
        """GET first if an earlier attempt may have landed, else POST; a 409 is reconciled."""
        if row.claimed_before:
            found = await self._get(row, envelope)
            if not isinstance(found, NotFound):
                return found
        posted = await self._post(row, send_by)
        if not isinstance(posted, Reconcile):
            return posted
        found = await self._get(row, envelope, suffix="-reconcile")
        if not isinstance(found, NotFound):
            return found
        if posted.existing_job_id and posted.existing_job_id != row.event_id:
            # A unique policy rejected ours in favour of an existing job (§1.5).
            return Published(sink_state="deduplicated", sink_job_id=posted.existing_job_id)
        return RetryLater(f"{posted.error}, yet GET finds no job with this id")

    async def _post(self, row: ClaimedRow, send_by: float) -> Outcome | Reconcile:
        if _too_late(send_by):
            return NotStarted()
        answer = await self._exchange(
            "POST", JOBS_PATH, row.job, request_id(row.event_id, row.attempts)
        )
        return self._noted(
            answer if isinstance(answer, SinkDown) else classify_post(answer, row.event_id)
        )

    async def _get(
        self, row: ClaimedRow, envelope: Envelope, suffix: str = "-get"
    ) -> Outcome | NotFound:
        answer = await self._exchange(
            "GET",
            f"{JOBS_PATH}/{row.event_id}",
            None,
            request_id(row.event_id, row.attempts, suffix),
        )
        return self._noted(
            answer if isinstance(answer, SinkDown) else classify_get(answer, envelope)
        )

    # --- batches ---

    async def batch_enabled(self) -> bool:
        """`sink.batch`, or for `auto` the manifest's `capabilities.batch_enqueue` (cached)."""
        if self._settings.batch != "auto":
            return bool(self._batch_known)
        ttl = _MANIFEST_TTL_S if self._batch_known is not None else _MANIFEST_RETRY_S
        if time.monotonic() - self._batch_checked_at < ttl:
            return bool(self._batch_known)
        self._batch_checked_at = time.monotonic()
        answer = await self._exchange("GET", MANIFEST_PATH, None, "relayd-manifest")
        if isinstance(answer, SinkDown) or answer.status != 200:
            self._batch_known = None
            return False
        manifest = parse_json(answer.body)
        capabilities = manifest.get("capabilities") if isinstance(manifest, dict) else None
        self._batch_known = (
            isinstance(capabilities, dict) and capabilities.get("batch_enqueue") is True
        )
        return self._batch_known

    def plan_batches(self, rows: Sequence[ClaimedRow]) -> list[list[ClaimedRow]]:
        return plan_batches(
            rows,
            max_jobs=self._settings.batch_max_jobs,
            max_bytes=self._settings.batch_max_bytes,
        )

    async def publish_batch(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, send_by: float
    ) -> dict[str, Outcome]:
        """First attempts through POST /jobs/batch (§1.7). A 400/422 naming an index
        dead-letters that row, reconciles the rows before it (a server that stores items one
        by one may hold them) and resends the rest; 413 (or a 400/422 naming none) splits;
        any other failure leaves every row of the request ambiguous."""
        outcomes: dict[str, Outcome] = {}
        pending = [list(rows)]
        while pending:
            chunk = pending.pop()
            if len(chunk) == 1:
                row = chunk[0]
                outcomes[row.event_id] = await self.publish(
                    row, envelopes[row.event_id], send_by=send_by
                )
                continue
            if _too_late(send_by):
                outcomes.update((row.event_id, NotStarted()) for row in chunk)
                continue
            answer = await self._exchange(
                "POST",
                BATCH_PATH,
                batch_body(chunk),
                request_id(chunk[0].event_id, chunk[0].attempts, f"-batch{len(chunk)}"),
            )
            if isinstance(answer, SinkDown):
                self._noted(answer)
                outcomes.update((row.event_id, answer) for row in chunk)
                continue
            status = answer.status
            if 200 <= status < 300:
                self._health.sink_ok()
                outcomes.update(_batch_accepted(chunk, answer.body))
                continue
            if status in (404, 405):
                # The manifest promised batches the server does not serve: publish singly.
                self._batch_known, self._batch_checked_at = False, time.monotonic()
                self._health.sink_ok()
                outcomes.update((row.event_id, NotStarted()) for row in chunk)
                continue
            error = parse_error(answer.body)
            index = error.details.get("index")
            if status in (400, 422) and isinstance(index, int) and 0 <= index < len(chunk):
                self._health.sink_ok()
                bad = chunk[index]
                reason = (
                    DeadReason.SINK_REJECTED if status == 400 else DeadReason.SINK_UNPROCESSABLE
                )
                outcomes[bad.event_id] = DeadLetter(reason, error.describe(status))
                earlier = await self._reconcile(chunk[:index], envelopes, outcomes)
                rest = earlier + chunk[index + 1 :]
                if rest:
                    pending.append(rest)
                continue
            if status in (400, 413, 422):
                self._health.sink_ok()
                half = len(chunk) // 2
                pending.extend((chunk[:half], chunk[half:]))
                continue
            failed = self._noted(classify_post(answer, ""))
            ambiguous: Outcome = (
                failed
                if isinstance(failed, SinkDown | RetryLater)
                else RetryLater(error.describe(status))
            )
            outcomes.update((row.event_id, ambiguous) for row in chunk)
        return outcomes

    async def _reconcile(
        self,
        rows: Sequence[ClaimedRow],
        envelopes: Mapping[str, Envelope],
        outcomes: dict[str, Outcome],
    ) -> list[ClaimedRow]:
        """GET each row (C2): record what the sink holds in `outcomes`; return the rows it
        does not hold, which may be sent again."""
        found = await asyncio.gather(
            *(self._get(row, envelopes[row.event_id], suffix="-batch-get") for row in rows)
        )
        absent: list[ClaimedRow] = []
        for row, result in zip(rows, found, strict=True):
            if isinstance(result, NotFound):
                absent.append(row)
            else:
                outcomes[row.event_id] = result
        return absent

    # --- transport ---

    async def _exchange(
        self, method: str, path: str, body: bytes | None, rid: str
    ) -> Response | SinkDown:
        if self._session is None:
            raise RuntimeError("OjsSink.start() was not called")
        headers = {"X-Request-Id": rid}
        if body is not None:
            headers["Content-Type"] = MEDIA_TYPE
        try:
            async with self._session.request(
                method, self._url + path, data=body, headers=headers, allow_redirects=False
            ) as response:
                content = await response.content.read(_MAX_RESPONSE_BYTES)
                if not 200 <= response.status < 300:
                    # Error text may reach logs and last_error; a server or proxy that
                    # echoes our Authorization header must not put the token there.
                    content = redact(content, self._secrets)
                return Response(response.status, content, response.headers.get("Retry-After"))
        except aiohttp.ClientError as exc:
            return classify_exception(exc)

    def _noted(self, outcome: _O) -> _O:
        """Tell the breaker whether this exchange showed a healthy sink."""
        if isinstance(outcome, SinkDown):
            self._health.sink_failed(severe=outcome.severe)
        else:
            self._health.sink_ok()
        return outcome


def _too_late(send_by: float) -> bool:
    return asyncio.get_running_loop().time() > send_by


def secret_forms(secret: str) -> tuple[bytes, ...]:
    """The byte strings under which `secret` may appear in an answer: as sent, and as JSON
    encoders escape it (with or without non-ASCII escapes, an escaped `/`, Go's escaped
    `<`, `>` and `&`); longest first, so no form is left half replaced."""
    forms = {secret}
    for ascii_only in (True, False):
        escaped = json.dumps(secret, ensure_ascii=ascii_only)[1:-1]
        go = escaped.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        forms.update((escaped, escaped.replace("/", "\\/"), go))
    return tuple(sorted((form.encode() for form in forms), key=len, reverse=True))


def redact(body: bytes, secrets: Sequence[bytes]) -> bytes:
    for secret in secrets:
        body = body.replace(secret, b"***")
    return body


def _batch_accepted(chunk: Sequence[ClaimedRow], body: bytes) -> dict[str, Outcome]:
    data = parse_json(body)
    jobs = data.get("jobs") if isinstance(data, dict) else None
    states: dict[str, str] = {}
    if isinstance(jobs, list):
        for job in jobs:
            if isinstance(job, dict) and isinstance(job.get("id"), str):
                states[job["id"]] = str(job.get("state") or "accepted")
    return {
        row.event_id: (
            Published(sink_state=states[row.event_id])
            if row.event_id in states
            else RetryLater("the batch was accepted but its answer does not list this id")
        )
        for row in chunk
    }
