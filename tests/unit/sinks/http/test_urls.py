"""`redact_url`, the one function that decides what of an endpoint's URL relayd shows: the
query, fragment and user information hidden whole, a secret-looking path segment (the
default rule, or an operator's pattern) hidden, the rest kept."""

from __future__ import annotations

import re

import pytest

from relayd.sinks.http.urls import hidden_parts, looks_secret, redact_url

SLACK = "https://hooks.slack.com/services/T0ABCDEFG/B0ABCDEFG/Xk9pQ2rT7vW3yZ1aB4cD6eF8"
DISCORD = (
    "https://discord.com/api/webhooks/123456789012345678/"
    "aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789-_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123"
)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://receiver.example/hooks", "https://receiver.example/hooks"),
        ("https://receiver.example:8443/hooks/", "https://receiver.example:8443/hooks/"),
        ("http://127.0.0.1:9/", "http://127.0.0.1:9/"),
        ("https://r.example/hooks?token=s3cr3t", "https://r.example/hooks?***"),
        ("https://r.example/hooks?", "https://r.example/hooks"),
        ("https://r.example/a#frag", "https://r.example/a#***"),
        ("https://user:pw@r.example/a", "https://***@r.example/a"),
        (SLACK, "https://hooks.slack.com/services/T0ABCDEFG/B0ABCDEFG/***"),
        (DISCORD, "https://discord.com/api/webhooks/123456789012345678/***"),
        (
            "https://r.example/in/0190a8f2-5c5e-7e4a-9d6b-6f1d8c3b2a10/events",
            "https://r.example/in/***/events",
        ),
        ("https://r.example/in/4bf92f3577b34da6a3ce/x", "https://r.example/in/***/x"),
        # Words, slugs and numbers stay, however long.
        (
            "https://r.example/order-created-events/v2/customers",
            "https://r.example/order-created-events/v2/customers",
        ),
        ("https://r.example/12345678901234567890", "https://r.example/12345678901234567890"),
        ("https://r.example/shortT0k3n", "https://r.example/shortT0k3n"),
        ("http://[::1", "***"),
    ],
)
def test_redact_url_by_the_default_rule(url: str, shown: str) -> None:
    """The default rule, as a table: what is hidden and what is kept."""
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("patterns", "url", "shown"),
    [
        ([r"[0-9]{6,}"], DISCORD, "https://discord.com/api/webhooks/***/***"),
        ([r"sk_.*"], "https://r.example/in/sk_live/x", "https://r.example/in/***/x"),
        # A pattern matches a whole segment, never a part of one.
        ([r"live"], "https://r.example/in/sk_live/x", "https://r.example/in/sk_live/x"),
        ([r"hooks"], "https://r.example/hooks?a=b", "https://r.example/***?***"),
    ],
)
def test_an_operators_patterns_hide_whole_segments_too(
    patterns: list[str], url: str, shown: str
) -> None:
    """`sink.secret_path_patterns`: a segment one of them matches in full is hidden as well."""
    assert redact_url(url, [re.compile(p) for p in patterns]) == shown


@pytest.mark.parametrize(
    ("segment", "secret"),
    [
        ("Xk9pQ2rT7vW3yZ1a", True),  # 16 characters, three classes
        ("xk9pq2rt7vw3yz1a", True),  # lower case and digits
        ("XKPQRTVWYZABCDEFgh", True),  # upper and lower case
        ("Xk9pQ2rT7vW3yZ1", False),  # 15 characters
        ("abcdefghijklmnopqrstu", False),  # one class
        ("1234567890123456789", False),
        ("order_created_v2_events", True),  # a long slug with a digit: hidden, harmlessly
        ("Xk9pQ2rT7vW3yZ1a!x", False),  # not a token's characters
    ],
)
def test_what_looks_like_a_secret(segment: str, secret: bool) -> None:
    """At least 16 token characters mixing two of lower case, upper case and digits."""
    assert looks_secret(segment) is secret


def test_the_hidden_parts_are_what_redaction_takes_out() -> None:
    """`hidden_parts`: every piece `redact_url` hides, longest first, for scrubbing a text
    that echoes the URL (a receiver's answer)."""
    url = "https://u:pw@r.example/in/Xk9pQ2rT7vW3yZ1aB4cD/x?token=abc&b=1#f"
    assert hidden_parts(url) == ("Xk9pQ2rT7vW3yZ1aB4cD", "token=abc&b=1", "u:pw", "f")
    assert hidden_parts("https://r.example/hooks") == ()
