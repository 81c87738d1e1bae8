"""Failpoints: inert and free when the variable is unset, exact about what they arm, and
each action does what it says (exit and pause on a real child process)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.faults.switches import failpoints
from tests.faults.switches.failpoints import (
    ENV,
    FailpointHit,
    FailpointSpecError,
    arm,
    parse,
    reach,
)


@pytest.fixture(autouse=True)
def _disarmed() -> Iterator[None]:
    arm({})
    yield
    arm({})


def test_unset_or_empty_arms_nothing() -> None:
    arm({})
    assert failpoints.ARMED == {}
    arm({ENV: "  "})
    assert failpoints.ARMED == {}


async def test_an_unarmed_place_does_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    arm({})
    for point in failpoints.POINTS:
        await reach(point)  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""


def test_parse_reads_every_action_and_count() -> None:
    armed = parse("after_claim=exit@3; before_post=delay:0.25;after_2xx=raise;before_settle=pause")
    assert {name: (fp.action, fp.delay_s, fp.at) for name, fp in armed.items()} == {
        "after_claim": ("exit", 0.0, 3),
        "before_post": ("delay", 0.25, None),
        "after_2xx": ("raise", 0.0, None),
        "before_settle": ("pause", 0.0, None),
    }


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("after_clam=exit", "'after_clam=exit' is not NAME=ACTION"),
        ("after_claim", "is not NAME=ACTION"),
        ("after_claim=explode", "after_claim: the action must be one of"),
        ("after_claim=delay:soon", "delay:<s> needs seconds"),
        ("after_claim=delay:-1", "delay:<s> needs seconds"),
        ("after_claim=exit:3", "exit takes no argument"),
        ("after_claim=exit@0", "@N needs a whole number"),
        ("after_claim=exit@x", "@N needs a whole number"),
        ("after_claim=exit;after_claim=raise", "after_claim is armed twice"),
    ],
)
def test_a_malformed_value_is_refused_naming_the_failpoint(spec: str, says: str) -> None:
    with pytest.raises(FailpointSpecError, match=says.replace("(", r"\(").replace("*", r"\*")):
        parse(spec)


async def test_raise_fires_only_at_the_nth_reach() -> None:
    arm({ENV: "before_post=raise@2"})
    await reach("before_post")
    with pytest.raises(FailpointHit, match="failpoint before_post fired"):
        await reach("before_post")
    await reach("before_post")  # the third reach: past N
    await reach("after_claim")  # not armed


async def test_delay_sleeps_with_the_loop_running() -> None:
    arm({ENV: "after_claim=delay:0.05"})
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    await reach("after_claim")
    task.cancel()
    assert time.monotonic() - started >= 0.05
    assert ticks > 1  # other tasks ran meanwhile


_CHILD = """
import asyncio, sys
from tests.faults.switches import failpoints
failpoints.arm()
asyncio.run(failpoints.reach("after_claim"))
print("went on", flush=True)
"""


def _child(spec: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        env=os.environ | {ENV: spec},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_exit_kills_the_process_as_kill_9() -> None:
    child = _child("after_claim=exit")
    out, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert out == ""
    assert "failpoint after_claim: exit" in err


def test_pause_stops_the_process_until_sigcont() -> None:
    child = _child("after_claim=pause")
    try:
        deadline = time.monotonic() + 30
        while _state(child.pid) != "T":
            assert child.poll() is None, "the child exited instead of stopping"
            assert time.monotonic() < deadline, "the child never stopped"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 0
        assert out == "went on\n"
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
