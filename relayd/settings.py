"""Settings: a TOML file, `RELAYD_<SECTION>__<KEY>` environment overrides, secrets from files.

Precedence, highest first: environment, TOML file, defaults. Secrets (`database.dsn`,
the sink token) never appear in a repr, a log or an error; `redacted()` is what
`relayd config show` prints. Every failure becomes one `ConfigError` naming the key.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from relayd.config.base import KeyedError, sink_files_unread
from relayd.config.console import ConsoleSettings
from relayd.config.dsn import redact_dsn
from relayd.config.sections import (
    CleanupSettings,
    DatabaseSettings,
    HttpSettings,
    LogSettings,
    MetricsSettings,
    OutboxSettings,
    RelaySettings,
    RetrySettings,
)
from relayd.core.errors import ConfigError
from relayd.core.retry import retry_horizon_s
from relayd.sinks import SinkSettings, registry

DEFAULT_CONFIG_PATH = Path("/etc/relayd/config.toml")
ENV_PREFIX = "RELAYD_"
CONFIG_ENV_VAR = f"{ENV_PREFIX}CONFIG"
# Reserved for relayd's own test suite (its database, its fault injection): relayd refuses
# every other RELAYD_* variable that names no setting.
TEST_ENV_PREFIX = f"{ENV_PREFIX}TEST_"
# systemd credentials (LoadCredential=, LoadCredentialEncrypted=): a secret whose settings are
# all unset is read from $CREDENTIALS_DIRECTORY/<name> when the unit passed that credential.
# systemd sets the variable to the unit's own directory, so a renamed or templated unit works.
CREDENTIALS_ENV_VAR = "CREDENTIALS_DIRECTORY"
# (section, the *_file key to fill): the credential's name, then every key that must be unset.
# The sink's come from its kind's settings model (`SinkSettings.credentials`).
CREDENTIALS: dict[tuple[str, str], tuple[str, ...]] = {
    ("database", "dsn_file"): ("database-dsn", "dsn", "dsn_file"),
}

# The TOML document of the current load_settings() call, read by _TomlSource.
_toml_data: ContextVar[dict[str, Any] | None] = ContextVar("relayd_toml_data", default=None)


class _TomlSource(PydanticBaseSettingsSource):
    """The already-parsed TOML file, below the environment in precedence."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_toml_data.get() or {})


class Settings(BaseSettings):
    """The whole configuration of one relayd process."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        case_sensitive=False,
        extra="forbid",
        frozen=True,
    )

    database: DatabaseSettings = DatabaseSettings()
    outbox: OutboxSettings = OutboxSettings()
    # One model per sink kind (relayd/sinks/registry.py), chosen by `kind`.
    sink: SerializeAsAny[SinkSettings] = Field(default_factory=registry.default_settings)
    relay: RelaySettings = RelaySettings()
    retry: RetrySettings = RetrySettings()
    http: HttpSettings = HttpSettings()
    log: LogSettings = LogSettings()
    cleanup: CleanupSettings = CleanupSettings()
    metrics: MetricsSettings = MetricsSettings()
    console: ConsoleSettings = ConsoleSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _TomlSource(settings_cls))

    @field_validator("sink", mode="before")
    @classmethod
    def _sink_of_its_kind(cls, value: Any) -> Any:
        return sink_settings(value)

    @model_validator(mode="before")
    @classmethod
    def _systemd_credentials(cls, data: Any) -> Any:
        return with_credentials(data, os.environ) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Settings:
        # A lease must outlive the attempt it covers with room to settle, or a slow but
        # successful attempt would routinely race a second owner (C4).
        if self.relay.lease_s <= 2 * self.sink.timeout_s:
            raise KeyedError(
                "relay.lease_s",
                f"must be greater than 2 x sink.timeout_s ({2 * self.sink.timeout_s:g})",
            )
        self.sink.plan_retries(
            retry_horizon_s(
                base_s=self.retry.base_s,
                cap_s=self.retry.cap_s,
                max_attempts=self.retry.max_attempts,
                lease_s=self.relay.lease_s,
                timeout_s=self.sink.timeout_s,
            )
        )
        return self

    @property
    def dsn(self) -> str:
        """The database DSN; `ConfigError` if none is configured."""
        dsn = self.database.resolved_dsn
        if dsn is None:
            raise ConfigError("database.dsn", "required (set database.dsn or database.dsn_file)")
        return dsn.get_secret_value()

    @property
    def listens(self) -> bool:
        """Whether `relayd run` LISTENs for the insert trigger's NOTIFY: not when LISTEN is
        turned off (a pooler) or when the outbox has no such trigger (nothing would come)."""
        return self.relay.listen and self.outbox.notify_trigger

    def redacted(self) -> dict[str, Any]:
        """Every setting as plain data: a secret read from a file appears as the file's path
        alone, an inline DSN with its password replaced by `***`."""
        data = self.model_dump(mode="json")
        if self.database.dsn is not None:
            data["database"]["dsn"] = redact_dsn(self.database.dsn.get_secret_value())
        return data


def with_credentials(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """`data` (settings as sections of keys) with each unset secret pointed at its systemd
    credential, where `$CREDENTIALS_DIRECTORY` holds one (see CREDENTIALS)."""
    directory = environ.get(CREDENTIALS_ENV_VAR)
    if not directory:
        return data
    for (section, key), (name, *unset) in _credentials(data).items():
        values = data.get(section)
        if values is None:
            values = {}
        if not isinstance(values, dict) or any(values.get(k) is not None for k in unset):
            continue  # set explicitly (or a section object built by the caller)
        path = Path(directory) / name
        if path.is_file():
            data = data | {section: values | {key: str(path)}}
    return data


def _credentials(data: Mapping[str, Any]) -> dict[tuple[str, str], tuple[str, ...]]:
    """CREDENTIALS, and those of the configured sink kind (none if the kind is unknown:
    validation says so)."""
    sink = data.get("sink") or {}
    kind = sink.get("kind", registry.DEFAULT_KIND) if isinstance(sink, Mapping) else None
    model = registry.kinds().get(kind) if isinstance(kind, str) else None
    if model is None:
        return CREDENTIALS
    return CREDENTIALS | {("sink", key): value for key, value in model.credentials.items()}


def sink_settings(value: Any) -> Any:
    """`[sink]` validated by its kind's model (`registry.parse`), its first error named by
    key as a `KeyedError`."""
    try:
        return registry.parse(value)
    except ValidationError as exc:
        raise _sink_error(exc, value) from None


def _sink_error(exc: ValidationError, value: Any) -> KeyedError:
    error = exc.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, KeyedError):
        return cause
    key = ".".join(("sink", *(str(part) for part in error["loc"])))
    if error["type"] == "extra_forbidden":
        name = str(error["loc"][-1])
        kind = value.get("kind", registry.DEFAULT_KIND) if isinstance(value, Mapping) else None
        owners = [k for k, model in registry.kinds().items() if name in model.model_fields]
        if owners:
            return KeyedError(key, f"unknown key for sink kind {kind!r} (a key of {owners[0]!r})")
        return KeyedError(key, "unknown key")
    message = str(cause) if isinstance(cause, ValueError) else error["msg"]
    return KeyedError(key, message.removeprefix("Value error, "))


def resolve_config_path(
    explicit: str | Path | None, environ: Mapping[str, str] | None = None
) -> tuple[Path, bool]:
    """The config file to read and whether it was asked for (a missing one is then an error)."""
    environ = os.environ if environ is None else environ
    if explicit is not None:
        return Path(explicit), True
    from_env = environ.get(CONFIG_ENV_VAR)
    if from_env:
        return Path(from_env), True
    return DEFAULT_CONFIG_PATH, False


def describe_config_source(explicit: str | Path | None = None) -> str:
    """Which file `load_settings(explicit)` reads, for `relayd config show`."""
    path, _required = resolve_config_path(explicit)
    if path.is_file():
        return f"configuration file: {path}"
    return f"no configuration file at {path}: defaults and environment only"


def example_kinds() -> list[str]:
    """The kinds with an example configuration (`SinkSettings.example`): the default kind's
    documents every section, the others their own [sink] (and [database])."""
    return sorted(kind for kind, model in registry.kinds().items() if model.example)


def example_config(kind: str = registry.DEFAULT_KIND) -> str:
    """The shipped example configuration of `kind`: inside the installed wheel, else the
    checkout's."""
    name = registry.kinds()[kind].example
    if name is None:
        raise ConfigError("--kind", f"sink kind {kind!r} has no example configuration")
    packaged = resources.files("relayd").joinpath(name)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / name).read_text(encoding="utf-8")


def to_toml(
    data: dict[str, dict[str, Any]], withheld: dict[tuple[str, str], str] | None = None
) -> str:
    """Render the (flat, two-level) settings as TOML that loads back as the same values;
    unset keys, and the `withheld` ones (with the reason), become comments."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            reason = (withheld or {}).get((section, key))
            if value is None:
                lines.append(f"# {key} = (unset)")
            elif reason is not None:
                lines.append(f"# {key} = {_toml_value(value)}  ({reason})")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):  # sink.servers; sink.routes as inline tables
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        pairs = (f"{key} = {_toml_value(item)}" for key, item in value.items() if item is not None)
        return "{" + ", ".join(pairs) + "}"
    # A TOML basic string: JSON's escapes are TOML's too, but TOML refuses the surrogate
    # pairs JSON writes outside the BMP (so no ensure_ascii), and wants DEL escaped.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def load_settings(path: str | Path | None = None, *, sink_files: bool = True) -> Settings:
    """Load, validate and read the secret files; raise `ConfigError` naming the offending key.
    `sink_files=False`: the sink's files (its credentials, a CA bundle) are not read, for a
    command that never talks to the sink (the settings then cannot build one).

    The environment is read from `os.environ` (pydantic-settings' env source).
    """
    _check_environment(os.environ)
    config_path, required = resolve_config_path(path)
    data = _read_toml(config_path, required=required)
    token = _toml_data.set(data)
    try:
        if sink_files:
            return _validate()
        with sink_files_unread():
            return _validate()
    finally:
        _toml_data.reset(token)


def load_producer_sections(path: str | Path) -> tuple[OutboxSettings, SinkSettings]:
    """The `[outbox]` and `[sink]` sections of the daemon's configuration file, for a
    producer that checks its events against the same table, bound and routes: the file alone
    (the daemon's environment is its own), and the sink's connection keys (credentials, a CA
    bundle) dropped unread, since a producer neither has nor needs them. `ConfigError`
    naming the key, as `load_settings`."""
    data = _read_toml(Path(path), required=True)
    try:
        outbox = OutboxSettings.model_validate(data.get("outbox", {}))
    except ValidationError as exc:
        raise _config_error(exc, section="outbox") from None
    sink = data.get("sink", {})
    if isinstance(sink, Mapping):
        model = registry.kinds().get(sink.get("kind", registry.DEFAULT_KIND))
        if model is not None:
            sink = model.without_connection_keys(sink)
    return outbox, sink_section(sink)


def sink_section(value: object) -> SinkSettings:
    """`[sink]` given as a table of keys, validated by its kind's model; `ConfigError` naming
    the key, as `load_settings`."""
    try:
        settings: SinkSettings = sink_settings(value)
    except KeyedError as exc:
        raise ConfigError(exc.key, str(exc)) from None
    return settings


def _check_environment(environ: Mapping[str, str]) -> None:
    """Refuse every `RELAYD_*` variable that is neither a setting nor `RELAYD_CONFIG`.

    pydantic-settings ignores a variable that names no setting, so a typo (one underscore in
    `RELAYD_RELAY_WORKERS`) would leave the setting at its default without a word. Names are
    matched case-insensitively, as pydantic-settings reads them. `RELAYD_TEST_*` is reserved
    for relayd's own test suite (docs/configure.md) and left alone.
    """
    # The sink's keys are those of every kind: which one applies is known after the merge,
    # and a key of another kind is refused there, naming its kind.
    sink_keys = {key for model in registry.kinds().values() for key in model.model_fields}
    known = [CONFIG_ENV_VAR] + [
        f"{ENV_PREFIX}{section}__{key}".upper()
        for section, field_info in Settings.model_fields.items()
        for key in (
            sink_keys if section == "sink" else getattr(field_info.annotation, "model_fields", {})
        )
    ]
    for name in environ:
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper.startswith(TEST_ENV_PREFIX) or upper in known:
            continue
        close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            name,
            f"not a setting ({hint}relayd reads {CONFIG_ENV_VAR} and {ENV_PREFIX}<SECTION>__<KEY>, "
            f"sections: {', '.join(Settings.model_fields)})",
        )


def _read_toml(path: Path, *, required: bool) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        if required:
            raise ConfigError("config", f"file not found: {path}") from None
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None


def _validate() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise _config_error(exc) from None


def _config_error(exc: ValidationError, *, section: str | None = None) -> ConfigError:
    """The first error, naming its key (within `section` when one section was validated)."""
    error = exc.errors()[0]
    context = error.get("ctx") or {}
    cause = context.get("error")
    if isinstance(cause, KeyedError):
        return ConfigError(cause.key, str(cause))
    parts = [section] if section else []
    key = ".".join([*parts, *(str(part) for part in error["loc"])]) or "config"
    if error["type"] == "extra_forbidden":
        return ConfigError(key, "unknown key")
    message = str(cause) if isinstance(cause, ValueError) else error["msg"]
    return ConfigError(key, message.removeprefix("Value error, "))
