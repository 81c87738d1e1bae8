"""`[sink]` with `kind = "webhook"`: Standard Webhooks deliveries over HTTP, to one `url` or
to a URL per event type (`[[sink.routes]]`), signed with the secrets of `secret_file`, or of
a route's own `secret_file` (each endpoint its own secrets).

Endpoints come from this configuration only, never from a row. The secrets are read at load
(and followed when a file is rewritten: relayd/config/secret_files.py) and never shown: not in
a repr, a log line or an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, PrivateAttr, field_validator, model_validator

from relayd.config.base import (
    MAX_DURATION_S,
    KeyedError,
    read_secret,
    readable_file,
    sink_files_read,
)
from relayd.config.secret_files import SecretFileError, read_secret_file
from relayd.core.envelope import Envelope
from relayd.core.errors import ConfigError
from relayd.sinks import SinkRoute, SinkSettings
from relayd.sinks.http.urls import hidden_parts, redact_url
from relayd.sinks.webhook.signing import SecretsError, SigningKeys, parse_secrets

_MAX_URL_CHARS = 2048


def _no_secret(unsigned: str | None = None) -> ConfigError:
    reason = "required (a file of whsec_ secrets, one per line, to sign deliveries)"
    if unsigned is not None:
        reason += f": {unsigned} has no secret_file of its own"
    return ConfigError("sink.secret_file", reason)


@dataclass(frozen=True, slots=True)
class SecretFile:
    """One secret file as read at load: the key that names it (`sink.secret_file`,
    `sink.routes.N.secret_file`), its path, and its text (never shown)."""

    key: str
    path: Path
    text: str = field(repr=False)


def _file(path: Path | None) -> str | None:
    """A secret file as compared: the same file written two ways is one."""
    return None if path is None else os.path.abspath(path)


def endpoint_url(value: str) -> str:
    """An endpoint as configured: http(s), a host, no credentials, no fragment."""
    if len(value) > _MAX_URL_CHARS or not value.isprintable() or " " in value:
        raise ValueError(f"expected a URL of at most {_MAX_URL_CHARS} visible characters")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL")
    if parts.username or parts.password:
        raise ValueError("credentials do not belong in the URL; the deliveries are signed")
    if parts.fragment:
        raise ValueError("a URL with a #fragment: a fragment is never sent")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port when it is read
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return value


def _pattern(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    return value


# One of `sink.secret_path_patterns`: a regular expression a whole path segment must match.
SegmentPattern = Annotated[str, AfterValidator(_pattern)]


def check_secret_text(path: Path, text: str) -> str:
    """`text` if it holds usable `whsec_` lines; `SecretFileError` naming the file and line
    otherwise (the check the running sink applies to a rewritten file)."""
    try:
        parse_secrets(text)
    except SecretsError as exc:
        raise SecretFileError(f"{path} {exc}") from None
    return text


def read_secrets_file(path: Path) -> str:
    """The text of a webhook secret file, checked (`check_secret_text`)."""
    return check_secret_text(path, read_secret_file(path))


class WebhookRoute(SinkRoute):
    """`[[sink.routes]]`: events of `type` are delivered to `url`, signed with the secrets of
    `secret_file` (None: those of `sink.secret_file`)."""

    url: str
    secret_file: Path | None = None

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        return endpoint_url(value)


class WebhookSettings(SinkSettings):
    kind: Literal["webhook"] = "webhook"
    # Where events of a type without a route go; None: such an event is dead-lettered
    # `no_route`.
    url: str | None = None
    routes: tuple[WebhookRoute, ...] = ()
    secret_file: Path | None = None
    # A CA bundle for endpoints whose certificates a private PKI signs; TLS is verified
    # either way.
    ca_file: Path | None = None
    connect_timeout_s: float = Field(default=3.0, gt=0, le=MAX_DURATION_S)
    # Path segments hidden wherever relayd shows an endpoint (logs, last_error, a pause's
    # reason, `relayd status`, `relayd check`): regular expressions, each matching a whole
    # segment, besides the segments that look like a secret and the query string, which are
    # always hidden (relayd/sinks/http/urls.py).
    secret_path_patterns: tuple[SegmentPattern, ...] = ()

    sink_class: ClassVar[str] = "relayd.sinks.webhook.sink:WebhookSink"
    demo: ClassVar[str | None] = "relayd.demo.webhook:WebhookDemo"
    example: ClassVar[str | None] = "examples/webhook.toml"
    credentials: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "secret_file": ("webhook-secret", "secret_file")
    }
    connection_keys: ClassVar[frozenset[str]] = frozenset({"secret_file", "ca_file"})

    _keys: SigningKeys | None = PrivateAttr(default=None)
    _secret_text: str | None = PrivateAttr(default=None)
    # Each route's own secret file as read at load, by route index.
    _route_secrets: dict[int, SecretFile] = PrivateAttr(default_factory=dict)
    _patterns: tuple[re.Pattern[str], ...] = PrivateAttr(default=())

    def route_of(self, envelope: Envelope) -> SinkRoute | None:
        """The route of the event's type (the first, as the sink chooses it)."""
        return next((route for route in self.routes if route.type == envelope.type), None)

    @classmethod
    def without_connection_keys(cls, table: Mapping[str, object]) -> dict[str, object]:
        """As for every kind, and each route's own `secret_file` too."""
        kept = super().without_connection_keys(table)
        routes = kept.get("routes")
        if isinstance(routes, list | tuple):
            kept["routes"] = [
                {key: value for key, value in route.items() if key != "secret_file"}
                if isinstance(route, Mapping)
                else route
                for route in routes
            ]
        return kept

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        return None if value is None else endpoint_url(value)

    @field_validator("routes", "secret_path_patterns", mode="before")
    @classmethod
    def _array_from_text(cls, value: object) -> object:
        # The environment gives text: a JSON array (of {"type", "url"}, of patterns).
        if not isinstance(value, str):
            return value
        try:
            routes = json.loads(value)
        except ValueError:
            raise ValueError("expected a JSON array") from None
        if not isinstance(routes, list):
            raise ValueError("expected a JSON array")
        return routes

    @model_validator(mode="after")
    def _one_route_per_type(self) -> WebhookSettings:
        seen: dict[str, int] = {}
        for index, route in enumerate(self.routes):
            if route.type in seen:
                raise KeyedError(
                    f"sink.routes.{index}",
                    f"a second route for type {route.type!r} (the first is "
                    f"sink.routes.{seen[route.type]})",
                )
            seen[route.type] = index
        return self

    @model_validator(mode="after")
    def _one_secret_per_endpoint(self) -> WebhookSettings:
        # An endpoint verifies one set of secrets: every route to a URL (and sink.url) must
        # sign with the same file, or a receiver would refuse some of its deliveries.
        signer: dict[str, tuple[str, str | None]] = {}
        if self.url is not None:
            signer[self.url] = ("sink.url", _file(self.secret_file))
        for index, route in enumerate(self.routes):
            path = _file(route.secret_file or self.secret_file)
            first = signer.setdefault(route.url, (f"sink.routes.{index}", path))
            if first[1] != path:
                raise KeyedError(
                    f"sink.routes.{index}.secret_file",
                    f"its url is also {first[0]}'s, signed with another secret file "
                    "(an endpoint verifies one set of secrets)",
                )
        return self

    @model_validator(mode="after")
    def _compile_patterns(self) -> WebhookSettings:
        self._patterns = tuple(re.compile(pattern) for pattern in self.secret_path_patterns)
        return self

    @model_validator(mode="after")
    def _read_files(self) -> WebhookSettings:
        # Read while validating, so that any WebhookSettings, however built, is complete.
        if not sink_files_read():
            return self  # an operator command: it never talks to the sink
        if self.secret_file is not None:
            text = read_secret(self.secret_file, "sink.secret_file", read=read_secrets_file)
            self._secret_text = text
            self._keys = parse_secrets(text)
        for index, route in enumerate(self.routes):
            if route.secret_file is not None:
                key = f"sink.routes.{index}.secret_file"
                text = read_secret(route.secret_file, key, read=read_secrets_file)
                self._route_secrets[index] = SecretFile(key, route.secret_file, text)
        if self.ca_file is not None:
            readable_file(self.ca_file, "sink.ca_file")
        return self

    @property
    def keys(self) -> SigningKeys:
        """The signing keys read from `secret_file` at load; `ConfigError` if none is set."""
        if self._keys is None:
            raise _no_secret()
        return self._keys

    def signing(self) -> dict[str, SecretFile]:
        """The secret file each endpoint is signed with, by URL, as read at load (the sink
        follows each file from there): a route's own `secret_file`, else `sink.secret_file`.
        `ConfigError` naming `sink.secret_file` if an endpoint has neither."""
        shared = None
        if self.secret_file is not None and self._secret_text is not None:
            shared = SecretFile("sink.secret_file", self.secret_file, self._secret_text)
        files: dict[str, SecretFile] = {}
        if self.url is not None:
            if shared is None:
                raise _no_secret("sink.url")
            files[self.url] = shared
        for index, route in enumerate(self.routes):
            own = self._route_secrets.get(index, shared)
            if own is None:
                raise _no_secret(f"sink.routes.{index}")
            files.setdefault(route.url, own)
        return files

    @property
    def endpoints(self) -> dict[str, str]:
        """The URL of each routed type."""
        return {route.type: route.url for route in self.routes}

    @property
    def urls(self) -> list[str]:
        """Every endpoint, once, sorted."""
        return sorted({route.url for route in self.routes} | ({self.url} if self.url else set()))

    def shown(self, url: str) -> str:
        """An endpoint as relayd shows it, its secret-looking parts hidden (`redact_url`)."""
        return redact_url(url, self._patterns)

    @property
    def hidden(self) -> tuple[str, ...]:
        """What `shown` hides of every endpoint, longest first: a receiver's answer that
        echoes its URL is cleaned of these before any of it is kept."""
        parts = {part for url in self.urls for part in hidden_parts(url, self._patterns)}
        return tuple(sorted(parts, key=len, reverse=True))

    @property
    def target(self) -> str:
        if self.url is None and not self.routes:
            raise ConfigError(
                "sink.url",
                "required: the receiver's URL, or [[sink.routes]] (type and url) per type",
            )
        return ", ".join(self.shown(url) for url in self.urls)
