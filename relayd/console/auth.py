"""Who is using the console, and the CSRF token that ties a form to them.

Three ways to tell users apart (`[console]`): HTTP basic against a password file of
`name:password` lines, a header a trusted proxy sets to the signed-in user, or neither (a
loopback bind only: the operating system's user who started the console, as the CLI's
verbs record). The user's name is what the audit trail records for the console's actions.

Every form carries a token derived from a key drawn when the console starts and the user's
name: another site's page can make a browser POST to the console, but cannot read a page
of it to learn the token. A POST without the right token is refused (403).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from relayd.config.base import KeyedError, read_secret
from relayd.config.console import ConsoleSettings
from relayd.core.errors import ConfigError
from relayd.core.outcomes import CONTROL_CHARS
from relayd.operator.command import resolve_actor

_MAX_USER_CHARS = 200
REALM = 'Basic realm="relayd console", charset="UTF-8"'


class Unauthenticated(Exception):
    """The request names no user the console knows."""


def read_password_file(path: Path) -> dict[str, str]:
    """The `name:password` lines of a password file (blank lines and `#` comments skipped);
    `ConfigError` naming console.password_file if it is unusable."""
    key = "console.password_file"
    try:
        text = read_secret(path, key)
    except KeyedError as exc:
        raise ConfigError(exc.key, str(exc)) from None
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        name, sep, password = entry.partition(":")
        if not sep or not name or not password:
            # The line itself is not quoted: it holds a password.
            raise ConfigError(key, f"{path}: line {number}: expected name:password")
        if name in users:
            raise ConfigError(key, f"{path}: line {number}: user {name[:60]!r} given twice")
        users[name] = password
    if not users:
        raise ConfigError(key, f"{path}: names no user")
    return users


@dataclass(frozen=True)
class Gate:
    """How this console identifies users, and its CSRF key."""

    mode: str | None  # "basic", "proxy" or None (loopback: the OS user)
    users: Mapping[str, str] = field(default_factory=dict, repr=False)
    header: str | None = None
    local_user: str = ""
    csrf_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    @classmethod
    def from_settings(cls, settings: ConsoleSettings) -> Gate:
        if settings.password_file is not None:
            return cls("basic", users=read_password_file(settings.password_file))
        if settings.proxy_user_header is not None:
            return cls("proxy", header=settings.proxy_user_header)
        return cls(None, local_user=resolve_actor(None))

    def user(self, headers: Mapping[str, str]) -> str:
        """The user a request comes from; `Unauthenticated` if it names none."""
        if self.mode == "basic":
            return self._basic(headers.get("Authorization", ""))
        if self.mode == "proxy":
            assert self.header is not None  # noqa: S101 - the proxy mode names its header
            return _user_name(headers.get(self.header, ""))
        return self.local_user

    def _basic(self, value: str) -> str:
        scheme, _, encoded = value.partition(" ")
        if scheme.lower() != "basic":
            raise Unauthenticated
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise Unauthenticated from None
        name, _, password = decoded.partition(":")
        # Compared whatever the name, so that the time taken does not say which names exist.
        expected = self.users.get(name, "")
        same = hmac.compare_digest(password.encode(), expected.encode())
        if name not in self.users or not same:
            raise Unauthenticated
        return name

    def csrf_token(self, user: str) -> str:
        """The token every form of `user`'s pages carries."""
        return hmac.new(self.csrf_key, user.encode(), hashlib.sha256).hexdigest()

    def csrf_valid(self, user: str, token: str) -> bool:
        return hmac.compare_digest(self.csrf_token(user).encode(), token.encode())


def _user_name(value: str) -> str:
    name = value.strip()
    if not name or len(name) > _MAX_USER_CHARS or CONTROL_CHARS.search(name):
        raise Unauthenticated
    return name
