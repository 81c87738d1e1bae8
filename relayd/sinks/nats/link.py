"""The NATS connection's failures in relayd's words, decided without I/O: what went wrong
with a connection (`connection_error`), a publish refused because the client is between
connections (`not_connected`), and a connection that could not be made
(`classify_connect_failure`). Each names the server as `host:port`; none names a client
library's class where words can say it, and none carries a secret (the server's own -ERR
words hold none of ours, and a server URL holds no credentials: the settings refuse them).
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import nats.errors

from relayd.core.outcomes import SinkDown
from relayd.sinks import endpoint

_MAX_SERVER_WORDS = 200
# Each of nats-py's connection errors, in words. The first match wins (subclasses first).
_CLIENT_ERRORS: Sequence[tuple[type[BaseException], str]] = (
    (nats.errors.UnexpectedEOF, "the server closed the connection"),
    (nats.errors.StaleConnectionError, "the server stopped answering pings"),
    (nats.errors.NoServersError, "no server could be reached"),
    (nats.errors.AuthorizationError, "authorization violation"),
    (nats.errors.SlowConsumerError, "a subscription fell behind (slow consumer)"),
    (nats.errors.ConnectionClosedError, "the connection is closed"),
    (nats.errors.ConnectionDrainingError, "the connection is draining"),
    (nats.errors.ConnectionReconnectingError, "reconnecting"),
    (nats.errors.OutboundBufferLimitError, "reconnecting"),
    (nats.errors.TimeoutError, "no answer in time"),
    (TimeoutError, "no answer in time"),
)
# What a publish refused for want of a connection says of the connection itself.
NOT_CONNECTED: tuple[type[BaseException], ...] = (
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.StaleConnectionError,
)


@dataclass(frozen=True, slots=True)
class Link:
    """Where the connection is, or was last (`host:port`, or the configured servers before
    any connection), and the client's last connection error since it last connected, in
    words (None: none)."""

    server: str
    error: str | None = None


def servers_text(servers: Sequence[str]) -> str:
    """The configured servers as `host:port`, comma-separated."""
    return ", ".join(endpoint(server) for server in servers) or "?"


def connection_error(exc: BaseException | None) -> str:  # noqa: PLR0911 - one per kind of error
    """What went wrong with a connection, in words: the operating system's for a socket's
    failure ("connection refused"), a phrase for each of nats-py's errors, the server's own
    for its -ERR line."""
    if exc is None:
        return "no server answered in time"
    if type(exc) is nats.errors.Error:
        # A plain client Error carries the server's -ERR line ("nats: 'Authorization
        # Violation'"): the server's words, never a secret of ours.
        words = str(exc).removeprefix("nats: ").strip().strip("'")
        return words[:_MAX_SERVER_WORDS] or "the server refused the connection"
    for kind, words in _CLIENT_ERRORS:
        if isinstance(exc, kind):
            return words
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "the server's certificate does not verify"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason if isinstance(exc.reason, str) else None
        return f"TLS failure ({reason.replace('_', ' ').lower()})" if reason else "TLS failure"
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve ({(exc.strerror or 'unknown').lower()})"
    if isinstance(exc, OSError):
        if exc.errno is not None and exc.errno > 0:
            return os.strerror(exc.errno).lower()
        # asyncio's own text when every address of a name failed ("Multiple exceptions:
        # [Errno 111] Connect call failed ('::1', 4222), ..."): addresses, no secret.
        return (str(exc) or type(exc).__name__)[:_MAX_SERVER_WORDS]
    return type(exc).__name__


def not_connected(exc: BaseException, link: Link) -> SinkDown:
    """A publish refused at once because the client has no connection (`NOT_CONNECTED`:
    relayd keeps no reconnect buffer): nothing was sent, and the reason says where the
    connection was and what the client last met trying to make it again."""
    state = connection_error(exc)
    since = f": {link.error}" if link.error and link.error != state else ""
    return SinkDown(
        f"not connected to NATS at {link.server} ({state}{since}); nothing was sent",
        reached=False,
    )


def classify_connect_failure(exc: BaseException | None, *, servers: str) -> SinkDown:
    """No connection could be made to `servers` (`host:port`, comma-separated): the last
    error the client reported. Refused credentials or a certificate that does not verify
    need an operator (severe)."""
    words = connection_error(exc)
    where = f"cannot connect to NATS at {servers}"
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization" in words.lower():
        return SinkDown(
            f"{where}: authorization violation (check the sink's credentials)",
            reached=False,
            severe=True,
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return SinkDown(
            f"{where}: the server's certificate does not verify "
            "(check sink.ca_file and the server name)",
            reached=False,
            severe=True,
        )
    return SinkDown(f"{where}: {words}", reached=False)
