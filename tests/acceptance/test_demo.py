"""`relayd demo --keep` as an operator meets it: after its run, the embedded PostgreSQL and the
emulator stay up behind a configuration file the operator commands take, until Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from tests.support import run_relayd, start_relayd

_STARTED_S = 60.0  # an embedded PostgreSQL to create, then the demo's run (about 15 s)
_STOPPED_S = 30.0
# The demo's poison rows (relayd/demo.py), one per reason.
POISON = {"invalid_envelope", "too_large", "sink_rejected", "sink_unprocessable"}


async def _config_path(process: asyncio.subprocess.Process) -> Path:
    """The configuration file the demo prints under `config`, once it has printed it."""
    assert process.stdout is not None
    async with asyncio.timeout(_STARTED_S):
        while line := (await process.stdout.readline()).decode():
            label, _, value = line.strip().partition(" ")
            if label == "config":
                return Path(value.strip())
    raise AssertionError(f"the demo ended (code {await process.wait()}) without a config")


async def test_demo_keep_serves_its_dead_letters_until_sigint(cli_env: dict[str, str]) -> None:
    """1. `relayd demo --keep` prints a configuration file once its run is over; 2. `relayd
    dlq list --config PATH` lists the demo's four poison rows from the PostgreSQL it kept;
    3. SIGINT stops it: exit 0, its directory (PostgreSQL's data, the file) removed."""
    process = await start_relayd("demo", "--rows", "100", "--keep", env=cli_env)
    try:
        config = await _config_path(process)  # 1.
        assert config.is_file()

        code, out, err = await run_relayd("dlq", "list", "--config", str(config), env=cli_env)
        assert code == 0, err  # 2.
        rows = out.splitlines()[1:-1]
        assert {row.split()[2] for row in rows} == POISON
        assert out.splitlines()[-1] == "4 dead letters, newest first"

        process.send_signal(signal.SIGINT)  # 3.
        async with asyncio.timeout(_STOPPED_S):
            rest, _ = await process.communicate()
        assert process.returncode == 0, rest
        assert rest.decode().endswith("stopping PostgreSQL and the emulator\n")
        assert not config.parent.exists()
    finally:
        if process.returncode is None:
            # SIGINT, not SIGKILL: the demo then stops the PostgreSQL server it started.
            process.send_signal(signal.SIGINT)
            async with asyncio.timeout(_STOPPED_S):
                await process.wait()
