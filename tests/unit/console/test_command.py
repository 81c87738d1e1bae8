"""`relayd console` without its extra: one line naming `relayd[console]` (exit 2, as a sink
kind without its client library)."""

from __future__ import annotations

import importlib.util

import pytest

from relayd.console import command
from relayd.core.errors import ConfigError


def test_the_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jinja2 not importable: a ConfigError naming the console and the extra to install."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "jinja2" else real(name)
    )
    with pytest.raises(ConfigError, match=r"console: .*install relayd\[console\]") as caught:
        command.require_extra()
    assert caught.value.key == "console"
