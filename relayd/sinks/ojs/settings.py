"""`[sink]` with `kind = "ojs"` (the default): an Open Job Spec server over HTTP."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from relayd.config.base import MAX_DURATION_S, read_secret, readable_file, sink_files_read
from relayd.config.secret_files import read_token_file
from relayd.core.errors import ConfigError
from relayd.sinks import SinkSettings


class OjsSettings(SinkSettings):
    kind: Literal["ojs"] = "ojs"
    url: str | None = None
    token_file: Path | None = None
    ca_file: Path | None = None
    connect_timeout_s: float = Field(default=3.0, gt=0, le=MAX_DURATION_S)
    batch: Literal["auto", "on", "off"] = "auto"
    batch_max_jobs: int = Field(default=100, ge=1, le=1000)
    batch_max_bytes: int = Field(default=900 * 1024, ge=1024)

    sink_class: ClassVar[str] = "relayd.sinks.ojs.sink:OjsSink"
    demo: ClassVar[str | None] = "relayd.demo.ojs:OjsDemo"
    example: ClassVar[str | None] = "config.example.toml"
    credentials: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "token_file": ("ojs-token", "token_file")
    }
    connection_keys: ClassVar[frozenset[str]] = frozenset({"token_file", "ca_file"})

    _token: SecretStr | None = PrivateAttr(default=None)

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// base URL")
        if parts.username or parts.password:
            raise ValueError("credentials do not belong in the URL; use sink.token_file")
        return value.rstrip("/")

    @field_validator("batch", mode="before")
    @classmethod
    def _batch_bool(cls, value: object) -> object:
        # TOML and the environment may say true/false for on/off.
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return "on" if value.lower() == "true" else "off"
        return value

    @model_validator(mode="after")
    def _read_files(self) -> OjsSettings:
        # Read while validating, so that any OjsSettings, however built, is complete.
        if not sink_files_read():
            return self  # an operator command: it never talks to the sink
        if self.token_file is not None:
            # Checked as a rotated file is: a token that cannot be a header value is refused.
            token = read_secret(self.token_file, "sink.token_file", read=read_token_file)
            self._token = SecretStr(token)
        if self.ca_file is not None:
            readable_file(self.ca_file, "sink.ca_file")
        return self

    @property
    def token(self) -> SecretStr | None:
        """The bearer token read from `token_file` at load, if one is configured (the sink
        follows the file from there: relayd/config/secret_files.py)."""
        return self._token

    @property
    def base_url(self) -> str:
        """The OJS base URL; `ConfigError` if none is configured."""
        if self.url is None:
            raise ConfigError("sink.url", "required (the OJS server's base URL)")
        return self.url

    @property
    def target(self) -> str:
        return self.base_url
