"""A NATS connection's failures in relayd's words (relayd/sinks/nats/link.py): each names the
server as host:port and says what went wrong without a client library's class name; a publish
refused for want of a connection sent nothing; refused credentials and a certificate that
does not verify are severe."""

from __future__ import annotations

import errno
import socket
import ssl

import nats.errors
import pytest

from relayd.core.outcomes import SinkDown
from relayd.sinks.nats.link import (
    Link,
    classify_connect_failure,
    connection_error,
    not_connected,
    servers_text,
)

SERVER = "127.0.0.1:4222"


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (
            ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 4222)"),
            "connection refused",
        ),
        (OSError(errno.EHOSTUNREACH, "Connect call failed"), "no route to host"),
        (
            socket.gaierror(-2, "Name or service not known"),
            "the host name does not resolve (name or service not known)",
        ),
        (
            OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 4222)"),
            "Multiple exceptions: [Errno 111] Connect call failed ('::1', 4222)",
        ),
        (nats.errors.UnexpectedEOF(), "the server closed the connection"),
        (nats.errors.StaleConnectionError(), "the server stopped answering pings"),
        (nats.errors.OutboundBufferLimitError(), "reconnecting"),
        (nats.errors.ConnectionReconnectingError(), "reconnecting"),
        (nats.errors.ConnectionClosedError(), "the connection is closed"),
        (nats.errors.ConnectionDrainingError(), "the connection is draining"),
        (nats.errors.NoServersError(), "no server could be reached"),
        (nats.errors.TimeoutError(), "no answer in time"),
        (TimeoutError(), "no answer in time"),
        (nats.errors.AuthorizationError(), "authorization violation"),
        (nats.errors.Error("nats: 'Authorization Violation'"), "Authorization Violation"),
        (nats.errors.Error("nats: 'Maximum Connections Exceeded'"), "Maximum Connections Exceeded"),
        (
            ssl.SSLCertVerificationError("certificate verify failed"),
            "the server's certificate does not verify",
        ),
        (None, "no server answered in time"),
    ],
)
def test_a_connection_error_is_said_in_words(exc: BaseException | None, words: str) -> None:
    """The operating system's words for a socket's failure, a phrase for each of the
    client's errors, the server's own words for its -ERR line."""
    assert connection_error(exc) == words


@pytest.mark.parametrize(
    ("exc", "link", "error"),
    [
        (
            nats.errors.OutboundBufferLimitError(),
            Link(SERVER, "connection refused"),
            f"not connected to NATS at {SERVER} (reconnecting: connection refused); "
            "nothing was sent",
        ),
        (
            nats.errors.OutboundBufferLimitError(),
            Link(SERVER, "the server closed the connection"),
            f"not connected to NATS at {SERVER} (reconnecting: the server closed the "
            "connection); nothing was sent",
        ),
        (
            nats.errors.ConnectionReconnectingError(),
            Link(SERVER),
            f"not connected to NATS at {SERVER} (reconnecting); nothing was sent",
        ),
        (
            nats.errors.ConnectionClosedError(),
            Link("a:4222, b:4222", "the connection is closed"),
            "not connected to NATS at a:4222, b:4222 (the connection is closed); nothing was sent",
        ),
        (
            nats.errors.StaleConnectionError(),
            Link(SERVER, "connection refused"),
            f"not connected to NATS at {SERVER} (the server stopped answering pings: "
            "connection refused); nothing was sent",
        ),
    ],
)
def test_a_publish_without_a_connection_names_the_server_and_why(
    exc: BaseException, link: Link, error: str
) -> None:
    """No reconnect buffer: a publish between connections fails at once, unsent (not
    reached), and says where the connection was and what the client last met."""
    assert not_connected(exc, link) == SinkDown(error, reached=False)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            nats.errors.Error("nats: 'Authorization Violation'"),
            SinkDown(
                f"cannot connect to NATS at {SERVER}: authorization violation (check the "
                "sink's credentials)",
                reached=False,
                severe=True,
            ),
        ),
        (nats.errors.AuthorizationError(), "authorization violation"),
        (
            ssl.SSLCertVerificationError("certificate verify failed"),
            SinkDown(
                f"cannot connect to NATS at {SERVER}: the server's certificate does not "
                "verify (check sink.ca_file and the server name)",
                reached=False,
                severe=True,
            ),
        ),
        (
            ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 4222)"),
            SinkDown(f"cannot connect to NATS at {SERVER}: connection refused", reached=False),
        ),
        (
            None,
            SinkDown(
                f"cannot connect to NATS at {SERVER}: no server answered in time", reached=False
            ),
        ),
        (
            nats.errors.NoServersError(),
            SinkDown(
                f"cannot connect to NATS at {SERVER}: no server could be reached", reached=False
            ),
        ),
    ],
)
def test_connection_failures(exc: BaseException | None, expected: object) -> None:
    """Refused credentials and a certificate that does not verify are severe (the breaker
    opens at once); a server that is down is an outage. Each names the servers tried."""
    outcome = classify_connect_failure(exc, servers=SERVER)
    if isinstance(expected, str):
        assert outcome.severe
        assert expected in outcome.error
    else:
        assert outcome == expected


def test_the_servers_are_named_as_host_and_port() -> None:
    """The configured servers as host:port, the default port where a URL names none."""
    assert servers_text(["nats://a.example", "tls://b.example:4333", "nats://[::1]:4222"]) == (
        "a.example:4222, b.example:4333, [::1]:4222"
    )
