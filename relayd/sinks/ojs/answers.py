"""What an OJS server's answers mean, without doing I/O: the classification of every POST,
GET and batch answer into an outcome value, lenient error bodies (and which bodies are the
server's verdict on a row at all), the comparison of a job by meaning after a GET (C2), batch
chunking, and keeping the sink token, or any piece of it, out of error text.

Everything here is a pure function of its arguments and is tested as a table
(tests/unit/sinks/ojs/test_answers.py); `sink.py` beside it moves the bytes. The OJS facts
these rules follow are in docs/ojs.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import msgspec

from relayd.core import jsonvalue
from relayd.core.envelope import DEFAULT_QUEUE, Envelope
from relayd.core.jsonvalue import equal
from relayd.core.outcomes import (
    DeadLetter,
    DeadReason,
    NotFound,
    Outcome,
    Published,
    RetryLater,
    SinkDown,
)
from relayd.core.retry import parse_retry_after
from relayd.core.rows import ClaimedRow
from relayd.sinks.http.answers import Response, excerpt

MEDIA_TYPE = "application/openjobspec+json"
JOBS_PATH = "/ojs/v1/jobs"
BATCH_PATH = "/ojs/v1/jobs/batch"
MANIFEST_PATH = "/ojs/manifest"
_BATCH_OVERHEAD_BYTES = len(b'{"jobs":[]}')
_Scrubbable = TypeVar("_Scrubbable", bound="Outcome | NotFound | Reconcile")
# Options that change when or whether a job runs; postgres' batch path drops them
# (docs/ojs.md#batches), so rows carrying them are always published one by one.
NON_BATCHABLE_OPTIONS = frozenset({"scheduled_at", "delay_until", "expires_at", "unique"})
_MESSAGE_CHARS = 200
# The SCREAMING_SNAKE error taxonomy some OJS documents use, mapped onto the servers' codes.
_ALIASES = {"duplicate_job": "duplicate"}
# An OJS error code: `invalid_request`, `DUPLICATE_JOB`, `PayloadTooLarge`, `x_custom`. A
# framework's `"error": "Bad Request"` is a reason phrase, not a code.
_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# The statuses with which an OJS server refuses a row as invalid: its verdict on the row
# only when it says so in its own error format (`SinkError.ojs`).
_ROW_VERDICTS = {
    400: DeadReason.SINK_REJECTED,
    413: DeadReason.SINK_TOO_LARGE,
    422: DeadReason.SINK_UNPROCESSABLE,
}


@dataclass(frozen=True, slots=True)
class Reconcile:
    """The answer proves nothing (a 409): GET the id and compare before deciding."""

    error: str
    existing_job_id: str | None = None


@dataclass(frozen=True, slots=True)
class SinkError:
    """An error body, parsed leniently (wrapped, unwrapped or a bare string code).

    `ojs` says whether the body is an OJS error at all (docs/ojs.md#error-bodies): a JSON
    object whose error (`error` if it is an object, else the top level) has a code (a word
    such as `invalid_request`, or `error` itself as such a string) and a string `message`.
    Only such a body is the server's verdict on a row; a plain-text, HTML or other JSON
    body comes from an HTTP layer or a proxy in front of it and speaks of the request.
    """

    code: str | None
    message: str | None
    details: Mapping[str, Any]
    ojs: bool = False

    def describe(self, status: int) -> str:
        parts = [f"HTTP {status}"]
        if self.code:
            parts.append(self.code)
        if self.message:
            parts.append(self.message[:_MESSAGE_CHARS])
        return ": ".join(parts) if len(parts) > 1 else parts[0]


def parse_json(body: bytes) -> Any:
    """The body as JSON, or None if it is not JSON relayd can read (never raises). Not held
    to the envelope's depth bound: an answer wraps the envelope a level or two deeper."""
    try:
        return jsonvalue.loads(body, bounded=False)
    except jsonvalue.JsonError:
        return None


def parse_error(body: bytes) -> SinkError:
    """`{"error": {...}}`, `{"code": ...}` or `{"error": "Code", "message": ...}`
    (docs/ojs.md#error-bodies)."""
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
        ojs=_is_code(code) and isinstance(message, str),
    )


def _is_code(value: object) -> bool:
    return isinstance(value, str) and _CODE.fullmatch(value) is not None


def _not_a_verdict(status: int, error: SinkError, body: bytes, prefix: str) -> SinkDown:
    """A 4xx that is not the OJS server's verdict on the row: it speaks of the request (a
    header too large, a proxy's refusal), so it would refuse any row. Sink-wide, for the
    breaker; never a dead letter."""
    if error.ojs:
        text = prefix + error.describe(status)
    else:
        shown = excerpt(body)
        text = f"{prefix}HTTP {status}, not an OJS error body" + (f": {shown}" if shown else "")
    if status == 431:
        # relayd's only header of any size is the token.
        return SinkDown(f"{text} (check sink.token_file: headers too large)", severe=True)
    return SinkDown(text)


def _job_of(body: bytes) -> dict[str, Any] | None:
    data = parse_json(body)
    job = data.get("job") if isinstance(data, dict) else None
    return job if isinstance(job, dict) and isinstance(job.get("id"), str) else None


def classify_post(response: Response, event_id: str) -> Outcome | Reconcile:
    """What one POST /ojs/v1/jobs answer means for the row (docs/ojs.md#outcomes)."""
    status = response.status
    if 200 <= status < 300:
        job = _accepted_job(response.body)
        if job is None:
            # Accepted, but by whom? A proxy's 200 page is not an OJS acceptance: reconcile.
            return RetryLater(f"HTTP {status} with an unreadable body")
        if job.id == event_id:
            return _published(job.state or "accepted")
        # 200 with another id: the sink's unique policy kept an existing job instead.
        return Published(sink_state="deduplicated", sink_job_id=job.id)
    error = parse_error(response.body)
    text = error.describe(status)
    if error.code == "queue_paused":
        return RetryLater(text, parse_retry_after(response.retry_after))
    if status == 409:
        existing = error.details.get("existing_job_id")
        return Reconcile(text, existing if isinstance(existing, str) else None)
    reason = _ROW_VERDICTS.get(status)
    if reason is not None and error.ojs:
        return DeadLetter(reason, text)
    return _failure(response, error, method="POST")


def _failure(response: Response, error: SinkError, *, method: str) -> Outcome:
    """Statuses that say nothing about the row itself."""
    status = response.status
    prefix = "GET: " if method == "GET" else ""
    text = prefix + error.describe(status)
    retry_after_s = parse_retry_after(response.retry_after)
    if status in (401, 403):
        return SinkDown(f"{text} (check sink.token_file)", severe=True)
    if (status in (404, 405) and method == "POST") or status == 415 or 300 <= status < 400:
        return SinkDown(f"{text} (check sink.url)", severe=True)
    if status in (408, 429) or status >= 500:
        return SinkDown(text, retry_after_s=retry_after_s)
    if 400 <= status < 500 and (not error.ojs or status == 431):
        return _not_a_verdict(status, error, response.body, prefix)
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
    return _failure(response, parse_error(response.body), method="GET")


def differences(envelope: Envelope, job: Mapping[str, Any]) -> list[str]:
    """The immutable fields on which the sink's job differs from ours, compared by meaning
    (docs/ojs.md#comparing-a-job-after-a-get): id and type exactly, the effective queue,
    args by value, only the meta keys we sent, and the priority and tags we sent."""
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


def request_id(event_id: str, attempt: int, suffix: str = "") -> str:
    """`X-Request-Id`, stable per row and attempt, so sink logs can be joined to ours."""
    return f"relayd-{event_id}-{attempt}{suffix}"


# --- batches --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchAccepted:
    """2xx: each row's outcome (a row the answer does not list is left ambiguous)."""

    outcomes: Mapping[str, Outcome]


@dataclass(frozen=True, slots=True)
class BatchDrop:
    """400/422 with an OJS error body naming item `index`: that row is dead-lettered. The
    items before it may have been stored by a server that stores one by one, so they are
    reconciled before they are sent again; the items after it were not stored."""

    index: int
    dead: DeadLetter


@dataclass(frozen=True, slots=True)
class BatchSplit:
    """413 (whoever says it: the body is too large for the server or a proxy), or 400/422
    with an OJS error body naming no item: the body as a whole was refused; send it in
    halves."""


@dataclass(frozen=True, slots=True)
class BatchNotServed:
    """404/405: the server does not serve batches after all; publish the rows one by one."""


@dataclass(frozen=True, slots=True)
class BatchFailed:
    """Any other answer: every row of the request is ambiguous (batches are not reliably
    atomic), so each is reconciled on its next attempt."""

    outcome: SinkDown | RetryLater


BatchVerdict = BatchAccepted | BatchDrop | BatchSplit | BatchNotServed | BatchFailed


def classify_batch(response: Response, chunk: Sequence[ClaimedRow]) -> BatchVerdict:
    """What one POST /ojs/v1/jobs/batch answer means for the rows it carried."""
    status = response.status
    if 200 <= status < 300:
        return BatchAccepted(_batch_accepted(chunk, response.body))
    if status in (404, 405):
        return BatchNotServed()
    if status == 413:
        return BatchSplit()
    error = parse_error(response.body)
    if status in (400, 422) and error.ojs:
        index = _index(error.details.get("index"), len(chunk))
        if index is None:
            return BatchSplit()
        return BatchDrop(index, DeadLetter(_ROW_VERDICTS[status], error.describe(status)))
    # Without an OJS body a 400 or 422 is not about an item (classify_post: sink-wide).
    failed = classify_post(response, "")
    if isinstance(failed, SinkDown | RetryLater):
        return BatchFailed(failed)
    return BatchFailed(RetryLater(error.describe(status)))


class _JobRef(msgspec.Struct):
    id: str
    state: str | None = None


class _BatchAnswer(msgspec.Struct):
    jobs: list[_JobRef]


class _Answer(msgspec.Struct):
    job: _JobRef


# An answer echoes every job in full; only ids and states matter here, and a typed decode
# skips the rest without building it.
_ANSWER = msgspec.json.Decoder(_Answer)
_BATCH_ANSWER = msgspec.json.Decoder(_BatchAnswer)


def _accepted_job(body: bytes) -> _JobRef | None:
    """The id and state of the job a 2xx answer to one POST names, or None if it names none."""
    try:
        return _ANSWER.decode(body).job
    except (msgspec.DecodeError, RecursionError):  # not the usual shape: read it leniently
        job = _job_of(body)
        return None if job is None else _JobRef(job["id"], str(job.get("state") or "accepted"))


_NOT_LISTED = RetryLater("the batch was accepted but its answer does not list this id")


def _batch_accepted(chunk: Sequence[ClaimedRow], body: bytes) -> dict[str, Outcome]:
    try:
        states = {job.id: job.state or "accepted" for job in _BATCH_ANSWER.decode(body).jobs}
    except (msgspec.DecodeError, RecursionError):  # not the usual shape: read it leniently
        states = _listed_states(body)
    return {row.event_id: _published(states.get(row.event_id)) for row in chunk}


def _listed_states(body: bytes) -> dict[str, str]:
    data = parse_json(body)
    jobs = data.get("jobs") if isinstance(data, dict) else None
    states: dict[str, str] = {}
    if isinstance(jobs, list):
        for job in jobs:
            if isinstance(job, dict) and isinstance(job.get("id"), str):
                states[job["id"]] = str(job.get("state") or "accepted")
    return states


@functools.lru_cache(maxsize=64)
def _published(state: str | None) -> Outcome:
    """One shared value per state (outcomes are immutable): no object per row."""
    return _NOT_LISTED if state is None else Published(sink_state=state)


def _index(value: object, length: int) -> int | None:
    """`details.index` if it names an item of the request."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < length:
        return value
    return None


def batch_body(rows: Sequence[ClaimedRow]) -> bytes:
    """The stored envelopes, unchanged, inside `{"jobs": [...]}`."""
    return b'{"jobs":[' + b",".join(row.job for row in rows) + b"]}"


def batchable(envelope: Envelope) -> bool:
    """Whether a batch request keeps everything the envelope asks of the server."""
    return NON_BATCHABLE_OPTIONS.isdisjoint(envelope.options)


def chunk_batches(
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


# --- secrets ---------------------------------------------------------------------------


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


# A run of at least this many characters of a token is a piece of it. A server may echo a
# header cut short (aiohttp's "Got more than 8190 bytes when reading: b'Bearer ...'" shows
# its first hundred characters), which no whole-token replacement finds.
_PIECE_CHARS = 8


@dataclass(frozen=True, slots=True)
class SecretPieces:
    """What text must not show of the tokens a sink sent: each form whole (`secret_forms`),
    and every run of _PIECE_CHARS characters of each."""

    whole: tuple[str, ...] = ()
    runs: frozenset[str] = frozenset()

    @classmethod
    def of(cls, forms: Sequence[bytes]) -> SecretPieces:
        texts = tuple(form.decode("utf-8", "replace") for form in forms)
        runs = {
            text[start : start + _PIECE_CHARS]
            for text in texts
            for start in range(len(text) - _PIECE_CHARS + 1)
        }
        return cls(whole=texts, runs=frozenset(runs))

    def scrub(self, text: str) -> str:
        """`text` with each token form, and each run made of pieces of one, as `***`."""
        for form in self.whole:
            text = text.replace(form, "***")
        size = _PIECE_CHARS
        start = 0
        while start + size <= len(text):
            if text[start : start + size] not in self.runs:
                start += 1
                continue
            end = start + size
            while end < len(text) and text[end - size + 1 : end + 1] in self.runs:
                end += 1
            text = text[:start] + "***" + text[end:]
            start += 3
        return text


def scrubbed(outcome: _Scrubbable, secrets: SecretPieces) -> _Scrubbable:
    """The outcome with its error text scrubbed of every piece of a token (the last guard
    before the text reaches last_error and logs)."""
    error = getattr(outcome, "error", None)
    if not error or not secrets.whole:
        return outcome
    clean = secrets.scrub(error)
    if clean == error:
        return outcome
    changed: _Scrubbable = dataclasses.replace(cast(Any, outcome), error=clean)
    return changed
