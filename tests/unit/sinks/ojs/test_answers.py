"""The OJS answer -> outcome tables (docs/ojs.md#outcomes) for POST, GET and batch answers,
and the comparison by meaning after a GET (docs/contract.md#c2)."""

from __future__ import annotations

import json
import random
import string
import sys
from decimal import Decimal
from typing import Any

import pytest

from relayd.core.envelope import Envelope
from relayd.core.jsonvalue import equal as json_equal
from relayd.core.outcomes import DeadLetter, DeadReason, NotFound, Published, RetryLater, SinkDown
from relayd.core.rows import ClaimedRow
from relayd.sinks.http.answers import Response
from relayd.sinks.ojs.answers import (
    BatchAccepted,
    BatchDrop,
    BatchFailed,
    BatchNotServed,
    BatchSplit,
    BatchVerdict,
    Reconcile,
    SecretPieces,
    chunk_batches,
    classify_batch,
    classify_get,
    classify_post,
    differences,
    parse_error,
    redact,
    secret_forms,
)
from tests.support import claimed

ID = "019539a4-aaaa-7000-8000-111111111111"
OTHER = "019539a4-bbbb-7000-8000-222222222222"


def _answer(status: int, body: Any = None, retry_after: str | None = None) -> Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body else b""
    return Response(status=status, body=raw, retry_after=retry_after)


def _err(code: str, **details: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": "m", "retryable": False, "details": details}}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (_answer(201, {"job": {"id": ID, "state": "available"}}), Published("available")),
        (_answer(200, {"job": {"id": ID, "state": "scheduled"}}), Published("scheduled")),
        (
            _answer(200, {"job": {"id": OTHER, "state": "available"}}),
            Published("deduplicated", sink_job_id=OTHER),
        ),
        (_answer(201, b"<html>ok</html>"), RetryLater("HTTP 201 with an unreadable body")),
        # Unusual shapes: extra or null fields (the typed decode takes them), and shapes it
        # refuses (read leniently): the verdicts match what the lenient reading gives.
        (_answer(201, {"job": {"id": ID}, "extra": [1]}), Published("accepted")),
        (_answer(201, {"job": {"id": ID, "state": None}}), Published("accepted")),
        (_answer(201, {"job": {"id": ID, "state": 7}}), Published("7")),
        (
            _answer(201, {"job": {"id": 5, "state": "available"}}),
            RetryLater("HTTP 201 with an unreadable body"),
        ),
        (_answer(201, {"job": None}), RetryLater("HTTP 201 with an unreadable body")),
        (_answer(201, [{"job": {"id": ID}}]), RetryLater("HTTP 201 with an unreadable body")),
        (
            _answer(400, _err("invalid_request")),
            DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400: invalid_request: m"),
        ),
        (
            _answer(413, _err("invalid_request")),
            DeadLetter(DeadReason.SINK_TOO_LARGE, "HTTP 413: invalid_request: m"),
        ),
        (
            _answer(422, _err("validation_error")),
            DeadLetter(DeadReason.SINK_UNPROCESSABLE, "HTTP 422: validation_error: m"),
        ),
        (_answer(409, _err("duplicate")), Reconcile("HTTP 409: duplicate: m")),
        (
            _answer(409, _err("duplicate", existing_job_id=OTHER)),
            Reconcile("HTTP 409: duplicate: m", OTHER),
        ),
        (_answer(409, _err("conflict")), Reconcile("HTTP 409: conflict: m")),
        (_answer(409, _err("queue_paused"), "5"), RetryLater("HTTP 409: queue_paused: m", 5.0)),
        (_answer(422, _err("queue_paused")), RetryLater("HTTP 422: queue_paused: m")),
        (
            _answer(401, _err("unauthorized")),
            SinkDown("HTTP 401: unauthorized: m (check sink.token_file)", severe=True),
        ),
        (_answer(403, b""), SinkDown("HTTP 403 (check sink.token_file)", severe=True)),
        (_answer(404, b"not found"), SinkDown("HTTP 404 (check sink.url)", severe=True)),
        (_answer(302, b""), SinkDown("HTTP 302 (check sink.url)", severe=True)),
        (
            _answer(429, _err("rate_limited"), "7"),
            SinkDown("HTTP 429: rate_limited: m", retry_after_s=7.0),
        ),
        (_answer(500, _err("internal_error")), SinkDown("HTTP 500: internal_error: m")),
        (_answer(503, b"upstream down"), SinkDown("HTTP 503")),
        (_answer(418, b""), SinkDown("HTTP 418, not an OJS error body")),
        (_answer(418, _err("teapot")), RetryLater("HTTP 418: teapot: m")),
    ],
)
def test_classify_post(answer: Response, expected: object) -> None:
    """Every POST answer maps to exactly one outcome; a 409 alone proves nothing (C2)."""
    assert classify_post(answer, ID) == expected


def _envelope(**job: Any) -> Envelope:
    base: dict[str, Any] = {"id": ID, "type": "order.fulfill", "args": [{"order_id": 42}]}
    base.update(job)
    return Envelope.parse(json.dumps(base), ID)


def test_get_match_is_published_as_reconciled() -> None:
    """A GET showing our job (reformatted by the server) proves delivery."""
    envelope = _envelope(meta={"trace_id": "t"}, options={"queue": "orders", "priority": 5})
    job = {
        "id": ID,
        "type": "order.fulfill",
        "state": "completed",
        "queue": "orders",
        "args": [{"order_id": 42.0}],
        "meta": {"trace_id": "t", "added_by_server": 1},
        "priority": 5,
        "created_at": "2026-01-01T00:00:00.000Z",
    }
    assert classify_get(_answer(200, {"job": job}), envelope) == Published(
        "completed", reconciled=True
    )


def test_get_mismatch_is_a_conflict() -> None:
    """Another job under our id is dead-lettered as a conflict, never published (C2)."""
    envelope = _envelope()
    job = {"id": ID, "type": "order.fulfill", "queue": "default", "args": [{"order_id": 43}]}
    outcome = classify_get(_answer(200, {"job": job}), envelope)
    assert isinstance(outcome, DeadLetter)
    assert outcome.reason is DeadReason.CONFLICT
    assert "args" in outcome.error


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (_answer(404, _err("not_found")), NotFound()),
        (_answer(200, b"garbage"), RetryLater("GET: HTTP 200 with an unreadable body")),
        (_answer(503, b""), SinkDown("GET: HTTP 503")),
        (_answer(403, b""), SinkDown("GET: HTTP 403 (check sink.token_file)", severe=True)),
        (
            _answer(405, _err("method_not_allowed")),
            RetryLater("GET: HTTP 405: method_not_allowed: m"),
        ),
        (_answer(405, b""), SinkDown("GET: HTTP 405, not an OJS error body")),
    ],
)
def test_classify_get_failures(answer: Response, expected: object) -> None:
    """404 means "not there, POST"; a 404 on GET is not a configuration error."""
    assert classify_get(answer, _envelope()) == expected


@pytest.mark.parametrize(
    ("job", "diff"),
    [
        ({}, []),
        ({"queue": "other"}, ["queue"]),
        ({"type": "order.cancel"}, ["type"]),
        ({"args": [{"order_id": "42"}]}, ["args"]),
        ({"args": [{"order_id": True}]}, ["args"]),
        ({"meta": {}}, ["meta"]),
        ({"priority": 0}, ["priority"]),
    ],
)
def test_differences_compares_by_meaning(job: dict[str, Any], diff: list[str]) -> None:
    """id/type exact, effective queue, args by JSON value, only sent meta keys, priority."""
    envelope = _envelope(meta={"k": [1, 2]}, options={"queue": "q1", "priority": 3})
    sink_job = {
        "id": ID,
        "type": "order.fulfill",
        "queue": "q1",
        "args": [{"order_id": 42}],
        "meta": {"k": [1.0, 2]},
        "priority": 3,
    }
    assert differences(envelope, sink_job | job) == diff


def test_top_level_queue_is_the_effective_queue_without_options() -> None:
    """An envelope routed by a top-level queue (the gateway variant) has that queue."""
    envelope = _envelope(queue="gateway-jobs")
    assert envelope.queue == "gateway-jobs"
    job = {"id": ID, "type": "order.fulfill", "queue": "gateway-jobs", "args": [{"order_id": 42}]}
    assert differences(envelope, job) == []
    assert differences(envelope, job | {"queue": None}) == ["queue"]


def test_json_equal_keeps_booleans_apart_from_numbers() -> None:
    """1 == 1.0 in JSON, but true is not 1 and "1" is not 1."""
    assert json_equal({"a": [1, 2.5]}, {"a": [1.0, 2.5]})
    assert not json_equal(True, 1)
    assert not json_equal("1", 1)
    assert not json_equal(None, {})
    assert not json_equal([1], [1, 1])
    assert json_equal(Decimal("1" * 5000), Decimal("1" * 5000))
    assert json_equal(Decimal(2), 2.0)
    assert not json_equal(Decimal("1" * 5000), Decimal("1" * 4999 + "2"))


def test_comparison_of_deep_values_uses_no_recursion() -> None:
    """C2/C6: comparing a 250-level job after a GET, with the interpreter's recursion limit
    far below what a recursive compare would need, neither raises nor loses precision."""
    deep = json.loads("[" * 250 + '{"k": 1}' + "]" * 250)
    envelope = _envelope(args=deep)
    job = {"id": ID, "type": "order.fulfill", "queue": "default", "args": deep}
    other = json.loads("[" * 250 + '{"k": 2}' + "]" * 250)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(120)  # a recursive compare needs two frames per level
    try:
        assert differences(envelope, job) == []
        assert differences(envelope, job | {"args": other}) == ["args"]
    finally:
        sys.setrecursionlimit(limit)


def test_a_deep_answer_is_unreadable_not_a_crash() -> None:
    """A sink answer nested deeper than relayd reads is 'unreadable', never RecursionError."""
    body = b'{"job": {"id": "' + ID.encode() + b'", "args": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    assert classify_post(_answer(201, body), ID) == RetryLater("HTTP 201 with an unreadable body")
    envelope = _envelope()
    assert classify_get(_answer(200, body), envelope) == RetryLater(
        "GET: HTTP 200 with an unreadable body"
    )


@pytest.mark.parametrize("header", ["\u00b2", "\u0663", "1e9", "Thu, 99 Foo", "\x00"])
@pytest.mark.parametrize("status", [201, 429, 503, 409])
def test_no_retry_after_value_raises(header: str, status: int) -> None:
    """Whatever Retry-After holds, classification returns an outcome (C6: no header can
    crash a worker), and a 201 carrying it is still a publish."""
    body = {"job": {"id": ID, "state": "available"}} if status == 201 else _err("x")
    outcome = classify_post(_answer(status, body, retry_after=header), ID)
    if status == 201:
        assert outcome == Published("available")
    assert getattr(outcome, "retry_after_s", None) is None


def test_the_token_is_redacted_in_every_form_a_sink_may_echo_it() -> None:
    """An error body echoing the bearer token (raw, JSON-escaped, Go-escaped) loses it."""
    token = "tok/en<&>\u00e9-123"  # noqa: S105 - a test value, not a credential
    forms = secret_forms(token)
    echoed = [
        f"Bearer {token}".encode(),
        json.dumps({"error": {"message": f"bad token {token}"}}).encode(),
        json.dumps({"message": token}, ensure_ascii=False).encode(),
        json.dumps({"message": token}).replace("/", "\\/").encode(),
        json.dumps({"message": token})
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .encode(),
    ]
    for body in echoed:
        cleaned = redact(body, forms)
        assert b"***" in cleaned
        text = json.dumps(parse_error(cleaned).message or "") + cleaned.decode()
        assert token not in text
        assert "en<&>" not in text


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b'{"error": {"code": "duplicate", "message": "dup"}}', "duplicate", "dup"),
        (b'{"code": "DUPLICATE_JOB", "message": "dup"}', "duplicate", "dup"),
        (b'{"error": "PayloadTooLarge", "message": "big"}', "payloadtoolarge", "big"),
        (b"not json", None, None),
        (b'["x"]', None, None),
    ],
)
def test_parse_error_is_lenient(body: bytes, code: str | None, message: str | None) -> None:
    """Wrapped, unwrapped and string-coded error bodies all parse (docs/ojs.md#error-bodies)."""
    error = parse_error(body)
    assert (error.code, error.message) == (code, message)


def test_plan_batches_bounds_jobs_and_bytes() -> None:
    """Batches hold at most max_jobs jobs and max_bytes bytes, in claim order."""
    rows = [claimed(job_bytes=100) for _ in range(25)]
    batches = chunk_batches(rows, max_jobs=10, max_bytes=10_000)
    assert [len(b) for b in batches] == [10, 10, 5]
    batches = chunk_batches(rows, max_jobs=100, max_bytes=1_000)
    assert all(sum(len(r.job) + 1 for r in b) + 11 <= 1_000 for b in batches)
    assert [r for b in batches for r in b] == rows


BATCH = [claimed() for _ in range(4)]
NOT_LISTED = "the batch was accepted but its answer does not list this id"


def _listed(*rows: ClaimedRow, state: str = "available") -> dict[str, Any]:
    return {"jobs": [{"id": row.event_id, "state": state} for row in rows], "count": len(rows)}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            _answer(201, _listed(*BATCH)),
            BatchAccepted({row.event_id: Published("available") for row in BATCH}),
        ),
        (
            # An answer that leaves a row out proves nothing about that row.
            _answer(201, _listed(*BATCH[:3], state="scheduled")),
            BatchAccepted(
                {row.event_id: Published("scheduled") for row in BATCH[:3]}
                | {BATCH[3].event_id: RetryLater(NOT_LISTED)}
            ),
        ),
        (
            _answer(201, b"<html>ok</html>"),
            BatchAccepted({row.event_id: RetryLater(NOT_LISTED) for row in BATCH}),
        ),
        (
            _answer(400, _err("invalid_request", index=2)),
            BatchDrop(2, DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400: invalid_request: m")),
        ),
        (
            _answer(422, _err("validation_error", index=0)),
            BatchDrop(
                0, DeadLetter(DeadReason.SINK_UNPROCESSABLE, "HTTP 422: validation_error: m")
            ),
        ),
        (_answer(400, _err("invalid_request", index=4)), BatchSplit()),  # not an item of ours
        (_answer(400, _err("invalid_request", index=True)), BatchSplit()),  # not an index
        (_answer(400, _err("invalid_request")), BatchSplit()),
        (_answer(413, _err("invalid_request")), BatchSplit()),
        (_answer(413, b"<html>too big</html>"), BatchSplit()),  # a proxy's bound: halves fit
        (_answer(404, _err("not_found")), BatchNotServed()),
        (_answer(405, b""), BatchNotServed()),
        (
            _answer(503, _err("backend_error"), retry_after="3"),
            BatchFailed(SinkDown("HTTP 503: backend_error: m", retry_after_s=3.0)),
        ),
        (
            _answer(403, _err("forbidden")),
            BatchFailed(SinkDown("HTTP 403: forbidden: m (check sink.token_file)", severe=True)),
        ),
        (
            # A 409 on a batch (a unique reject part-way): every row is reconciled next time.
            _answer(409, _err("duplicate", index=1)),
            BatchFailed(RetryLater("HTTP 409: duplicate: m")),
        ),
        (
            _answer(409, _err("queue_paused"), retry_after="5"),
            BatchFailed(RetryLater("HTTP 409: queue_paused: m", 5.0)),
        ),
    ],
)
def test_classify_batch(answer: Response, expected: BatchVerdict) -> None:
    """Each batch answer maps to one verdict: accepted, drop item i, split, not served, or
    failed (every row ambiguous)."""
    assert classify_batch(answer, BATCH) == expected


# --- whose verdict a 4xx is -----------------------------------------------------------

# What aiohttp's HTTP layer answers a request whose header is over its 8190-byte bound: the
# request's fault, said before any OJS handler ran.
_LINE_TOO_LONG = (
    b"400, message:\n  Got more than 8190 bytes when reading: b'Bearer xxxxxxxxxxxxxxxx...'."
)
_NGINX_400 = (
    b"<html>\r\n<head><title>400 Bad Request</title></head>\r\n<body>\r\n<center><h1>400 Bad "
    b"Request</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)
_NGINX_413 = _NGINX_400.replace(b"400 Bad Request", b"413 Request Entity Too Large")
# JSON that is not an OJS error: an API gateway's, a Java framework's (whose "error" is a
# reason phrase, not a code), a numeric code, a code without a message, an empty object.
_NOT_OJS_JSON = [
    {"message": "Bad Request"},
    {"timestamp": "2026-01-01T00:00:00Z", "status": 400, "error": "Bad Request", "path": "/"},
    {"code": 400, "message": "Bad Request"},
    {"error": {"code": "invalid_request"}},
    {"error": {"message": "no code"}},
]


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            _answer(400, _LINE_TOO_LONG),
            SinkDown(
                "HTTP 400, not an OJS error body: 400, message: Got more than 8190 bytes when "
                "reading: b'Bearer xxxxxxxxxxxxxxxx...'."
            ),
        ),
        (
            _answer(400, _NGINX_400),
            SinkDown("HTTP 400, not an OJS error body: 400 Bad Request 400 Bad Request nginx"),
        ),
        (
            _answer(413, _NGINX_413),
            SinkDown(
                "HTTP 413, not an OJS error body: 413 Request Entity Too Large 413 Request "
                "Entity Too Large nginx"
            ),
        ),
        (
            _answer(422, b"unprocessable"),
            SinkDown("HTTP 422, not an OJS error body: unprocessable"),
        ),
        (_answer(400, b""), SinkDown("HTTP 400, not an OJS error body")),
        (
            _answer(431, b"Request Header Fields Too Large"),
            SinkDown(
                "HTTP 431, not an OJS error body: Request Header Fields Too Large (check "
                "sink.token_file: headers too large)",
                severe=True,
            ),
        ),
        (
            _answer(431, _err("invalid_request")),
            SinkDown(
                "HTTP 431: invalid_request: m (check sink.token_file: headers too large)",
                severe=True,
            ),
        ),
        (
            _answer(451, b"\x1b]52;c;aGk=\x07blocked"),
            SinkDown("HTTP 451, not an OJS error body: ]52;c;aGk= blocked"),
        ),
        *[
            (_answer(400, body), SinkDown(f"HTTP 400, not an OJS error body: {json.dumps(body)}"))
            for body in _NOT_OJS_JSON
        ],
        # The sink's own verdicts, in each shape docs/ojs.md#error-bodies lists.
        (
            _answer(400, _err("invalid_request", field="args")),
            DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400: invalid_request: m"),
        ),
        (
            _answer(400, {"code": "SCHEMA_VALIDATION", "message": "args: not an array"}),
            DeadLetter(DeadReason.SINK_REJECTED, "HTTP 400: schema_validation: args: not an array"),
        ),
        (
            _answer(413, {"error": "PayloadTooLarge", "message": "args over 1 MiB"}),
            DeadLetter(DeadReason.SINK_TOO_LARGE, "HTTP 413: payloadtoolarge: args over 1 MiB"),
        ),
        (
            _answer(422, _err("x_tenant_quota")),
            DeadLetter(DeadReason.SINK_UNPROCESSABLE, "HTTP 422: x_tenant_quota: m"),
        ),
    ],
)
def test_a_4xx_is_the_rows_fault_only_in_the_sinks_own_error_format(
    answer: Response, expected: object
) -> None:
    """A 400/413/422 dead-letters the row only with an OJS error body (a code and a
    message); plain text, HTML, other JSON and 431 are sink-wide, for the breaker, with a
    short one-line excerpt."""
    assert classify_post(answer, ID) == expected


@pytest.mark.parametrize("body", [_LINE_TOO_LONG, _NGINX_400, b"", *map(json.dumps, _NOT_OJS_JSON)])
def test_a_get_refused_by_an_http_layer_is_sink_wide(body: str | bytes) -> None:
    """The GET that opens a re-attempt meets the same refusal: sink-wide, not a row-level
    retry that uses up the row's attempts and tells the breaker the sink is fine."""
    raw = body.encode() if isinstance(body, str) else body
    outcome = classify_get(_answer(400, raw), _envelope())
    assert isinstance(outcome, SinkDown)
    assert outcome.error.startswith("GET: HTTP 400, not an OJS error body")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            _answer(400, _LINE_TOO_LONG),
            BatchFailed(
                SinkDown(
                    "HTTP 400, not an OJS error body: 400, message: Got more than 8190 bytes "
                    "when reading: b'Bearer xxxxxxxxxxxxxxxx...'."
                )
            ),
        ),
        (
            _answer(422, _NGINX_400),
            BatchFailed(
                SinkDown("HTTP 422, not an OJS error body: 400 Bad Request 400 Bad Request nginx")
            ),
        ),
        (
            # An "index" outside an OJS error is not an item named by the sink.
            _answer(400, {"message": "Bad Request", "details": {"index": 1}}),
            BatchFailed(
                SinkDown(
                    'HTTP 400, not an OJS error body: {"message": "Bad Request", "details": '
                    '{"index": 1}}'
                )
            ),
        ),
        (
            _answer(431, b""),
            BatchFailed(
                SinkDown(
                    "HTTP 431, not an OJS error body (check sink.token_file: headers too large)",
                    severe=True,
                )
            ),
        ),
        (_answer(413, _NGINX_413), BatchSplit()),
    ],
)
def test_a_batch_refused_by_an_http_layer_is_neither_dropped_nor_split(
    answer: Response, expected: BatchVerdict
) -> None:
    """A batch 400/422 without an OJS body drops no item and is not split to find a poison
    item: every row gets the sink-wide outcome. A 413 is about size whoever says it: halves."""
    assert classify_batch(answer, BATCH) == expected


def test_a_truncated_echo_of_the_token_is_scrubbed() -> None:
    """An HTTP layer that echoes the start of an oversized header (aiohttp shows about 100
    characters of it) leaves no run of 8 characters of the token in the text; a token
    shorter than that goes whole."""
    rng = random.Random(17)
    token = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(16384))
    pieces = SecretPieces.of(secret_forms(token))
    echoed = f"HTTP 400, not an OJS error body: Got more than 8190 bytes: b'Bearer {token[:93]}..."
    clean = pieces.scrub(echoed)
    assert clean == "HTTP 400, not an OJS error body: Got more than 8190 bytes: b'Bearer ***..."
    assert not any(token[i : i + 8] in clean for i in range(len(token) - 7))
    tail = f"the end of it: {token[-40:]}; the middle: {token[5000:5030]}."
    assert pieces.scrub(tail) == "the end of it: ***; the middle: ***."
    short = SecretPieces.of(secret_forms("k3y"))
    assert short.scrub("bad key k3y") == "bad key ***"
    assert SecretPieces.of(()).scrub("nothing to hide") == "nothing to hide"
