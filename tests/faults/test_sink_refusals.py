"""A refusal that is not the sink's verdict on a row, under a real relay: the relay's 16 KiB
bearer token is over the emulator's HTTP layer's header bound (aiohttp's 8190 bytes), which
answers every request with a plain-text 400 before any OJS handler runs. That 400 speaks of
the request, not the row: no row is dead-lettered, the poison-storm guard never pauses the
outbox, the breaker opens, the relay keeps running, no piece of the token reaches a log or
last_error, and once the token file holds a token the server takes, everything publishes."""

from __future__ import annotations

import random
import string
from pathlib import Path

from relayd.testing.processes import free_port
from tests.faults.harness import Scene, await_ok

# A sink that silently overwrites a reused id: a second POST of a stored job shows in its
# ledger as an overwrite, which the checker reports as a duplicate.
OVERWRITE = ("--duplicate-mode", "overwrite")
ROWS = 120  # over the storm guard's window (100): enough dead letters would trip it
_TOKEN_CHARS = 16 * 1024
_PIECE = 8  # no run this long of the token may show anywhere


def _token(seed: int) -> str:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    return "".join(rng.choice(alphabet) for _ in range(_TOKEN_CHARS))


def _pieces_shown(token: str, text: str) -> list[str]:
    """Runs of the token's start (which is what an HTTP layer echoes) found in `text`."""
    head = token[:256]
    return [
        head[i : i + _PIECE] for i in range(len(head) - _PIECE + 1) if head[i : i + _PIECE] in text
    ]


async def test_a_token_too_large_for_the_sinks_http_layer_dead_letters_nothing(
    scene: Scene, tmp_path: Path
) -> None:
    """Every request answered by a plain-text 400 about its header is a sink-wide
    failure: breaker open, rows pending, none dead (it used to dead-letter them all as
    `sink_rejected` until the storm guard paused the whole outbox)."""
    token = _token(17)
    token_file = tmp_path / "relay-bearer"
    token_file.write_text(token + "\n")
    await scene.start_sink(*OVERWRITE)
    ids = await scene.produce(ROWS)
    port = free_port()
    relay = await scene.relay(
        "relay",
        ready=False,
        RELAYD_SINK__TOKEN_FILE=str(token_file),
        RELAYD_HTTP__LISTEN=f"127.0.0.1:{port}",
    )
    await await_ok(scene.http, f"http://127.0.0.1:{port}/healthz", relay)

    await relay.logged("breaker.opened")
    # Refused again and again (each probe), each refusal recorded on its row.
    await scene.until(
        f"SELECT count(*) >= 10 FROM {scene.sql_table} "
        "WHERE last_error LIKE '%HTTP 400, not an OJS error body%'"
    )
    assert await scene.dead() == {}
    assert await scene.pending() == ROWS
    assert await scene.conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses") == 0
    assert relay.returncode is None
    errors = await scene.conn.fetch(
        f"SELECT last_error FROM {scene.sql_table} WHERE last_error IS NOT NULL"
    )
    assert all(not _pieces_shown(token, row["last_error"]) for row in errors)
    assert "Got more than 8190 bytes" in errors[0]["last_error"]

    # The operator puts a token the server takes: the next probe finds the sink healthy.
    replacement = token_file.with_name("relay-bearer.new")
    replacement.write_text("short-token-4fQ\n")
    replacement.replace(token_file)
    await scene.drained()
    assert await scene.published() == len(ids)
    assert await scene.dead() == {}
    await scene.check()
    assert relay.returncode is None
    assert await relay.stop() == 0
    log = relay.log()
    assert "relay.poison_storm" not in log
    assert "sink_rejected" not in log
    assert not _pieces_shown(token, log)
