"""The sink registry: every kind's sink class resolves, each kind's settings build its sink,
and `[sink]` is validated by the model of its kind."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from relayd.settings import Settings
from relayd.sinks import SinkSettings, registry
from relayd.sinks.ojs.settings import OjsSettings


@pytest.mark.parametrize("kind", sorted(registry.kinds()))
def test_every_kind_names_a_sink_class_that_exists(kind: str) -> None:
    model = registry.kinds()[kind]
    assert issubclass(model, SinkSettings)
    assert model.model_fields["kind"].default == kind
    module, _, name = model.sink_class.partition(":")
    assert isinstance(getattr(importlib.import_module(module), name), type)


def test_the_default_kind_is_ojs_with_or_without_a_sink_section() -> None:
    assert isinstance(Settings().sink, OjsSettings)
    assert isinstance(Settings(sink={"url": "http://a:1"}).sink, OjsSettings)
    sink = Settings(sink={"kind": "ojs", "batch": False}).sink
    assert isinstance(sink, OjsSettings)
    assert sink.batch == "off"


def test_loading_the_configuration_imports_no_transport() -> None:
    """The sink class is imported when a sink is built, not when settings are loaded: the
    operator commands never pay for an HTTP client."""
    code = (
        "import sys; from relayd.settings import Settings; "
        "Settings(sink={'url': 'http://a:1'}); "
        "assert 'aiohttp' not in sys.modules and 'relayd.sinks.ojs.sink' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
