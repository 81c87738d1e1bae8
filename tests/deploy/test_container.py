"""The Dockerfile's directives and the image's pinned dependencies (no container engine here:
tests/acceptance/test_wheel.py runs what the image runs)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from relayd.sinks.registry import kinds
from tests.deploy import pins
from tests.deploy.dockerfile import directives, env_of, final, stages

IN_IMAGE = "/tmp/constraints.txt"  # noqa: S108 - a path inside the image being built


def test_multi_stage_build_installs_the_built_wheel() -> None:
    """A build stage makes the wheel; the runtime stage copies it from there."""
    all_stages = stages()
    assert len(all_stages) >= 2
    assert all_stages[0][0].arguments.lower().endswith(" as build")
    assert any("build --wheel" in d.arguments for d in all_stages[0] if d.instruction == "RUN")
    copies = [d.arguments for d in final("COPY")]
    assert any(c.startswith("--from=build ") for c in copies)


def test_runtime_dependencies_are_installed_under_the_pinned_constraints() -> None:
    """The runtime stage installs the wheel with `-c` the committed constraints file."""
    copies = [d.arguments.split() for d in final("COPY")]
    assert ["deploy/constraints.txt", IN_IMAGE] in copies
    [install] = [d.arguments for d in final("RUN") if "pip install" in d.arguments]
    assert f"-c {IN_IMAGE}" in install
    assert ".whl" in install
    # Every destination's client, the OpenTelemetry exporter and the console (the pinned
    # extras).
    assert f"[{','.join(pins.IMAGE_EXTRAS)}]" in install
    clients = {settings.extra for settings in kinds().values() if settings.extra is not None}
    assert set(pins.IMAGE_EXTRAS) == clients | {"otel", "console"}


def test_base_image_python_is_the_one_the_constraints_were_made_with() -> None:
    """The pins were resolved on this Python: the image must run the same minor version."""
    [arg] = [d.arguments for d in directives() if d.instruction == "ARG"]
    match = re.fullmatch(r"PYTHON_IMAGE=python:(\d+)\.(\d+)-slim(-\w+)?", arg)
    assert match, arg
    assert (int(match[1]), int(match[2])) == sys.version_info[:2]


def test_runs_as_a_numeric_non_root_user() -> None:
    """USER is numeric uid:gid (Kubernetes' runAsNonRoot can check it), never 0."""
    [user] = [d.arguments for d in final("USER")]
    match = re.fullmatch(r"(\d+)(?::(\d+))?", user)
    assert match, f"USER {user} is not numeric"
    assert int(match[1]) != 0
    assert match[2] is None or int(match[2]) != 0


def test_exec_form_entrypoint_and_command() -> None:
    """ENTRYPOINT ["relayd"] and CMD ["run"], in exec form (signals reach relayd)."""
    [entrypoint] = final("ENTRYPOINT")
    [command] = final("CMD")
    assert json.loads(entrypoint.arguments) == ["relayd"]
    assert json.loads(command.arguments) == ["run"]


def test_healthcheck_asks_relayd_healthcheck() -> None:
    """HEALTHCHECK runs `relayd healthcheck` in exec form."""
    [healthcheck] = final("HEALTHCHECK")
    options, _, command = healthcheck.arguments.partition("CMD ")
    assert "--interval=" in options
    argv = json.loads(command)
    assert argv[:2] == ["relayd", "healthcheck"]


def test_configuration_by_environment_alone() -> None:
    """No RELAYD_CONFIG (it would make a config file mandatory); JSON logs; the endpoints
    listen beyond the container's loopback; no bytecode written at run time."""
    assert not [d for d in directives() if "RELAYD_CONFIG" in d.arguments]
    env = env_of(stages()[-1])
    assert env["RELAYD_LOG__FORMAT"] == "json"
    assert env["RELAYD_HTTP__LISTEN"] == "0.0.0.0:9464"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_constraints_pin_what_the_tests_run_with() -> None:
    """deploy/constraints.txt pins exactly relayd's runtime closure at the installed versions
    (after a deliberate upgrade: `make constraints`)."""
    committed = pins.read()
    installed = pins.runtime_pins()
    if committed != installed:
        pytest.fail(
            "deploy/constraints.txt differs from .venv: "
            f"{sorted(set(committed.items()) ^ set(installed.items()))}; "
            "run `make venv` (installs the pins) or `make constraints` (re-pins)"
        )
    assert pins.CONSTRAINTS.read_text() == pins.render(installed)
