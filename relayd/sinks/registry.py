"""Sink kinds by name: `[sink] kind` chooses the settings model, and the model builds the
sink. Adding a kind is one line here, beside its module under `relayd/sinks/`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from relayd.config.base import KeyedError
from relayd.sinks import SinkSettings
from relayd.sinks.nats.settings import NatsSettings
from relayd.sinks.ojs.settings import OjsSettings
from relayd.sinks.webhook.settings import WebhookSettings

DEFAULT_KIND = "ojs"

_KINDS: dict[str, type[SinkSettings]] = {
    "ojs": OjsSettings,
    "nats": NatsSettings,
    "webhook": WebhookSettings,
}


def kinds() -> Mapping[str, type[SinkSettings]]:
    """Every registered kind's settings model, by kind."""
    return _KINDS


def default_settings() -> SinkSettings:
    """`[sink]` when the configuration has none: the default kind with its defaults."""
    return _KINDS[DEFAULT_KIND].model_validate({})


def settings_model(kind: object) -> type[SinkSettings]:
    """The settings model of `kind`; a `KeyedError` naming `sink.kind` and the known kinds
    if there is none."""
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        known = ", ".join(repr(name) for name in sorted(_KINDS))
        raise KeyedError("sink.kind", f"unknown sink kind {kind!r} (relayd knows {known})")
    return model


def parse(value: Any) -> Any:
    """`[sink]` as read (a table of keys, or settings already built) validated by its kind's
    model; the default kind when `kind` is absent."""
    if isinstance(value, SinkSettings):
        return value
    if isinstance(value, Mapping):
        return settings_model(value.get("kind", DEFAULT_KIND)).model_validate(dict(value))
    raise KeyedError("sink", "expected a table of keys ([sink])")


@contextlib.contextmanager
def registered(model: type[SinkSettings], kind: str) -> Iterator[None]:
    """`model` registered as `kind` while the block runs: how a test plugs in a sink kind of
    its own without a line in the product."""
    if kind in _KINDS:
        raise ValueError(f"sink kind {kind!r} is already registered")
    _KINDS[kind] = model
    try:
        yield
    finally:
        del _KINDS[kind]
