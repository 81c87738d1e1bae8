"""`endpoint` (relayd/sinks/__init__.py): where a sink's URL points, as a connection's failure
names it: host and port, never the URL's credentials, path or query."""

from __future__ import annotations

import pytest

from relayd.sinks import endpoint


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8080/ojs/v1", "127.0.0.1:8080"),
        ("https://hooks.example.com/in/t0ken?sig=s3cret", "hooks.example.com:443"),
        ("http://user:pa55@hooks.example.com/in", "hooks.example.com:80"),
        ("nats://nats.internal", "nats.internal:4222"),
        ("tls://nats.internal:4443", "nats.internal:4443"),
        ("http://[::1]:9000/", "[::1]:9000"),
        ("http://host:notaport/", "host:80"),
    ],
)
def test_an_endpoint_is_host_and_port_only(url: str, expected: str) -> None:
    """The port the scheme implies when the URL names none; nothing a secret could stand in."""
    assert endpoint(url) == expected
