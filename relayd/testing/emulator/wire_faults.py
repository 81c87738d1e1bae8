"""The emulator's fault actions that reshape a request or its answer on the wire: a batch cut
down before it is stored, a 2xx batch answer that leaves ids out, an answer whose head is
trickled byte by byte, and an answer padded past relayd's size limit
(relayd/testing/emulator/faults.py lists every action)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http

from aiohttp import web

from relayd.testing.emulator.wire import Call, Reply, dumps, loads

BATCH_PATH = "/ojs/v1/jobs/batch"
_OVERSIZED_CHUNK = b" " * (64 * 1024)


@dataclasses.dataclass(frozen=True)
class Answer:
    """An answer ready to write: its status, its headers and its encoded body."""

    status: int
    headers: dict[str, str]
    body: bytes


def first_jobs(call: Call, count: int) -> Call:
    """A batch call cut down to its first `count` jobs (any other call unchanged)."""
    payload = call.payload if call.payload_ok else None
    if call.path != BATCH_PATH or not isinstance(payload, dict):
        return call
    jobs = payload.get("jobs")
    if not isinstance(jobs, list) or len(jobs) <= count:
        return call
    kept = {**payload, "jobs": jobs[:count]}
    return dataclasses.replace(call, payload=kept, body=dumps(kept))


def omit_ids(call: Call, reply: Reply, count: int) -> Reply:
    """A 2xx batch answer listing only its first `count` jobs (any other answer unchanged)."""
    if call.path != BATCH_PATH or not 200 <= reply.status < 300:
        return reply
    answer = loads(reply.raw) if reply.raw is not None else reply.body
    if not isinstance(answer, dict) or not isinstance(answer.get("jobs"), list):
        return reply
    listed = answer["jobs"][:count]
    return Reply(reply.status, None, reply.headers, raw=dumps({**answer, "jobs": listed}))


async def trickle(
    request: web.Request, answer: Answer, delay_ms: int, closing: asyncio.Event
) -> None:
    """Write the answer by hand on the raw transport: the status line and headers one byte
    at a time, `delay_ms` apart, then the body; then close the connection. Stops as soon as
    the client hangs up or `closing` is set (the emulator stops)."""
    transport = request.transport
    if transport is None:
        return
    lines = [f"HTTP/1.1 {answer.status} {_reason(answer.status)}"]
    lines += [f"{name}: {value}" for name, value in answer.headers.items()]
    lines += [f"Content-Length: {len(answer.body)}", "Connection: close", "", ""]
    head = "\r\n".join(lines).encode("latin-1")
    for index in range(len(head)):
        if transport.is_closing() or closing.is_set():
            break
        transport.write(head[index : index + 1])
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_ms / 1000):
                await closing.wait()
    else:
        if not transport.is_closing():
            transport.write(answer.body)
    if not transport.is_closing():
        transport.close()


async def oversized(request: web.Request, answer: Answer, size_bytes: int) -> web.StreamResponse:
    """The answer's JSON padded inside with spaces to `size_bytes` bytes (never less than
    the body itself), streamed in chunks: whole, it is still valid JSON."""
    head, tail = _split_json(answer.body)
    padding = max(size_bytes - len(answer.body), 0)
    response = web.StreamResponse(status=answer.status, headers=answer.headers)
    response.content_length = len(answer.body) + padding
    try:
        await response.prepare(request)
        await response.write(head)
        while padding > 0:
            chunk = _OVERSIZED_CHUNK[: min(padding, len(_OVERSIZED_CHUNK))]
            await response.write(chunk)
            padding -= len(chunk)
        await response.write(tail)
        await response.write_eof()
    except ConnectionError:
        pass  # the client stopped reading and hung up, as it may
    return response


def _split_json(body: bytes) -> tuple[bytes, bytes]:
    """`body` cut before its final closing bracket or brace, where whitespace may go."""
    stripped = body.rstrip()
    if stripped.endswith((b"}", b"]")):
        return stripped[:-1], stripped[-1:]
    return body, b""


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
