"""A reporting command whose reader went away (`relayd dlq list | head -2`) exits quietly,
as Unix tools do: status 141 (what a shell shows for SIGPIPE), nothing on stderr."""

from __future__ import annotations

import asyncio
import os
import signal

import asyncpg
import pytest

from relayd.testing.emulator import RunningEmulator
from tests.support import Database, rows_in_every_state, start_relayd

# The exit status a shell shows for a process killed by SIGPIPE (docs/run.md).
READER_GONE = 128 + signal.SIGPIPE
# Every command that writes a report to stdout; {dead} is a dead letter's id.
REPORTS = [
    ("config", "example"),
    ("config", "show"),
    ("config", "show", "--json"),
    ("grants", "--role", "relay"),
    ("grants", "--role", "operator", "--json"),
    ("check",),
    ("check", "--json"),
    ("doctor",),
    ("doctor", "--json"),
    ("migrate",),
    ("migrate", "--json"),
    ("status",),
    ("status", "--json"),
    ("dlq", "list"),
    ("dlq", "list", "--json"),
    ("dlq", "show", "{dead}"),
    ("dlq", "show", "{dead}", "--json"),
    ("dlq", "retry", "--all", "--dry-run"),
]


async def _into_closed_pipe(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `relayd ARGS` writing into a pipe whose reader has already gone (closed before
    relayd writes a byte, so every write fails, however the output is buffered); its exit
    code and stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = await start_relayd(*args, env=env, stdout=write_end)
    finally:
        os.close(write_end)
    _, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, err.decode()


@pytest.mark.parametrize("command", REPORTS, ids=" ".join)
async def test_a_report_into_a_pipe_nobody_reads_exits_quietly(
    cli_env: dict[str, str],
    database: Database,
    emulator: RunningEmulator,
    command: tuple[str, ...],
) -> None:
    """The reader is gone: exit 141, no traceback, nothing at all on stderr."""
    conn = await asyncpg.connect(database.dsn)
    try:
        dead = (await rows_in_every_state(conn))["dead"][0]
    finally:
        await conn.close()
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn, "RELAYD_SINK__URL": emulator.url}
    args = [part.format(dead=dead) for part in command]
    code, err = await _into_closed_pipe(args, env)
    assert (code, err) == (READER_GONE, "")
