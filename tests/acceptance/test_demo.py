"""`relayd demo --keep` as an operator meets it, for every destination: after its run, the
embedded PostgreSQL and the destination's stand-in stay up behind a configuration file the
operator commands take, until Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.support import run_relayd, run_relayd_blocking, start_relayd

_STARTED_S = 60.0  # an embedded PostgreSQL to create, then the demo's run (about 15 s)
_STOPPED_S = 30.0
# Each destination's demo: its poison rows, one per reason it is dead-lettered for, and what
# stands in for the destination (relayd/demo/<kind>.py).
DEMOS = {
    "ojs": (
        {"invalid_envelope", "too_large", "sink_rejected", "sink_unprocessable"},
        "the emulator",
    ),
    "nats": ({"invalid_envelope", "too_large", "no_route", "conflict"}, "nats-server"),
    "webhook": ({"invalid_envelope", "too_large", "sink_rejected"}, "the receiver"),
}


async def _config_path(process: asyncio.subprocess.Process) -> Path:
    """The configuration file the demo prints under `config`, once it has printed it."""
    assert process.stdout is not None
    async with asyncio.timeout(_STARTED_S):
        while line := (await process.stdout.readline()).decode():
            label, _, value = line.strip().partition(" ")
            if label == "config":
                return Path(value.strip())
    raise AssertionError(f"the demo ended (code {await process.wait()}) without a config")


def test_demo_help_says_keep_works_for_every_destination(cli_env: dict[str, str]) -> None:
    """`relayd demo --help` says --keep keeps every kind's destination, and names status."""
    result = run_relayd_blocking("demo", "--help", env=cli_env)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "keep PostgreSQL and the destination running (for every --sink)" in text
    assert "`relayd status --config PATH`" in text


@pytest.mark.parametrize("kind", sorted(DEMOS))
async def test_demo_keep_serves_its_dead_letters_until_sigint(
    kind: str, cli_env: dict[str, str]
) -> None:
    """1. `relayd demo --sink KIND --keep` prints a configuration file once its run is over;
    2. `relayd dlq list --config PATH` lists the demo's poison rows from the PostgreSQL it
    kept, and `relayd check` and `relayd status` pass against what it kept; 3. SIGINT stops
    it: exit 0, its directory (PostgreSQL's data, the file) removed, its last line before
    stopping pointing at a real server's quick start."""
    poison, destination = DEMOS[kind]
    process = await start_relayd("demo", "--sink", kind, "--rows", "100", "--keep", env=cli_env)
    try:
        config = await _config_path(process)  # 1.
        assert config.is_file()

        code, out, err = await run_relayd("dlq", "list", "--config", str(config), env=cli_env)
        assert code == 0, err  # 2.
        rows = out.splitlines()[1:-1]
        assert {row.split()[2] for row in rows} == poison
        assert out.splitlines()[-1] == f"{len(poison)} dead letters, newest first"
        code, out, err = await run_relayd("check", "--config", str(config), env=cli_env)
        assert code == 0, out + err
        code, out, err = await run_relayd("status", "--config", str(config), env=cli_env)
        assert code == 0, out + err

        process.send_signal(signal.SIGINT)  # 3.
        async with asyncio.timeout(_STOPPED_S):
            rest, _ = await process.communicate()
        assert process.returncode == 0, rest
        assert rest.decode().endswith(
            f'  a real server  the quick start for kind = "{kind}" in README.md\n'
            f"stopping PostgreSQL and {destination}\n"
        )
        assert not config.parent.exists()
    finally:
        if process.returncode is None:
            # SIGINT, not SIGKILL: the demo then stops the PostgreSQL server it started.
            process.send_signal(signal.SIGINT)
            async with asyncio.timeout(_STOPPED_S):
                await process.wait()
