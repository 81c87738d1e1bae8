"""The Dockerfile read as directives, by build stage (enough for the tests' checks)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from tests.deploy.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True)
class Directive:
    instruction: str
    arguments: str


def directives() -> list[Directive]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    found: list[Directive] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        instruction, _, arguments = text.partition(" ")
        found.append(Directive(instruction.upper(), arguments.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return found


def stages() -> list[list[Directive]]:
    """Directives by build stage (each starts with its FROM)."""
    result: list[list[Directive]] = []
    for directive in directives():
        if directive.instruction == "FROM":
            result.append([])
        if result:
            result[-1].append(directive)
    return result


def final(instruction: str) -> list[Directive]:
    return [d for d in stages()[-1] if d.instruction == instruction]


def env_of(stage: list[Directive]) -> dict[str, str]:
    values: dict[str, str] = {}
    for directive in stage:
        if directive.instruction == "ENV":
            for word in shlex.split(directive.arguments):
                key, _, value = word.partition("=")
                values[key] = value
    return values
