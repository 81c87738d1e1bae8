"""One exchange of an HTTP sink (OJS, webhooks): the request sent without following
redirects, the answer read with a bound, aiohttp's failures turned into `SinkDown` values at
this one boundary, and every exchange counted for `relayd_sink_requests_total`. Also the
session both sinks send with.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol

import aiohttp

from relayd.core.outcomes import SinkDown
from relayd.sinks import ExchangeObserver, endpoint
from relayd.sinks.http.answers import Response, classify_exception, unbuildable

# What a sink does with an answer's status and body before it is classified (refresh a
# credential after a refusal, redact what the server echoed): the body to keep.
Answered = Callable[[int, bytes], Awaitable[bytes]]


class SessionSettings(Protocol):
    """The keys of an HTTP sink's settings that shape its session."""

    @property
    def concurrency(self) -> int: ...
    @property
    def ca_file(self) -> Path | None: ...
    @property
    def connect_timeout_s(self) -> float: ...


def new_session(settings: SessionSettings, headers: Mapping[str, str]) -> aiohttp.ClientSession:
    """An HTTP sink's session: up to `sink.concurrency` kept-alive connections, TLS verified
    (against `sink.ca_file` if set), `headers` on every request. (Also what `bench` times
    a bare POST loop on, so that both pay for the same settings.)"""
    ssl_context = ssl.create_default_context(
        cafile=str(settings.ca_file) if settings.ca_file else None
    )
    return aiohttp.ClientSession(
        headers=dict(headers),
        connector=aiohttp.TCPConnector(
            limit=settings.concurrency, ssl=ssl_context, keepalive_timeout=30
        ),
        # The relay bounds each attempt with one outer deadline; only connecting has its own,
        # shorter limit so a dead host fails fast.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
        # No server of a sink has any business setting cookies, and relayd none sending
        # them: no jar to consult and update on every request.
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def read_bounded(stream: aiohttp.StreamReader, limit_bytes: int) -> bytes:
    """The whole body, however the network slices it, or its first `limit_bytes` + 1 bytes:
    a caller can tell an oversized answer by its length. One `read(n)` would return only
    what has arrived so far."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit_bytes:
        chunk = await stream.read(limit_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if stream.at_eof():  # the usual answer arrives whole: no second read to learn it
            break
    return b"".join(chunks)


async def exchange(  # noqa: PLR0913 - a request's parts, then how to treat its answer
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    body: bytes | None,
    headers: dict[str, str],
    limit_bytes: int,
    check: str,
    observe: ExchangeObserver | None,
    answered: Answered | None = None,
) -> Response | SinkDown:
    """Send one request and read its answer (at most `limit_bytes` + 1 bytes of body); a
    transport failure, or a request aiohttp refuses to build (`check` names the keys it is
    made of), as `SinkDown`. A cancellation (the attempt's deadline) is not swallowed."""
    # Unless an answer or a transport failure says otherwise, the exchange was cut by the
    # attempt's deadline.
    code = "timeout"
    done = False
    try:
        async with session.request(
            method, url, data=body, headers=headers, allow_redirects=False
        ) as response:
            done = True
            # The usual answer arrives whole: one read, no coroutine of read_bounded's own.
            stream = response.content
            content = await stream.read(limit_bytes + 1)
            if content and len(content) <= limit_bytes and not stream.at_eof():
                content += await read_bounded(stream, limit_bytes - len(content))
            code = str(response.status)
            if answered is not None:
                content = await answered(response.status, content)
            return Response(response.status, content, response.headers.get("Retry-After"))
    except aiohttp.ClientError as exc:
        code = "error"
        return classify_exception(exc, where=endpoint(url))
    except (ValueError, TypeError) as exc:
        # aiohttp refuses to build some requests (a control character in a header value, a
        # URL it cannot encode) with a plain ValueError, before any byte is sent. A request
        # that cannot be built would fail for every row alike: a sink-wide failure, never a
        # worker's crash. After an answer, it is our bug.
        if done:
            raise
        code = "error"
        return unbuildable(exc, check=check)
    finally:
        if observe is not None:
            observe(method, code)
