"""Methods of relayd's classes replaced from outside, and put back: how the fault suite's
failpoints and mutants reach a real process (tests/faults/switches/launch.py) without relayd itself
ever reading a test switch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Patches:
    """Attributes replaced on classes or modules, in order; `restore()` undoes them all."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, Any]] = []

    def wrap(self, owner: object, name: str, make: Callable[[Any], Any]) -> None:
        """Replace `owner.name` with `make(original)`."""
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
