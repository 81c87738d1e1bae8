"""`[sink]` with `kind = "nats"`: a NATS JetStream stream, each event type routed to a
subject (`[[sink.routes]]`). Credentials come from files, one method at most; secrets are
read at load and never shown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from relayd.config.base import (
    MAX_DURATION_S,
    KeyedError,
    read_secret,
    readable_file,
    sink_files_read,
)
from relayd.config.secret_files import read_token_file
from relayd.core.envelope import Envelope
from relayd.core.errors import ConfigError
from relayd.core.outcomes import DeadLetter
from relayd.sinks import SinkRoute, SinkSettings
from relayd.sinks.nats.message import (
    ID_TOKEN,
    KEY_TOKEN,
    TOKEN_CHARS,
    Route,
    Routes,
    message_for,
)

# A publish subject: dot-separated tokens of visible ASCII, no wildcard. A stream name: one
# token of the same characters, no path separator (the server refuses them).
_TOKEN = TOKEN_CHARS
_STREAM_CHARS = _TOKEN - {"/", "\\"}
_MAX_SUBJECT_CHARS = 1024
_MAX_STREAM_CHARS = 255
_MAX_SOURCE_CHARS = 1024
# A user NKey seed: base32 of a prefixed 32-byte seed and a checksum, starting "SU".
_USER_SEED = re.compile(r"^SU[A-Z2-7]{56}$")
_CREDS_SECTIONS = ("-----BEGIN NATS USER JWT-----", "-----BEGIN USER NKEY SEED-----")
# Each way to authenticate, as the keys that configure it.
_METHODS = (("user", "password_file"), ("token_file",), ("nkey_seed_file",), ("creds_file",))
_ALL_FILES = ("password_file", "token_file", "nkey_seed_file", "creds_file")


def _json_array(text: str) -> list[object]:
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError("expected a JSON array") from None
    if not isinstance(value, list):
        raise ValueError("expected a JSON array")
    return value


class NatsRoute(SinkRoute):
    """`[[sink.routes]]`: events of `type` (and of `version`, if set) go to `subject`."""

    subject: str
    version: int | None = Field(default=None, ge=1)

    @field_validator("subject")
    @classmethod
    def _valid_subject(cls, value: str) -> str:
        tokens = value.split(".")
        if len(value) > _MAX_SUBJECT_CHARS or not all(
            token and _TOKEN.issuperset(token) for token in tokens
        ):
            raise ValueError(
                "expected a subject to publish to: dot-separated tokens of visible ASCII, "
                "without the wildcards * and >"
            )
        return value


class NatsSettings(SinkSettings):
    kind: Literal["nats"] = "nats"
    servers: tuple[str, ...] = ()
    stream: str | None = None
    routes: tuple[NatsRoute, ...] = ()
    # The CloudEvents `source` of every event (ce-source): who produced it.
    source: str = "relayd"
    user: str | None = None
    password_file: Path | None = None
    token_file: Path | None = None
    nkey_seed_file: Path | None = None
    creds_file: Path | None = None
    ca_file: Path | None = None
    connect_timeout_s: float = Field(default=3.0, gt=0, le=MAX_DURATION_S)
    # A body (the event's data) larger than this is dead-lettered `too_large` unsent; it may
    # not exceed the server's max_payload (checked when connecting).
    max_payload_bytes: int = Field(default=1024 * 1024, ge=1)
    # An ambiguous row of a route in window mode whose first store may have left the
    # stream's duplicate window: re-sent anyway (a possible duplicate, logged and counted)
    # or dead-lettered `past_window` for an operator, whose redrive (`relayd dlq retry`) sends
    # it once whatever this says (docs/nats.md#deduplication).
    past_window: Literal["resend", "dead_letter"] = "resend"
    # Where atomic-marker mode puts each event's marker: `<marker_prefix>.<event id>`.
    marker_prefix: str = "relayd.markers"

    sink_class: ClassVar[str] = "relayd.sinks.nats.sink:NatsSink"
    # nats-py, and the NKey signatures it needs for nkey_seed_file and creds_file.
    client_modules: ClassVar[tuple[str, ...]] = ("nats", "nkeys")
    extra: ClassVar[str | None] = "nats"
    demo: ClassVar[str | None] = "relayd.demo.nats:NatsDemo"
    example: ClassVar[str | None] = "examples/nats.toml"
    # Tried in this order; a credential is used only while no method is configured.
    credentials: ClassVar[Mapping[str, tuple[str, ...]]] = {
        key: (f"nats-{key.removesuffix('_file').replace('_', '-')}", *_ALL_FILES)
        for key in ("creds_file", "nkey_seed_file", "token_file", "password_file")
    }
    connection_keys: ClassVar[frozenset[str]] = frozenset({"user", *_ALL_FILES, "ca_file"})

    _password: SecretStr | None = PrivateAttr(default=None)
    _token: SecretStr | None = PrivateAttr(default=None)
    _routes: Routes | None = PrivateAttr(default=None)

    @field_validator("servers", mode="before")
    @classmethod
    def _servers_from_text(cls, value: object) -> object:
        # The environment gives text: a JSON array, or URLs separated by commas.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return _json_array(value)
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("routes", mode="before")
    @classmethod
    def _routes_from_text(cls, value: object) -> object:
        # The environment gives text: a JSON array of {"type", "subject", "version"}.
        return _json_array(value) if isinstance(value, str) else value

    @field_validator("servers")
    @classmethod
    def _valid_servers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for server in value:
            parts = urlsplit(server)
            if parts.scheme not in ("nats", "tls") or not parts.hostname:
                raise ValueError(f"expected nats://host:port or tls://host:port, got {server!r}")
            if parts.username or parts.password:
                raise ValueError(
                    "credentials do not belong in a server URL; use sink.user and "
                    "sink.password_file, sink.token_file, sink.nkey_seed_file or sink.creds_file"
                )
            try:
                parts.port  # noqa: B018 - urlsplit checks the port when it is read
            except ValueError as exc:
                raise ValueError(f"{server!r}: {exc}") from None
        return value

    @field_validator("marker_prefix")
    @classmethod
    def _valid_marker_prefix(cls, value: str) -> str:
        tokens = value.split(".")
        if len(value) > _MAX_SUBJECT_CHARS // 2 or not all(
            token and _TOKEN.issuperset(token) for token in tokens
        ):
            raise ValueError(
                "expected a subject prefix: dot-separated tokens of visible ASCII, without "
                "the wildcards * and >"
            )
        return value

    @field_validator("stream")
    @classmethod
    def _valid_stream(cls, value: str | None) -> str | None:
        if value is not None and (
            not 0 < len(value) <= _MAX_STREAM_CHARS or not _STREAM_CHARS.issuperset(value)
        ):
            raise ValueError(
                "expected a stream name: visible ASCII without '.', '*', '>', '/' or '\\'"
            )
        return value

    @field_validator("source")
    @classmethod
    def _valid_source(cls, value: str) -> str:
        if not value or len(value) > _MAX_SOURCE_CHARS or not value.isprintable():
            raise ValueError(f"expected a URI reference of 1 to {_MAX_SOURCE_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _one_route_per_type_and_version(self) -> NatsSettings:
        seen: dict[tuple[str, int | None], int] = {}
        for index, route in enumerate(self.routes):
            key = (route.type, route.version)
            if key in seen:
                which = "every version" if route.version is None else f"version {route.version}"
                raise KeyedError(
                    f"sink.routes.{index}",
                    f"a second route for type {route.type!r}, {which} "
                    f"(the first is sink.routes.{seen[key]})",
                )
            seen[key] = index
        return self

    @model_validator(mode="after")
    def _key_in_ordered_subjects_only(self) -> NatsSettings:
        # `{key}` names the subject of one key: only an ordered route's rows carry one, and
        # a subject holding the event id too would hold one message, nothing to fence.
        for index, route in enumerate(self.routes):
            tokens = route.subject.split(".")
            if KEY_TOKEN not in tokens:
                continue
            if ID_TOKEN in tokens:
                raise KeyedError(
                    f"sink.routes.{index}.subject",
                    f"{ID_TOKEN} and {KEY_TOKEN} in one subject: give the key its subject "
                    f"({KEY_TOKEN}) or the event its own ({ID_TOKEN}), not both",
                )
            if (route.ordering or self.ordering) != "key":
                raise KeyedError(
                    f"sink.routes.{index}.subject",
                    f'{KEY_TOKEN} needs an ordered route (ordering = "key", on the route or '
                    "the sink): only an ordered route's rows carry an ordering key",
                )
        return self

    @model_validator(mode="after")
    def _one_credential_method(self) -> NatsSettings:
        if self.user is not None and self.password_file is None:
            raise KeyedError("sink.password_file", "required with sink.user")
        if self.password_file is not None and self.user is None:
            raise KeyedError("sink.user", "required with sink.password_file")
        configured = [keys for keys in _METHODS if getattr(self, keys[0]) is not None]
        if len(configured) > 1:
            first, second = configured[0][-1], configured[1][-1]
            raise KeyedError(
                f"sink.{second}",
                f"one credential method at most: sink.{first} is set too",
            )
        return self

    @model_validator(mode="after")
    def _read_files(self) -> NatsSettings:
        # Read while validating, so that any NatsSettings, however built, is complete.
        if not sink_files_read():
            return self  # an operator command: it never talks to the sink
        if self.password_file is not None:
            password = read_secret(self.password_file, "sink.password_file")
            self._password = SecretStr(password)
        if self.token_file is not None:
            token = read_secret(self.token_file, "sink.token_file", read=read_token_file)
            self._token = SecretStr(token)
        if self.nkey_seed_file is not None:
            seed = read_secret(self.nkey_seed_file, "sink.nkey_seed_file")
            if not _USER_SEED.match(seed):
                raise KeyedError(
                    "sink.nkey_seed_file",
                    f"{self.nkey_seed_file} does not hold a user NKey seed (one line, SU...)",
                )
        if self.creds_file is not None:
            creds = read_secret(self.creds_file, "sink.creds_file")
            if not all(section in creds for section in _CREDS_SECTIONS):
                raise KeyedError(
                    "sink.creds_file",
                    f"{self.creds_file} is not a NATS credentials file (a user JWT and an "
                    "NKey seed, as `nsc generate creds` writes)",
                )
        if self.ca_file is not None:
            readable_file(self.ca_file, "sink.ca_file")
        return self

    @property
    def password(self) -> SecretStr | None:
        """The password read from `password_file` at load."""
        return self._password

    @property
    def token(self) -> SecretStr | None:
        """The token read from `token_file` at load."""
        return self._token

    @property
    def stream_name(self) -> str:
        """The stream; `ConfigError` if none is configured."""
        if self.stream is None:
            raise ConfigError("sink.stream", "required (the JetStream stream events go to)")
        return self.stream

    @property
    def target(self) -> str:
        if not self.servers:
            raise ConfigError("sink.servers", "required (the NATS servers' URLs)")
        return f"{', '.join(self.servers)} stream {self.stream_name}"

    def route_table(self) -> Routes:
        """The routes as the sink looks them up (built once); producers check their events
        against the same table (`refuses`)."""
        if self._routes is None:
            self._routes = Routes(
                [Route(route.type, route.subject, route.version) for route in self.routes]
            )
        return self._routes

    def route_of(self, envelope: Envelope) -> SinkRoute | None:
        """The route of the event's type and version, as `Routes.subject` chooses it."""
        version = envelope.meta.get("version")
        exact = generic = None
        for route in self.routes:
            if route.type == envelope.type:
                if route.version is None:
                    generic = generic or route
                elif route.version == version:
                    exact = exact or route
        return exact or generic

    def refuses(self, envelope: Envelope, key: str | None = None) -> DeadLetter | None:
        """The sink's own verdict on the envelope and its ordering key, as `message_for`
        gives it: not an event, no route for its type and version, data over
        `max_payload_bytes`, a key that cannot stand for `{key}` in its route's subject."""
        message = message_for(
            envelope,
            self.route_table(),
            stream=self.stream or "",
            source=self.source,
            max_body_bytes=self.max_payload_bytes,
            key=key,
        )
        return message if isinstance(message, DeadLetter) else None

    def require_routes(self) -> None:
        """`ConfigError` unless at least one route is configured: without one, every event
        would be dead-lettered."""
        if not self.routes:
            raise ConfigError(
                "sink.routes",
                "required: at least one [[sink.routes]] (type and subject)",
            )
