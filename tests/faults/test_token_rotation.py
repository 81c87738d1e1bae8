"""A token rotation seen from relayd: the server takes the new token before relayd's token
file holds it. Every request is refused (401/403): relayd pauses (its breaker), dead-letters
nothing and keeps running; once the operator rotates the file (a new file renamed over the
old one), relayd sends the new token without a restart and drains the outbox. A rotation to
something that is not a usable token (a token plus a comment line, a CR or a NUL in it; a
FIFO or /dev/zero in the file's place) neither stops nor freezes the relay: it keeps the
token in use and keeps publishing, and a relay started with such a token refuses to start
(exit 2). No token, old or new, reaches relayd's log."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from relayd.testing.processes import free_port
from tests.faults.harness import Scene, await_ok
from tests.support import relayd_argv
from tests.tools import tool

OLD = "old-token"
NEW = "new-token"
# A sink that silently overwrites a reused id: a second POST of a published row shows in its
# ledger as an overwrite, which the checker reports as a duplicate.
OVERWRITE = ("--duplicate-mode", "overwrite")
ROWS = 60


def _rotate(path: Path, text: str) -> None:
    """As operators and Kubernetes do: write a new file, rename it over the old one."""
    temporary = path.with_name(path.name + ".new")
    temporary.write_text(text + "\n")
    os.replace(temporary, path)


@pytest.mark.parametrize("refusal", [403, 401])
async def test_refused_until_the_token_file_is_rotated(
    scene: Scene, tmp_path: Path, refusal: int
) -> None:
    """403: the emulator holds the new token, relayd the old one, which it refuses as not
    valid. 401: a server that answers 401 to the old token, scripted as a fault rule on
    the job routes until relayd has read the new one (the emulator itself answers 401 only
    to a missing or malformed header)."""
    relay_token = tmp_path / "relay-bearer"
    relay_token.write_text(OLD + "\n")
    if refusal == 403:
        sink_token = tmp_path / "sink-bearer"
        sink_token.write_text(NEW + "\n")
        sink = await scene.start_sink(*OVERWRITE, "--auth-token-file", str(sink_token))
    else:
        sink = await scene.start_sink(*OVERWRITE)
        await sink.faults(
            {"action": "status", "status": 401, "path_prefix": "/ojs/v1/jobs", "times": None}
        )
    ids = await scene.produce(ROWS)
    relay = await scene.relay("relay", RELAYD_SINK__TOKEN_FILE=str(relay_token))

    # Refused over and over: the breaker opens again and again, attempts are refunded.
    await relay.logged(f"HTTP {refusal}")
    await relay.logged("breaker.opened")
    await scene.until(
        f"SELECT count(*) >= 5 FROM {scene.sql_table} WHERE last_error LIKE '%HTTP {refusal}%'"
    )
    assert await scene.pending() == ROWS
    assert await scene.dead() == {}
    assert relay.returncode is None
    assert "sink.token_reloaded" not in relay.log()

    _rotate(relay_token, NEW)
    await relay.logged("sink.token_reloaded")
    if refusal == 401:
        await sink.clear_faults()  # the server accepts relayd's new token
    await scene.drained()
    assert await scene.dead() == {}
    assert await scene.published() == len(ids)
    assert set((await sink.ledger())["jobs"]) == set(ids)
    await scene.check()

    assert relay.returncode is None
    assert await relay.stop() == 0
    log = relay.log()
    assert OLD not in log
    assert NEW not in log


def _swap(path: Path, replacement: Path) -> None:
    """Put `replacement` (a FIFO, a symlink) in the token file's place in one rename."""
    os.replace(replacement, path)


async def _publish_until_logged(
    scene: Scene, text: str, *, count: int = 1, timeout_s: float = 30.0
) -> int:
    """Publish one row after another until the relay (the scene's last process) has logged
    `text` `count` times: the token file is looked at only when a request goes out, at most
    once a second. Returns how many rows were produced."""
    relay = scene.processes[-1]
    produced = 0
    try:
        async with asyncio.timeout(timeout_s):
            while relay.log().count(text) < count:
                await scene.produce(1)
                produced += 1
                await scene.drained()
    except TimeoutError:
        raise AssertionError(
            f"relay never wrote {text!r} in {produced} rows; its output ends:\n"
            + relay.log()[-4000:]
        ) from None
    return produced


# The address space a relay may use in these scenarios: far above what it needs, and a
# bound on the damage if a regression read /dev/zero (without it, until the kernel's OOM
# killer picks a process of the shared machine).
_RELAY_AS_BYTES = 2 * 1024**3


async def _relay_with_token(scene: Scene, tmp_path: Path) -> tuple[Path, int]:
    """A sink that takes only OLD, a relay whose token file holds it, 20 rows published."""
    sink_token = tmp_path / "sink-bearer"
    sink_token.write_text(OLD + "\n")
    await scene.start_sink(*OVERWRITE, "--auth-token-file", str(sink_token))
    relay_token = tmp_path / "relay-bearer"
    relay_token.write_text(OLD + "\n")
    await scene.produce(20)
    port = free_port()
    env = scene.relay_env("relay", f"127.0.0.1:{port}", RELAYD_SINK__TOKEN_FILE=str(relay_token))
    argv = [
        str(tool("prlimit", "util-linux")),
        f"--as={_RELAY_AS_BYTES}",
        "--",
        *relayd_argv("run"),
    ]
    relay = await scene.spawn("relay", argv, env)
    await await_ok(scene.http, f"http://127.0.0.1:{port}/healthz", relay)
    await scene.drained()
    return relay_token, port


@pytest.mark.parametrize(
    "rotated",
    [f"{NEW}\n# rotated by ops on Tuesday\n", f"{NEW}\rX\n", f"{NEW}\x00X\n"],
    ids=["comment-line", "cr", "nul"],
)
async def test_a_rotation_to_a_token_that_cannot_be_sent_keeps_publishing(
    scene: Scene, tmp_path: Path, rotated: str
) -> None:
    """The token file rotated to a value that cannot be a header value. The relay
    used to exit 1 at its next POST; now it keeps the token in use with one warning, stays
    up, and publishes every row produced after the rotation."""
    relay_token, _ = await _relay_with_token(scene, tmp_path)
    (relay,) = scene.processes[1:]
    temporary = relay_token.with_name("relay-bearer.new")
    temporary.write_text(rotated)
    os.replace(temporary, relay_token)
    await scene.produce(40)
    await scene.drained()
    produced = await _publish_until_logged(scene, "sink.token_unreadable")
    assert await scene.published() == 60 + produced
    assert await scene.dead() == {}
    assert relay.returncode is None
    await scene.check()
    assert await relay.stop() == 0
    log = relay.log()
    assert log.count("sink.token_unreadable") == 1
    assert "does not hold a bearer token" in log
    assert "sink.token_reloaded" not in log
    assert OLD not in log
    assert NEW not in log


async def test_a_relay_started_with_a_token_that_cannot_be_sent_exits_2(
    scene: Scene, tmp_path: Path
) -> None:
    """At start, the same file is a configuration error (exit 2, one line naming
    sink.token_file, no token), not a relay that starts and dies at its first POST, again
    at every restart."""
    await scene.start_sink(*OVERWRITE)
    await scene.produce(5)
    relay_token = tmp_path / "relay-bearer"
    relay_token.write_text(f"{NEW}\n# rotated by ops on Tuesday\n")
    relay = await scene.relay("relay", ready=False, RELAYD_SINK__TOKEN_FILE=str(relay_token))
    assert await relay.wait() == 2
    log = relay.log()
    assert log.count("\n") == 1, log
    assert log.startswith("relayd: config error: sink.token_file: ")
    assert "does not hold a bearer token" in log
    assert NEW not in log
    assert await scene.pending() == 5


@pytest.mark.timeout(90)
async def test_a_token_file_swapped_for_a_fifo_or_dev_zero_freezes_nothing(
    scene: Scene, tmp_path: Path
) -> None:
    """A FIFO in the token file's place used to block the event loop at the next
    look (no /healthz, nothing published); /dev/zero would be read without end. Neither is
    read: the token in use stays (one warning each time), /healthz answers, rows keep
    publishing, and the token file, a regular file again, is read again."""
    relay_token, port = await _relay_with_token(scene, tmp_path)
    (relay,) = scene.processes[1:]
    healthz = f"http://127.0.0.1:{port}/healthz"

    produced = 20
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    for swapped_in, episode in ((fifo, 1), (zero, 2)):
        _swap(relay_token, swapped_in)
        produced += await _publish_until_logged(scene, "sink.token_unreadable", count=episode)
        await await_ok(scene.http, healthz, relay)
        await scene.produce(20)
        await scene.drained()
        produced += 20
        _rotate(relay_token, OLD)
        produced += await _publish_until_logged(scene, "sink.token_readable", count=episode)
    assert await scene.published() == produced
    assert await scene.dead() == {}
    assert relay.returncode is None
    await scene.check()
    assert await relay.stop() == 0
    log = relay.log()
    assert log.count("sink.token_unreadable") == 2
    assert "is a FIFO, not a regular file" in log
    assert "is a character device, not a regular file" in log
    assert OLD not in log
