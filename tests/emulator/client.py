"""What the emulator's own tests share: an HTTP call that returns the whole answer, a valid
enqueue request, the paths and media type of OJS."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from multidict import CIMultiDict

from relayd.testing.emulator import (
    uuid7,
)

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


async def fetch(
    http: aiohttp.ClientSession, url: str, queue: str = "default", **extra: Any
) -> list[dict[str, Any]]:
    """POST /workers/fetch and return the jobs."""
    answer = await call(http, "POST", url + "/ojs/v1/workers/fetch", {"queues": [queue], **extra})
    assert answer.status == 200
    jobs: list[dict[str, Any]] = answer.body["jobs"]
    return jobs
