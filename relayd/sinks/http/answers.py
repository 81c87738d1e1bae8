"""What every HTTP sink (OJS, webhooks) reads the same way, decided without I/O: an answer as
a value (`Response`), a body that is not the sink's own error format as one short line
(`excerpt`), and the transport's failures and refusals as `SinkDown` values.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import aiohttp

from relayd.core.outcomes import SinkDown

# How much of a body reaches last_error and logs, and how much of it is looked at to find
# that much text (an HTML page's markup is dropped).
_EXCERPT_CHARS = 120
_EXCERPT_SCAN_BYTES = 4096
_MARKUP = re.compile(r"<[^>]*>")
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    retry_after: str | None


def excerpt(body: bytes) -> str:
    """The start of a body as one short line of text: an HTML page's markup dropped, control
    characters and runs of whitespace made one space."""
    text = _MARKUP.sub(" ", body[:_EXCERPT_SCAN_BYTES].decode("utf-8", "replace"))
    text = "".join(char if char.isprintable() else " " for char in text)
    text = _SPACES.sub(" ", text).strip()
    return text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS] + "..."


def unbuildable(exc: BaseException, *, check: str) -> SinkDown:
    """The HTTP client refused to build the request (a header or URL it will not send); the
    operator is told to `check` the keys the request is made of. The text names the
    exception's type only: its message may quote the header value."""
    return SinkDown(
        f"the request could not be built ({type(exc).__name__}; check {check})",
        reached=False,
        severe=True,
    )


def classify_exception(exc: BaseException, *, where: str) -> SinkDown:
    """A transport failure of an exchange with `where` (`host:port`), which every text
    names. `reached` is False only when no byte can have been stored."""
    if isinstance(exc, aiohttp.ClientSSLError):
        return SinkDown(
            f"TLS failure with {where}: {type(exc).__name__}", reached=False, severe=True
        )
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return SinkDown(f"cannot connect to {where}: connect timed out", reached=False)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        reason = (exc.os_error.strerror or type(exc.os_error).__name__).lower()
        return SinkDown(
            f"cannot connect to {where}: the host name does not resolve ({reason})",
            reached=False,
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        return SinkDown(f"cannot connect to {where}: {_os_words(exc.os_error)}", reached=False)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return SinkDown(f"{where} closed the connection without an answer")
    if isinstance(exc, aiohttp.ClientOSError):
        return SinkDown(f"the connection to {where} failed mid-request: {_os_words(exc)}")
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return SinkDown(f"read from {where} timed out")
    return SinkDown(f"HTTP client error with {where}: {type(exc).__name__}")


def _os_words(exc: OSError) -> str:
    """A socket's failure in the operating system's words ("connection refused"), without
    asyncio's wording around them ("Connect call failed (...)")."""
    if exc.errno is not None and exc.errno > 0:
        return os.strerror(exc.errno).lower()
    return exc.strerror or str(exc) or type(exc).__name__
