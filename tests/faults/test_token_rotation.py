"""A token rotation seen from relayd: the server takes the new token before relayd's token
file holds it. Every request is refused (401/403): relayd pauses (its breaker), dead-letters
nothing and keeps running; once the operator rotates the file (a new file renamed over the
old one), relayd sends the new token without a restart and drains the outbox. No token, old
or new, reaches relayd's log."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.harness import Scene

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
