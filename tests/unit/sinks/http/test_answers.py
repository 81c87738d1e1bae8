"""An HTTP sink's transport failures (relayd/sinks/http/answers.py), the table OJS and webhooks
share: each names the host and port it could not reach in relayd's words (never asyncio's
"Connect call failed", never a class name where words can say it), and says whether the
request can have reached the server."""

from __future__ import annotations

import errno
import socket

import aiohttp
import pytest

from relayd.core.outcomes import SinkDown
from relayd.sinks.http.answers import classify_exception

WHERE = "hooks.example.com:443"
_KEY = aiohttp.client_reqrep.ConnectionKey("hooks.example.com", 443, True, True, None, None, None)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            aiohttp.ClientConnectorError(
                _KEY, ConnectionRefusedError(111, "Connect call failed ('10.0.0.7', 443)")
            ),
            SinkDown(f"cannot connect to {WHERE}: connection refused", reached=False),
        ),
        (
            aiohttp.ClientConnectorError(_KEY, OSError(errno.ENETUNREACH, "Connect call failed")),
            SinkDown(f"cannot connect to {WHERE}: network is unreachable", reached=False),
        ),
        (
            aiohttp.ClientConnectorDNSError(_KEY, socket.gaierror(-2, "Name or service not known")),
            SinkDown(
                f"cannot connect to {WHERE}: the host name does not resolve (name or service "
                "not known)",
                reached=False,
            ),
        ),
        (
            aiohttp.ConnectionTimeoutError(),
            SinkDown(f"cannot connect to {WHERE}: connect timed out", reached=False),
        ),
        (
            aiohttp.ServerDisconnectedError(),
            SinkDown(f"{WHERE} closed the connection without an answer"),
        ),
        (
            aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"),
            SinkDown(f"the connection to {WHERE} failed mid-request: connection reset by peer"),
        ),
        (aiohttp.ServerTimeoutError(), SinkDown(f"read from {WHERE} timed out")),
        (
            aiohttp.ClientPayloadError(),
            SinkDown(f"HTTP client error with {WHERE}: ClientPayloadError"),
        ),
    ],
)
def test_transport_failures_name_the_server_and_whether_the_request_left(
    exc: BaseException, expected: SinkDown
) -> None:
    """Connection refused, an unreachable network, a name that does not resolve and a
    connect timeout never reached the sink; a reset or a timeout mid-request may have."""
    assert classify_exception(exc, where=WHERE) == expected
