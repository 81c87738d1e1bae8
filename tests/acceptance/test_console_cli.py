"""`relayd console` as an operator runs it: refused with one line and exit 2 when it would
listen beyond loopback without authentication or its password file is unusable; otherwise
serving its pages on its own pool until SIGTERM, then exiting 0."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp

from relayd.testing.processes import free_port
from tests.support import Database, relayd_env, run_relayd, start_relayd


async def test_a_non_loopback_bind_without_authentication_exits_2_naming_the_key(
    tmp_path: Path,
) -> None:
    """0.0.0.0 (or a host name) with neither console.password_file nor
    console.proxy_user_header: one line on stderr naming console.listen, exit 2."""
    for listen in ("0.0.0.0:8437", "console.example:8437", "[::]:8437"):
        env = relayd_env({"RELAYD_CONSOLE__LISTEN": listen})
        code, stdout, stderr = await run_relayd("console", env=env)
        assert code == 2, (listen, stderr)
        assert stdout == ""
        [line] = stderr.splitlines()
        assert line.startswith("relayd: config error: console.listen: "), line
        assert "console.password_file or console.proxy_user_header" in line


async def test_an_unusable_password_file_exits_2_naming_the_key(tmp_path: Path) -> None:
    """A missing file, or a line that is not name:password: exit 2 naming
    console.password_file, and never a line of the file."""
    bad = tmp_path / "users"
    bad.write_text("alice-without-colon-s3cret\n")
    for path in (tmp_path / "missing", bad):
        env = relayd_env({"RELAYD_CONSOLE__PASSWORD_FILE": str(path)})
        code, _, stderr = await run_relayd("console", env=env)
        assert code == 2, stderr
        [line] = stderr.splitlines()
        assert line.startswith("relayd: config error: console.password_file: "), line
        assert "s3cret" not in line


async def test_the_console_serves_until_sigterm(database: Database) -> None:
    """It says where it listens, serves the overview on loopback, and exits 0 on SIGTERM."""
    port = free_port()
    env = relayd_env(
        {"RELAYD_DATABASE__DSN": database.dsn, "RELAYD_CONSOLE__LISTEN": f"127.0.0.1:{port}"}
    )
    process = await start_relayd("console", env=env)
    assert process.stderr is not None
    try:
        async with asyncio.timeout(30):
            line = (await process.stderr.readline()).decode()
        assert f"on http://127.0.0.1:{port}/ (read-only)" in line, line
        assert database.dsn not in line
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/") as response,
        ):
            assert response.status == 200
            assert "Overview" in await response.text()
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await process.wait()
    assert code == 0
