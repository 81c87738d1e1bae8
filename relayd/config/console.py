"""`[console]`: where `relayd console` listens, who may use it, and what it may do.

Safe by default: it binds loopback, is read-only, hides payloads, and refuses to listen on
any other address without authentication (a password file for HTTP basic, or a header a
trusted proxy sets). The password file is read by `relayd console` alone, when it starts.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from relayd.config.base import KeyedError, Section
from relayd.config.sections import parse_listen

# A statement of the console waits at most this long (PostgreSQL's statement_timeout): a page
# reads a few bounded statements, so anything slower is a plan to look at, not to wait for.
_MAX_STATEMENT_TIMEOUT_S = 300.0
# An HTTP header name (RFC 9110 token characters).
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}")


def is_loopback(host: str) -> bool:
    """Whether `host` (a `HOST` of `HOST:PORT`) only ever reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


class ConsoleSettings(Section):
    listen: str = "127.0.0.1:8437"
    # HTTP basic authentication: a file of `name:password` lines (a secret file: read once,
    # at start-up, by `relayd console` only).
    password_file: Path | None = None
    # Or a header a trusted reverse proxy sets to the authenticated user's name (and strips
    # from what clients send): a request without it is refused.
    proxy_user_header: str | None = None
    # Whether the console may act (redrive, discard, pause, resume, the parked keys' verbs);
    # read-only by default.
    actions: bool = False
    # Whether an event's payload is shown; by default only its size and top-level keys.
    show_payloads: bool = False
    statement_timeout_s: float = Field(default=5.0, ge=0.001, le=_MAX_STATEMENT_TIMEOUT_S)
    # How often the overview refreshes its figures in the browser.
    refresh_s: float = Field(default=5.0, ge=1.0, le=3600.0)

    @field_validator("listen")
    @classmethod
    def _valid_listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("proxy_user_header")
    @classmethod
    def _valid_header(cls, value: str | None) -> str | None:
        if value is not None and not _HEADER.fullmatch(value):
            raise ValueError(f"expected an HTTP header name, got {value[:60]!r}")
        return value

    @model_validator(mode="after")
    def _authenticated_beyond_loopback(self) -> ConsoleSettings:
        if self.password_file is not None and self.proxy_user_header is not None:
            raise ValueError("set either password_file or proxy_user_header, not both")
        host, _port = parse_listen(self.listen)
        if not is_loopback(host) and self.authentication is None:
            raise KeyedError(
                "console.listen",
                f"{host} is not a loopback address: set console.password_file or "
                "console.proxy_user_header, or bind 127.0.0.1",
            )
        return self

    @property
    def authentication(self) -> str | None:
        """How users are told apart: "basic", "proxy", or None (loopback, the OS user)."""
        if self.password_file is not None:
            return "basic"
        if self.proxy_user_header is not None:
            return "proxy"
        return None
