"""The emulator over real loopback HTTP: the wire rules of an enqueue (headers, content
types, envelope validation), bearer auth and the body bound."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from relayd.testing.emulator import (
    UUIDV7_PATTERN,
    EmulatorConfig,
    uuid7,
)
from tests.emulator.client import (
    JOBS,
    MEDIA,
    call,
    job,
)
from tests.support import StartEmulator

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
