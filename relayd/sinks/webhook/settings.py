"""`[sink]` with `kind = "webhook"`: Standard Webhooks deliveries over HTTP, to one `url` or
to a URL per event type (`[[sink.routes]]`), signed with the secrets of `secret_file`.

Endpoints come from this configuration only, never from a row. The secrets are read at load
(and followed when the file is rewritten: relayd/config/secret_files.py) and never shown: not in a
repr, a log line or an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, PrivateAttr, field_validator, model_validator

from relayd.config.base import (
    MAX_DURATION_S,
    KeyedError,
    Section,
    read_secret,
    readable_file,
    sink_files_read,
)
from relayd.config.secret_files import SecretFileError, read_secret_file
from relayd.core.errors import ConfigError
from relayd.sinks import RouteType, SinkSettings
from relayd.sinks.http.urls import hidden_parts, redact_url
from relayd.sinks.webhook.signing import SecretsError, SigningKeys, parse_secrets

_MAX_URL_CHARS = 2048


def _no_secret() -> ConfigError:
    return ConfigError(
        "sink.secret_file", "required (a file of whsec_ secrets, one per line, to sign deliveries)"
    )


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


class WebhookRoute(Section):
    """`[[sink.routes]]`: events of `type` are delivered to `url`."""

    type: RouteType
    url: str

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
    credentials: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "secret_file": ("webhook-secret", "secret_file")
    }
    connection_keys: ClassVar[frozenset[str]] = frozenset({"secret_file", "ca_file"})

    _keys: SigningKeys | None = PrivateAttr(default=None)
    _secret_text: str | None = PrivateAttr(default=None)
    _patterns: tuple[re.Pattern[str], ...] = PrivateAttr(default=())

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
        if self.ca_file is not None:
            readable_file(self.ca_file, "sink.ca_file")
        return self

    @property
    def keys(self) -> SigningKeys:
        """The signing keys read from `secret_file` at load; `ConfigError` if none is set."""
        if self._keys is None:
            raise _no_secret()
        return self._keys

    @property
    def secret_path(self) -> Path:
        """`secret_file`; `ConfigError` if it is not set."""
        if self.secret_file is None:
            raise _no_secret()
        return self.secret_file

    @property
    def secret_text(self) -> str:
        """The secret file's text as read at load (the sink follows the file from there)."""
        if self._secret_text is None:
            raise _no_secret()
        return self._secret_text

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
