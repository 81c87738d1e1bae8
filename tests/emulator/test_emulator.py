"""The OJS emulator over real loopback HTTP: wire rules, every switch, every fault, the ledger."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from relayd.config import parse_listen
from relayd.testing.emulator import (
    UUIDV7_PATTERN,
    Emulator,
    EmulatorConfig,
    config_from_options,
    uuid7,
)
from relayd.testing.faults import FaultRule
from tests.support import StartEmulator

MEDIA = "application/openjobspec+json"
JOBS = "/ojs/v1/jobs"
BATCH = "/ojs/v1/jobs/batch"
REPO_ROOT = Path(__file__).resolve().parents[2]
_UNSET: Any = object()
# What an aiohttp client raises when the server closes the socket without answering.
DISCONNECTED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


@dataclass
class Answer:
    status: int
    headers: Mapping[str, str]
    body: Any
    text: str


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = _UNSET,
    *,
    headers: Mapping[str, str] | None = None,
    data: Any = None,
    timeout_s: float | None = None,
) -> Answer:
    """One request; the body is sent as OJS JSON unless raw `data` is given."""
    sent_headers = dict(headers or {})
    if body is not _UNSET:
        data = json.dumps(body)
        sent_headers.setdefault("Content-Type", MEDIA)
    timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
    # Without this aiohttp would label raw data application/octet-stream.
    skip = () if "Content-Type" in sent_headers else ("Content-Type",)
    async with http.request(
        method, url, data=data, headers=sent_headers, timeout=timeout, skip_auto_headers=skip
    ) as response:
        text = await response.text()
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = None
        return Answer(response.status, CIMultiDict(response.headers), parsed, text)


def job(queue: str | None = None, **extra: Any) -> dict[str, Any]:
    """A valid enqueue request with a fresh client id."""
    body: dict[str, Any] = {"id": uuid7(), "type": "test.echo", "args": [{"n": 1}]}
    if queue is not None:
        body["options"] = {"queue": queue}
    body.update(extra)
    return body


# --- wire basics -------------------------------------------------------------------------


async def test_enqueue_answers_201_with_ojs_headers(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A valid POST is 201 {"job"} with the OJS media type, OJS-Version, a req_ id, Location."""
    running = await start()
    sent = job(meta={"trace_id": "t1"})
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.status == 201
    assert answer.headers["Content-Type"] == MEDIA
    assert answer.headers["OJS-Version"] == "1.0"
    assert answer.headers["X-Request-Id"].startswith("req_")
    assert answer.headers["Location"] == f"{JOBS}/{sent['id']}"
    stored = answer.body["job"]
    assert stored["id"] == sent["id"]
    assert (stored["state"], stored["queue"], stored["attempt"]) == ("available", "default", 0)
    assert stored["meta"] == {"trace_id": "t1"}
    assert stored["created_at"].endswith("Z")
    assert len(stored["created_at"]) == len("2026-01-01T00:00:00.000Z")


async def test_request_id_is_echoed_also_in_errors(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """X-Request-Id comes back in the header and as error.request_id."""
    running = await start()
    answer = await call(
        http, "GET", f"{running.url}{JOBS}/{uuid7()}", headers={"X-Request-Id": "rid-42"}
    )
    assert answer.status == 404
    assert answer.headers["X-Request-Id"] == "rid-42"
    assert answer.body["error"]["request_id"] == "rid-42"
    assert answer.body["error"]["code"] == "not_found"
    assert answer.body["error"]["retryable"] is False


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (MEDIA, 201),
        ("application/json", 201),
        ("application/openjobspec+json; charset=utf-8", 201),
        ("application/json;charset=UTF-8", 201),
        (None, 201),
        ("text/plain", 400),
        ("application/x-www-form-urlencoded", 400),
    ],
)
async def test_content_type_rules(
    start: StartEmulator, http: aiohttp.ClientSession, content_type: str | None, status: int
) -> None:
    """POST accepts the OJS type or JSON (any charset) or none; anything else is 400."""
    running = await start()
    headers = {} if content_type is None else {"Content-Type": content_type}
    answer = await call(
        http, "POST", running.url + JOBS, headers=headers, data=json.dumps(job()).encode()
    )
    assert answer.status == status
    if status == 400:
        assert answer.body["error"]["code"] == "invalid_request"
        assert "Content-Type" in answer.body["error"]["message"]


@pytest.mark.parametrize(
    ("change", "status", "code"),
    [
        ({"type": "Email.Send"}, 400, "invalid_request"),
        ({"type": "x" * 256}, 400, "invalid_request"),
        ({"type": None}, 400, "invalid_request"),
        ({"args": {"a": 1}}, 400, "invalid_request"),
        ({"args": None}, 400, "invalid_request"),
        ({"id": "019461A8-1A2B-7C3D-8E4F-5A6B7C8D9E0F"}, 400, "invalid_request"),
        ({"id": "550e8400-e29b-41d4-a716-446655440000"}, 400, "invalid_request"),
        ({"id": ""}, 400, "invalid_request"),
        ({"meta": ["not", "an", "object"]}, 400, "invalid_request"),
        ({"options": {"queue": "Bad Queue"}}, 400, "invalid_request"),
        ({"options": {"queue": "q" * 129}}, 400, "invalid_request"),
        ({"options": {"priority": 101}}, 400, "invalid_request"),
        ({"options": {"priority": -101}}, 400, "invalid_request"),
        ({"options": {"priority": 1.5}}, 400, "invalid_request"),
        ({"options": {"delay_until": "2030-01-01T00:00:00"}}, 400, "invalid_request"),
        ({"options": {"retry": {"max_attempts": -1}}}, 422, "validation_error"),
        ({"options": {"retry": {"backoff_coefficient": 0.5}}}, 422, "validation_error"),
        ({"options": {"retry": {"initial_interval": "1s"}}}, 400, "invalid_request"),
    ],
)
async def test_envelope_validation(
    start: StartEmulator,
    http: aiohttp.ClientSession,
    change: dict[str, Any],
    status: int,
    code: str,
) -> None:
    """Each enqueue-request rule rejects with its status and code, retryable false, none stored."""
    running = await start()
    sent = {**job(), **change}
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.status == status
    assert answer.body["error"]["code"] == code
    assert answer.body["error"]["retryable"] is False
    assert all(entry.created == 0 for entry in running.emulator.ledger().values())


async def test_malformed_json_is_invalid_request(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A body that is not JSON is 400 invalid_request (the code the servers use)."""
    running = await start()
    answer = await call(
        http, "POST", running.url + JOBS, headers={"Content-Type": MEDIA}, data=b"{ nope }"
    )
    assert (answer.status, answer.body["error"]["code"]) == (400, "invalid_request")


async def test_server_assigns_uuidv7_when_id_absent(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Without a client id the server generates a lowercase UUIDv7."""
    running = await start()
    answer = await call(http, "POST", running.url + JOBS, {"type": "a.b", "args": []})
    assert answer.status == 201
    assert UUIDV7_PATTERN.match(answer.body["job"]["id"])


async def test_unknown_fields_echoed_and_system_fields_ignored(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Unknown top-level fields are kept and echoed; client-sent state/attempt are ignored."""
    running = await start()
    sent = job(x_custom={"deep": [1]}, state="completed", attempt=9)
    created = await call(http, "POST", running.url + JOBS, sent)
    fetched = await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    for answer in (created, fetched):
        assert answer.body["job"]["x_custom"] == {"deep": [1]}
        assert answer.body["job"]["state"] == "available"
        assert answer.body["job"]["attempt"] == 0


# --- duplicate modes ---------------------------------------------------------------------


async def test_spec409_rejects_reused_id_and_keeps_the_stored_job(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """spec409: a reused id is 409 duplicate, retryable false; the first job is untouched."""
    running = await start(EmulatorConfig(duplicate_mode="spec409"))
    first = job()
    assert (await call(http, "POST", running.url + JOBS, first)).status == 201
    second = {**first, "args": ["different"]}
    answer = await call(http, "POST", running.url + JOBS, second)
    assert answer.status == 409
    assert answer.body["error"]["code"] == "duplicate"
    assert answer.body["error"]["retryable"] is False
    stored = await call(http, "GET", f"{running.url}{JOBS}/{first['id']}")
    assert stored.body["job"]["args"] == first["args"]
    entry = running.emulator.ledger()[first["id"]]
    assert (entry.created, entry.posts, entry.post_statuses) == (1, 2, (201, 409))


async def test_gateway_reuse_in_another_queue_is_500(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Gateway variant: same id, same queue → 409; same id, another queue → 500 internal_error."""
    running = await start(EmulatorConfig.gateway_variant())
    first: dict[str, Any] = {
        "id": uuid7(),
        "type": "order.fulfill",
        "args": [{"order_id": 42}],
        "queue": "gateway",
    }
    assert (await call(http, "POST", running.url + JOBS, first)).status == 201
    same_queue = await call(http, "POST", running.url + JOBS, first)
    assert (same_queue.status, same_queue.body["error"]["code"]) == (409, "duplicate")
    moved = await call(http, "POST", running.url + JOBS, {**first, "queue": "elsewhere"})
    assert moved.status == 500
    assert moved.body["error"] == {
        "code": "internal_error",
        "message": "an internal error occurred",
        "retryable": True,
        "request_id": moved.headers["X-Request-Id"],
    }
    assert running.emulator.ledger()[first["id"]].created == 1


async def test_overwrite_replaces_and_resets_the_job(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """overwrite: a reused id silently replaces the job, back to available, attempt 0, 201."""
    running = await start(EmulatorConfig(duplicate_mode="overwrite"))
    first = job()
    await call(http, "POST", running.url + JOBS, first)
    fetched = await call(
        http, "POST", running.url + "/ojs/v1/workers/fetch", {"queues": ["default"]}
    )
    assert fetched.body["jobs"][0]["attempt"] == 1
    again = await call(http, "POST", running.url + JOBS, {**first, "args": ["new"]})
    assert again.status == 201
    assert (again.body["job"]["state"], again.body["job"]["attempt"]) == ("available", 0)
    assert again.body["job"]["args"] == ["new"]
    entry = running.emulator.ledger()[first["id"]]
    assert (entry.created, entry.overwrites, entry.deliveries) == (2, 1, 1)


async def test_pk500_answers_retryable_internal_error(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """pk500: a reused id is 500 internal_error retryable true (postgres), job untouched."""
    running = await start(EmulatorConfig(duplicate_mode="pk500"))
    first = job()
    await call(http, "POST", running.url + JOBS, first)
    answer = await call(http, "POST", running.url + JOBS, {**first, "args": []})
    assert answer.status == 500
    assert (answer.body["error"]["code"], answer.body["error"]["retryable"]) == (
        "internal_error",
        True,
    )
    assert running.emulator.ledger()[first["id"]].job["args"] == first["args"]  # type: ignore[index]


# --- queue source ------------------------------------------------------------------------


async def test_queue_source_options_ignores_top_level_queue(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """options: a top-level queue is only echoed (shadowing GET's queue); the job is in default."""
    running = await start(EmulatorConfig(queue_source="options"))
    sent = {**job(), "queue": "gateway-jobs"}
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.body["job"]["queue"] == "gateway-jobs"  # the reference MarshalJSON trap
    assert running.emulator.ledger()[sent["id"]].queue == "default"
    other = await call(
        http, "POST", running.url + "/ojs/v1/workers/fetch", {"queues": ["gateway-jobs"]}
    )
    assert other.body["jobs"] == []
    default = await call(
        http, "POST", running.url + "/ojs/v1/workers/fetch", {"queues": ["default"]}
    )
    assert default.body["jobs"][0]["id"] == sent["id"]


async def test_queue_source_top_level_reads_top_level_queue(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """top_level: the job goes to the top-level queue, options.queue is ignored."""
    running = await start(EmulatorConfig(queue_source="top_level"))
    sent = {**job(queue="ignored"), "queue": "gateway-jobs"}
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.body["job"]["queue"] == "gateway-jobs"
    assert running.emulator.ledger()[sent["id"]].queue == "gateway-jobs"
    bad = await call(http, "POST", running.url + JOBS, {**job(), "queue": "Bad!"})
    assert bad.status == 400


async def test_queue_source_either_prefers_options(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """either: options.queue wins, else the top-level queue, else default."""
    running = await start(EmulatorConfig(queue_source="either"))
    both = {**job(queue="from-options"), "queue": "from-top"}
    top_only = {**job(), "queue": "from-top"}
    neither = job()
    for sent in (both, top_only, neither):
        assert (await call(http, "POST", running.url + JOBS, sent)).status == 201
    ledger = running.emulator.ledger()
    assert [ledger[s["id"]].queue for s in (both, top_only, neither)] == [
        "from-options",
        "from-top",
        "default",
    ]


# --- batch -------------------------------------------------------------------------------


async def test_batch_stores_all_in_request_order(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A valid batch is 201 {"jobs", "count"} in request order; each id counted as a post."""
    running = await start()
    items = [job(queue="bulk") for _ in range(5)]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert answer.status == 201
    assert answer.body["count"] == 5
    assert [j["id"] for j in answer.body["jobs"]] == [i["id"] for i in items]
    stats = await call(http, "GET", running.url + "/ojs/v1/queues/bulk/stats")
    assert stats.body["queue"]["available"] == 5
    assert all(
        e.created == 1 and e.post_statuses == (201,) for e in running.emulator.ledger().values()
    )


async def test_batch_invalid_item_names_its_index_and_stores_nothing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """The first invalid item → 400 invalid_request, "…job at index i: …", details.index."""
    running = await start(EmulatorConfig(batch_atomic=False))
    items = [job(), job(), {"id": uuid7(), "args": []}, {"type": "Bad", "args": []}]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert answer.status == 400
    error = answer.body["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("Batch validation failed: job at index 2: ")
    assert error["details"]["index"] == 2
    assert all(e.created == 0 for e in running.emulator.ledger().values())


async def test_atomic_batch_with_a_duplicate_stores_nothing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic: a reused id anywhere fails the batch before anything is stored."""
    running = await start(EmulatorConfig(batch_atomic=True))
    taken = job()
    await call(http, "POST", running.url + JOBS, taken)
    items = [job(), job(), {**taken, "args": ["again"]}]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (409, "duplicate")
    assert answer.body["error"]["details"] == {"index": 2}
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [0, 0, 1]


async def test_non_atomic_batch_keeps_items_before_the_failure(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic=False: items before a failing one stay stored, later ones are not."""
    running = await start(EmulatorConfig(batch_atomic=False, duplicate_mode="pk500"))
    taken = job()
    await call(http, "POST", running.url + JOBS, taken)
    items = [job(), taken, job()]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (500, "internal_error")
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [1, 1, 0]
    assert ledger[items[0]["id"]].post_statuses == (500,)


@pytest.mark.parametrize(
    ("options", "status", "code"),
    [
        ({"priority": 101}, 400, "invalid_request"),
        ({"queue": "Not A Queue"}, 400, "invalid_request"),
        ({"retry": {"max_attempts": -1}}, 422, "validation_error"),
    ],
    ids=["priority", "queue", "retry"],
)
async def test_non_atomic_batch_stores_items_before_an_invalid_one(
    start: StartEmulator,
    http: aiohttp.ClientSession,
    options: dict[str, Any],
    status: int,
    code: str,
) -> None:
    """batch_atomic=False: item k failing validation answers its own status; 0..k-1 stay."""
    running = await start(EmulatorConfig(batch_atomic=False))
    items = [job(), job(), job(options=options), job()]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (status, code)
    error = answer.body["error"]
    assert error["message"].startswith("Batch validation failed: job at index 2: ")
    assert (error["details"]["index"], error["retryable"]) == (2, False)
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [1, 1, 0, 0]
    assert [ledger[i["id"]].post_statuses for i in items] == [(status,)] * 4
    stored = await call(http, "GET", f"{running.url}{JOBS}/{items[1]['id']}")
    assert (stored.status, stored.body["job"]["state"]) == (200, "available")


async def test_non_atomic_batch_checks_every_identity_before_storing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic=False: a bad id, type or args anywhere is 400 at its index, none stored."""
    running = await start(EmulatorConfig(batch_atomic=False))
    items = [job(), job(options={"priority": 101}), job(), {**job(), "args": {"n": 1}}]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (400, "invalid_request")
    assert answer.body["error"]["details"]["index"] == 3
    assert all(e.created == 0 for e in running.emulator.ledger().values())


async def test_atomic_batch_answers_400_for_a_422_item_and_stores_nothing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic: an item a single POST answers 422 makes the batch 400 invalid_request."""
    running = await start(EmulatorConfig(batch_atomic=True))
    items = [job(), job(options={"retry": {"max_attempts": -1}}), job()]
    single = await call(http, "POST", running.url + JOBS, items[1])
    assert (single.status, single.body["error"]["code"]) == (422, "validation_error")
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (400, "invalid_request")
    error = answer.body["error"]
    assert error["message"].startswith("Batch validation failed: job at index 1: ")
    assert error["details"]["index"] == 1
    assert all(e.created == 0 for e in running.emulator.ledger().values())


async def test_batch_in_batch_duplicate_ids(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """One id twice in a batch: 409 under spec409 (atomic), two creations under overwrite."""
    strict = await start()
    item = job()
    answer = await call(http, "POST", strict.url + BATCH, {"jobs": [item, item]})
    assert (answer.status, answer.body["error"]["details"]["index"]) == (409, 1)
    assert strict.emulator.ledger()[item["id"]].created == 0
    lax = await start(EmulatorConfig(duplicate_mode="overwrite"))
    assert (await call(http, "POST", lax.url + BATCH, {"jobs": [item, item]})).status == 201
    entry = lax.emulator.ledger()[item["id"]]
    assert (entry.created, entry.overwrites, entry.posts) == (2, 1, 2)


async def test_batch_bounds_and_capability(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Empty and oversized batches are 400; with batch_enqueue off the route is 404."""
    running = await start(EmulatorConfig(max_batch_jobs=3))
    empty = await call(http, "POST", running.url + BATCH, {"jobs": []})
    assert (empty.status, empty.body["error"]["code"]) == (400, "invalid_request")
    many = await call(http, "POST", running.url + BATCH, {"jobs": [job() for _ in range(4)]})
    assert many.status == 400
    manifest = await call(http, "GET", running.url + "/ojs/manifest")
    assert manifest.body["capabilities"]["batch_enqueue"] is True
    off = await start(EmulatorConfig(batch_enqueue=False))
    assert (await call(http, "POST", off.url + BATCH, {"jobs": [job()]})).status == 404
    off_manifest = await call(http, "GET", off.url + "/ojs/manifest")
    assert off_manifest.body["capabilities"]["batch_enqueue"] is False
    assert off_manifest.body["capabilities"]["unique_jobs"] is False


# --- auth and size -----------------------------------------------------------------------


async def test_bearer_auth(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """No or non-Bearer header → 401, wrong token → 403; health and /_emulator/ are exempt."""
    running = await start(EmulatorConfig(auth_token="s3cret"))  # noqa: S106 - a test token
    url = running.url + JOBS
    missing = await call(http, "POST", url, job())
    basic = await call(http, "POST", url, job(), headers={"Authorization": "Basic czNjcmV0"})
    wrong = await call(http, "POST", url, job(), headers={"Authorization": "Bearer nope"})
    right = await call(http, "POST", url, job(), headers={"Authorization": "Bearer s3cret"})
    assert [missing.status, basic.status, wrong.status, right.status] == [401, 401, 403, 201]
    assert missing.body["error"]["code"] == "unauthorized"
    assert wrong.body["error"]["code"] == "forbidden"
    assert (await call(http, "GET", running.url + "/ojs/manifest")).status == 401
    assert (await call(http, "GET", running.url + "/ojs/v1/health")).status == 200
    assert (await call(http, "GET", running.url + "/_emulator/ledger")).status == 200


async def test_body_over_the_bound_is_413(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A body over max_body_bytes is 413, by Content-Length or while streaming (chunked)."""
    running = await start(EmulatorConfig(max_body_bytes=1024))
    sent = job(args=["x" * 2000])
    declared = await call(http, "POST", running.url + JOBS, sent)
    assert (declared.status, declared.body["error"]["code"]) == (413, "invalid_request")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b" " * 65536

    streamed = await call(
        http, "POST", running.url + JOBS, headers={"Content-Type": MEDIA}, data=chunks()
    )
    assert streamed.status == 413
    fits = await call(http, "POST", running.url + JOBS, job())
    assert fits.status == 201
    assert sent["id"] not in running.emulator.ledger()  # never read, so never counted


# --- worker side -------------------------------------------------------------------------


async def fetch(
    http: aiohttp.ClientSession, url: str, queue: str = "default", **extra: Any
) -> list[dict[str, Any]]:
    """POST /workers/fetch and return the jobs."""
    answer = await call(http, "POST", url + "/ojs/v1/workers/fetch", {"queues": [queue], **extra})
    assert answer.status == 200
    jobs: list[dict[str, Any]] = answer.body["jobs"]
    return jobs


async def test_stale_lease_token_is_409(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """Gateway dialect: after a lease expires and is reclaimed, the old token's ack is 409
    stale_lease and the new holder's ack succeeds."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    (first,) = await fetch(http, running.url, worker_id="a", visibility_timeout_ms=1000)
    running.emulator.advance_clock(2.0)
    expired = await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    assert expired.body["job"]["state"] == "available"
    (second,) = await fetch(http, running.url, worker_id="b")
    assert second["attempt"] == 2
    assert second["lease_token"] != first["lease_token"]
    ack_url = running.url + "/ojs/v1/workers/ack"
    stale = await call(
        http, "POST", ack_url, {"job_id": sent["id"], "lease_token": first["lease_token"]}
    )
    assert (stale.status, stale.body["error"]["code"]) == (409, "stale_lease")
    nack_url = running.url + "/ojs/v1/workers/nack"
    stale_beat = await call(
        http,
        "POST",
        running.url + "/ojs/v1/workers/heartbeat",
        {"worker_id": "a", "job_id": sent["id"], "lease_token": first["lease_token"]},
    )
    assert (stale_beat.status, stale_beat.body["error"]["code"]) == (409, "stale_lease")
    stale_nack = await call(
        http, "POST", nack_url, {"job_id": sent["id"], "lease_token": first["lease_token"]}
    )
    assert stale_nack.body["error"]["code"] == "stale_lease"
    fresh = await call(
        http, "POST", ack_url, {"job_id": sent["id"], "lease_token": second["lease_token"]}
    )
    assert (fresh.status, fresh.body["state"]) == (200, "completed")
    again = await call(
        http, "POST", ack_url, {"job_id": sent["id"], "lease_token": second["lease_token"]}
    )
    assert again.body["error"]["code"] == "stale_lease"


async def test_ack_without_token_follows_public_ojs(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Without a lease_token a late ack succeeds while the job is active, else 409 conflict."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    ack_url = running.url + "/ojs/v1/workers/ack"
    early = await call(http, "POST", ack_url, {"job_id": sent["id"]})
    assert (early.status, early.body["error"]["code"]) == (409, "conflict")
    assert early.body["error"]["details"]["current_state"] == "available"
    await fetch(http, running.url, visibility_timeout_ms=1000)
    running.emulator.advance_clock(2.0)
    await fetch(http, running.url)
    late = await call(http, "POST", ack_url, {"job_id": sent["id"], "result": {"ok": True}})
    assert (late.status, late.body["acknowledged"]) == (200, True)
    stored = await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    assert stored.body["job"]["result"] == {"ok": True}
    unknown = await call(http, "POST", ack_url, {"job_id": uuid7()})
    assert unknown.status == 404


async def test_nack_retries_after_backoff_then_discards(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """nack → retryable, available again after its backoff; the last attempt → discarded."""
    running = await start()
    sent = job(options={"retry": {"max_attempts": 2, "initial_interval": "PT10S"}})
    await call(http, "POST", running.url + JOBS, sent)
    nack_url = running.url + "/ojs/v1/workers/nack"
    failure = {"job_id": sent["id"], "error": {"code": "boom", "message": "first"}}
    await fetch(http, running.url)
    first = await call(http, "POST", nack_url, failure)
    assert (first.body["state"], first.body["attempt"], first.body["retry_delay_ms"]) == (
        "retryable",
        1,
        10000,
    )
    assert await fetch(http, running.url) == []
    running.emulator.advance_clock(10.0)
    (retried,) = await fetch(http, running.url)
    assert retried["attempt"] == 2
    last = await call(http, "POST", nack_url, failure)
    assert last.body["state"] == "discarded"
    stored = await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    assert stored.body["job"]["error"]["type"] == "boom"
    assert len(stored.body["job"]["errors"]) == 2


async def test_heartbeat_extends_the_lease(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A heartbeat pushes the lease deadline out; without one the job returns to available."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    await fetch(http, running.url, visibility_timeout_ms=3000)
    running.emulator.advance_clock(2.0)
    beat = await call(
        http,
        "POST",
        running.url + "/ojs/v1/workers/heartbeat",
        {"worker_id": "w", "active_jobs": [sent["id"]], "visibility_timeout_ms": 3000},
    )
    assert (beat.body["state"], beat.body["jobs_extended"]) == ("running", [sent["id"]])
    running.emulator.advance_clock(2.0)
    assert running.emulator.job(sent["id"])["state"] == "active"  # type: ignore[index]
    running.emulator.advance_clock(1.5)
    assert running.emulator.job(sent["id"])["state"] == "available"  # type: ignore[index]


async def test_scheduled_job_becomes_available_on_time(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A future delay_until gives scheduled; once the clock passes it, available."""
    running = await start()
    sent = job(options={"delay_until": "+PT30S"})
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.body["job"]["state"] == "scheduled"
    assert await fetch(http, running.url) == []
    running.emulator.advance_clock(31.0)
    (fetched,) = await fetch(http, running.url)
    assert fetched["id"] == sent["id"]


async def test_cancel(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """DELETE cancels a live job (200), a terminal one is 409 conflict, an unknown one 404."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    url = f"{running.url}{JOBS}/{sent['id']}"
    cancelled = await call(http, "DELETE", url)
    assert (cancelled.status, cancelled.body["job"]["state"]) == (200, "cancelled")
    assert (await call(http, "DELETE", url)).status == 409
    assert (await call(http, "DELETE", f"{running.url}{JOBS}/{uuid7()}")).status == 404


# --- retention ---------------------------------------------------------------------------


async def test_retention_purges_terminal_jobs_and_frees_the_id(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """After retention_s a terminal job is gone (GET 404, ledger job null) and its id is
    accepted again as a new creation."""
    running = await start(EmulatorConfig(retention_s=60))
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    await fetch(http, running.url)
    await call(http, "POST", running.url + "/ojs/v1/workers/ack", {"job_id": sent["id"]})
    running.emulator.advance_clock(59.0)
    assert (await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")).status == 200
    running.emulator.advance_clock(2.0)
    assert (await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")).status == 404
    ledger = (await call(http, "GET", running.url + "/_emulator/ledger")).body["jobs"]
    assert (ledger[sent["id"]]["job"], ledger[sent["id"]]["purged"]) == (None, True)
    assert (await call(http, "POST", running.url + JOBS, sent)).status == 201
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.created, entry.overwrites, entry.purged, entry.gets) == (2, 0, False, 2)


# --- faults ------------------------------------------------------------------------------


async def test_status_fault_with_retry_after_then_normal(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A status rule answers its status and Retry-After `times` times without storing."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(action="status", method="POST", path=JOBS, status=429, retry_after="3", times=2)
    )
    sent = job()
    answers = [await call(http, "POST", running.url + JOBS, sent) for _ in range(3)]
    assert [a.status for a in answers] == [429, 429, 201]
    assert answers[0].headers["Retry-After"] == "3"
    assert answers[0].body["error"]["code"] == "rate_limited"
    assert answers[0].body["error"]["retryable"] is True
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.created, entry.posts, entry.post_statuses) == (1, 3, (429, 429, 201))


async def test_drop_fault_disconnects_without_storing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """drop: the client sees a disconnect and the job was not stored."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="drop", method="POST", path=JOBS))
    sent = job()
    with pytest.raises(DISCONNECTED):
        await call(http, "POST", running.url + JOBS, sent)
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.job, entry.created, entry.posts, entry.post_statuses) == (None, 0, 1, (None,))


async def test_store_then_drop_stores_and_disconnects(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """store_then_drop: the job IS stored, yet the client gets no answer, only a disconnect."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="store_then_drop", method="POST", path=JOBS))
    sent = job()
    with pytest.raises(DISCONNECTED):
        await call(http, "POST", running.url + JOBS, sent)
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.created, entry.post_statuses) == (1, (None,))
    retry = await call(http, "POST", running.url + JOBS, sent)
    assert (retry.status, retry.body["error"]["code"]) == (409, "duplicate")
    assert (await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")).status == 200


async def test_store_then_drop_batch(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """store_then_drop on a batch stores every item and answers nothing."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="store_then_drop", path=BATCH))
    items = [job(), job()]
    with pytest.raises(DISCONNECTED):
        await call(http, "POST", running.url + BATCH, {"jobs": items})
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [1, 1]


async def test_store_then_delay_outlives_the_client_timeout(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """store_then_delay: the client times out, but the job was stored before the delay."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(action="store_then_delay", method="POST", path=JOBS, delay_ms=60_000)
    )
    sent = job()
    with pytest.raises(TimeoutError):
        await call(http, "POST", running.url + JOBS, sent, timeout_s=0.3)
    assert running.emulator.ledger()[sent["id"]].created == 1


async def test_store_then_status_answers_an_error_after_storing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """store_then_status: a 500 after a commit, the ambiguous case relayd must reconcile."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="store_then_status", path=JOBS, status=500))
    sent = job()
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert (answer.status, answer.body["error"]["code"]) == (500, "internal_error")
    assert running.emulator.ledger()[sent["id"]].created == 1


async def test_latency_fault_delays_then_processes(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """latency: the request is answered normally after the delay, and the rule counts it."""
    running = await start()
    rule_id = running.emulator.add_fault(FaultRule(action="latency", path=JOBS, delay_ms=50))
    answer = await call(http, "POST", running.url + JOBS, job())
    assert answer.status == 201
    assert running.emulator.fault_fired(rule_id) == 1


async def test_fault_targets_one_job_id(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """A rule with job_id fires only for requests carrying that id (POST, batch or GET)."""
    running = await start()
    target, other = job(), job()
    running.emulator.add_fault(
        FaultRule(action="status", status=503, job_id=target["id"], times=None)
    )
    assert (await call(http, "POST", running.url + JOBS, other)).status == 201
    assert (await call(http, "POST", running.url + JOBS, target)).status == 503
    batch = await call(http, "POST", running.url + BATCH, {"jobs": [job(), target]})
    assert batch.status == 503
    assert (await call(http, "GET", f"{running.url}{JOBS}/{target['id']}")).status == 503
    assert (await call(http, "GET", f"{running.url}{JOBS}/{other['id']}")).status == 200


async def test_prefix_fault_until_cleared(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """times=None with a path prefix fails every matching request until the rules are cleared."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(action="status", status=502, path_prefix="/ojs/v1/jobs", times=None)
    )
    for _ in range(3):
        answer = await call(http, "GET", f"{running.url}{JOBS}/{uuid7()}")
        assert (answer.status, answer.body["error"]["code"]) == (502, "backend_error")
    assert (await call(http, "GET", running.url + "/ojs/v1/health")).status == 200
    assert running.emulator.clear_faults() == 1
    assert (await call(http, "POST", running.url + JOBS, job())).status == 201


async def test_raw_body_fault(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """A rule can answer a raw, non-OJS body (e.g. a proxy's HTML error page)."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(
            action="status", status=502, body="<html>bad gateway</html>", content_type="text/html"
        )
    )
    answer = await call(http, "POST", running.url + JOBS, job())
    assert (answer.status, answer.text) == (502, "<html>bad gateway</html>")
    assert answer.headers["Content-Type"] == "text/html"


async def test_fault_control_api_over_http(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """POST/GET/DELETE /_emulator/faults arm, list (with fired counts) and clear rules."""
    running = await start()
    faults_url = running.url + "/_emulator/faults"
    rule = {"method": "POST", "path": JOBS, "action": "status", "status": 503, "times": 2}
    armed = await call(http, "POST", faults_url, {"rules": [rule]})
    assert armed.status == 201
    assert armed.body["rules"][0]["id"] == "f1"
    codes = [(await call(http, "POST", running.url + JOBS, job())).status for _ in range(3)]
    assert codes == [503, 503, 201]
    listed = await call(http, "GET", faults_url)
    assert (listed.body["rules"][0]["fired"], listed.body["rules"][0]["remaining"]) == (2, 0)
    bad = await call(http, "POST", faults_url, {"action": "explode"})
    assert (bad.status, bad.body["error"]["code"]) == (400, "invalid_request")
    assert (await call(http, "DELETE", faults_url)).body == {"cleared": 1}
    assert (await call(http, "GET", faults_url)).body == {"rules": []}


# --- ledger and reset --------------------------------------------------------------------


async def test_ledger_counts_posts_gets_and_deliveries(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """The ledger counts every POST (single or batch) and GET per id, and worker fetches."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    await call(http, "POST", running.url + BATCH, {"jobs": [sent]})
    await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    await fetch(http, running.url)
    ledger = (await call(http, "GET", running.url + "/_emulator/ledger")).body["jobs"]
    entry = ledger[sent["id"]]
    assert entry["job"]["state"] == "active"
    assert {k: entry[k] for k in ("queue", "created", "posts", "post_statuses", "gets")} == {
        "queue": "default",
        "created": 1,
        "posts": 2,
        "post_statuses": [201, 409],
        "gets": 1,
    }
    assert entry["deliveries"] == 1


async def test_reset_forgets_jobs_ledger_and_faults(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """POST /_emulator/reset empties the jobs, the ledger and the fault rules."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    running.emulator.add_fault(FaultRule(action="status", path="/nowhere", times=None))
    assert (await call(http, "POST", running.url + "/_emulator/reset")).status == 200
    assert (await call(http, "GET", running.url + "/_emulator/ledger")).body == {"jobs": {}}
    assert running.emulator.faults() == []
    assert (await call(http, "POST", running.url + JOBS, sent)).status == 201


async def test_wait_until_wakes_on_a_request(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """wait_until returns as soon as a request makes the predicate true."""
    running = await start()
    sent = job()

    def stored(emulator: Emulator) -> bool:
        return emulator.job(sent["id"]) is not None

    async with asyncio.timeout(10):
        waiter = asyncio.create_task(running.emulator.wait_until(stored))
        await asyncio.sleep(0)
        assert not waiter.done()
        await call(http, "POST", running.url + JOBS, sent)
        await waiter


async def test_clock_control_over_http(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """POST /_emulator/clock moves the clock forward; a negative advance is refused."""
    running = await start()
    before = running.emulator.now()
    moved = await call(http, "POST", running.url + "/_emulator/clock", {"advance_s": 3600})
    assert moved.status == 200
    assert running.emulator.now() - before >= 3600
    refused = await call(http, "POST", running.url + "/_emulator/clock", {"advance_s": -1})
    assert refused.status == 400


# --- entry points ------------------------------------------------------------------------


def test_config_from_options(tmp_path: Path) -> None:
    """The CLI helper builds a config from strings and names the option it rejects."""
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    config = config_from_options(
        duplicate_mode="overwrite",
        queue_source="top_level",
        batch_atomic=False,
        auth_token_file=str(token_file),
        retention_s="90",
    )
    assert (config.duplicate_mode, config.queue_source, config.batch_atomic) == (
        "overwrite",
        "top_level",
        False,
    )
    assert (config.auth_token, config.retention_s) == ("s3cret", 90.0)
    assert "s3cret" not in repr(config)
    with pytest.raises(ValueError, match="duplicate_mode"):
        config_from_options(duplicate_mode="sometimes")
    with pytest.raises(ValueError, match="queue_source"):
        config_from_options(queue_source="header")
    with pytest.raises(ValueError, match="retention_s"):
        config_from_options(retention_s="soon")
    with pytest.raises(ValueError, match="auth_token_file"):
        config_from_options(auth_token_file=str(tmp_path / "missing"))


def test_parse_listen() -> None:
    """`relayd emulator --listen`: HOST:PORT, IPv6 in brackets, errors for anything else."""
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8080", "host:", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)


async def test_serve_runs_until_sigterm(http: aiohttp.ClientSession) -> None:
    """serve() prints where it listens, answers, and exits 0 on SIGTERM."""
    script = (
        "from relayd.testing.emulator import EmulatorConfig, serve; "
        "serve('127.0.0.1', 0, EmulatorConfig())"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode().strip()
        assert line.startswith("ojs-emulator listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1]
        health = await call(http, "GET", url + "/ojs/v1/health")
        assert (health.status, health.body["status"]) == (200, "ok")
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _stdout, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
