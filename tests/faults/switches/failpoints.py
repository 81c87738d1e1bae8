"""Failpoints: named places in the relay's cycle where a fault test makes the real process
fail. relayd itself has none: `install` wraps the methods between which each place lies,
and only the test launcher (tests/faults/switches/launch.py) calls it, for a process the fault
suite starts as `python -m tests.faults.switches.launch run`.

``RELAYD_TEST_FAILPOINTS`` holds ``NAME=ACTION`` pairs separated by ``;``::

    RELAYD_TEST_FAILPOINTS="after_claim=exit@3;before_post=delay:0.5"

An action is ``exit`` (the process kills itself with SIGKILL, as ``kill -9`` would),
``pause`` (it stops itself with SIGSTOP, to be resumed by SIGCONT: a stalled VM, a long GC
pause), ``raise`` (`FailpointHit`, an exception relayd does not expect) or ``delay:<s>``
(sleep that long, other tasks running meanwhile). ``@N`` fires at the N-th time the place is
reached only; without it, every time.

The places (`POINTS`), in the order a cycle reaches them:

- ``after_claim``: the claim statement committed and its rows came back, nothing sent yet
  (the start of `RelayWorker.publish`);
- ``before_post``: an attempt passed its start-by check and is about to send its request, a
  row or a batch (the start of the sink's `publish`, OJS or NATS);
- ``after_2xx``: the sink accepted at least one row, nothing settled yet (the end of
  `RelayWorker.publish`);
- ``before_settle``: the settle statements are about to be sent (each commits on its own,
  so a process that dies here has committed none of them);
- ``after_settle``: the settle statements committed (lazily: their WAL may not be on disk
  yet, which a test that crashes PostgreSQL here relies on);
- ``during_drain``: a worker is settling its last claim after a stop began (SIGTERM);
- ``sink_after_store``: in ``relayd emulator``, a POST's jobs are stored and its answer is
  not sent yet (`Emulator.stored`).

The launcher reads the variable at start-up (`arm`); a malformed value exits 2 in one line
naming the variable.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, cast, get_args

from relayd.core.outcomes import Published
from tests.faults.switches.patches import Patches

ENV: Final = "RELAYD_TEST_FAILPOINTS"

Point = Literal[
    "after_claim",
    "before_post",
    "after_2xx",
    "before_settle",
    "after_settle",
    "during_drain",
    "sink_after_store",
]
POINTS: Final[tuple[str, ...]] = get_args(Point)

Action = Literal["exit", "pause", "raise", "delay"]
ACTIONS: Final[tuple[str, ...]] = get_args(Action)
_MAX_DELAY_S: Final = 3600.0


class FailpointHit(RuntimeError):
    """Raised by a failpoint armed with ``raise``."""

    def __init__(self, point: str) -> None:
        super().__init__(f"failpoint {point} fired")
        self.point = point


class FailpointSpecError(ValueError):
    """``RELAYD_TEST_FAILPOINTS`` does not parse; the message names the failpoint."""


@dataclass(slots=True)
class Failpoint:
    """One armed place: what it does, at which reach (None: every one), and the count."""

    action: Action
    delay_s: float = 0.0
    at: int | None = None
    reached: int = 0

    def due(self) -> bool:
        """Count one reach; True if the action fires on it."""
        self.reached += 1
        return self.at is None or self.reached == self.at


# Armed failpoints by place: empty unless `arm` found the variable.
ARMED: Final[dict[str, Failpoint]] = {}


def parse(spec: str) -> dict[str, Failpoint]:
    """The failpoints a ``RELAYD_TEST_FAILPOINTS`` value arms."""
    armed: dict[str, Failpoint] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, action_text = (text.strip() for text in item.partition("="))
        if not sep or name not in POINTS:
            raise FailpointSpecError(
                f"{item!r} is not NAME=ACTION with NAME one of {', '.join(POINTS)}"
            )
        if name in armed:
            raise FailpointSpecError(f"{name} is armed twice")
        armed[name] = _parse_action(name, action_text)
    return armed


def _parse_action(name: str, text: str) -> Failpoint:
    action_text, sep, at_text = text.partition("@")
    at: int | None = None
    if sep:
        if not at_text.isdigit() or int(at_text) < 1:
            raise FailpointSpecError(f"{name}: @N needs a whole number N >= 1")
        at = int(at_text)
    kind, _, argument = action_text.partition(":")
    if kind not in ACTIONS:
        raise FailpointSpecError(f"{name}: the action must be one of {', '.join(ACTIONS)}")
    delay_s = 0.0
    if kind == "delay":
        try:
            delay_s = float(argument)
        except ValueError:
            delay_s = -1.0
        if not 0.0 <= delay_s <= _MAX_DELAY_S:
            raise FailpointSpecError(f"{name}: delay:<s> needs seconds, 0 to {_MAX_DELAY_S:g}")
    elif argument:
        raise FailpointSpecError(f"{name}: {kind} takes no argument")
    return Failpoint(action=cast(Action, kind), delay_s=delay_s, at=at)


def arm(environ: Mapping[str, str] = os.environ) -> None:
    """Arm what the environment names (nothing if the variable is unset or empty)."""
    ARMED.clear()
    ARMED.update(parse(environ.get(ENV, "")))


async def reach(point: Point) -> None:
    """Do what the failpoint at `point` is armed to do, if anything."""
    armed = ARMED.get(point)
    if armed is None or not armed.due():
        return
    # The one line a fault test reads back from the process's output.
    sys.stderr.write(f"failpoint {point}: {armed.action}\n")
    sys.stderr.flush()
    if armed.action == "exit":
        os.kill(os.getpid(), signal.SIGKILL)
    elif armed.action == "pause":
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once resumed by SIGCONT
    elif armed.action == "raise":
        raise FailpointHit(point)
    else:
        await asyncio.sleep(armed.delay_s)


def install(patches: Patches) -> None:
    """Put the armed failpoints where their places are, by wrapping relayd's methods (none
    unless `arm` armed one of them): the relay's, or the emulator's `sink_after_store`."""
    from relayd.engine.relay import RelayWorker  # noqa: PLC0415 - only once something is armed
    from relayd.engine.settle import Settler  # noqa: PLC0415
    from relayd.sinks.nats.sink import NatsSink  # noqa: PLC0415
    from relayd.sinks.ojs.sink import OjsSink  # noqa: PLC0415
    from relayd.testing.emulator.app import Emulator  # noqa: PLC0415

    if "sink_after_store" in ARMED:

        def stored(original: Any) -> Any:
            async def wrapped(self: Emulator) -> None:
                await original(self)
                await reach("sink_after_store")

            return wrapped

        patches.wrap(Emulator, "stored", stored)
    if not ARMED.keys() - {"sink_after_store"}:
        return

    def publish(original: Any) -> Any:
        async def wrapped(self: RelayWorker, claim: Any) -> Any:
            await reach("after_claim")
            outcomes, keys = await original(self, claim)
            if any(isinstance(o, Published) for o in outcomes.values()):
                await reach("after_2xx")
            return outcomes, keys

        return wrapped

    def send(original: Any) -> Any:
        async def wrapped(self: OjsSink | NatsSink, *args: Any, **kwargs: Any) -> Any:
            await reach("before_post")
            return await original(self, *args, **kwargs)

        return wrapped

    def settle(original: Any) -> Any:
        async def wrapped(self: RelayWorker, *args: Any) -> Any:
            if self._ctx.stopping.is_set():
                await reach("during_drain")
            return await original(self, *args)

        return wrapped

    def write(original: Any) -> Any:
        async def wrapped(self: Settler, *args: Any) -> Any:
            await reach("before_settle")
            written = await original(self, *args)
            await reach("after_settle")
            return written

        return wrapped

    patches.wrap(RelayWorker, "publish", publish)
    patches.wrap(OjsSink, "publish", send)
    patches.wrap(NatsSink, "publish", send)
    patches.wrap(RelayWorker, "settle", settle)
    patches.wrap(Settler, "write", write)
