"""`relayd run`'s HTTP endpoints as a process supervisor sees them: open before PostgreSQL
answers, and a taken port reported in one line."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import aiohttp

from relayd.testing.processes import free_port, relay_process
from tests.support import Database, TcpProxy, eventually, run_relayd_blocking


async def _get(http: aiohttp.ClientSession, port: int, path: str) -> tuple[int, Any]:
    async with http.get(f"http://127.0.0.1:{port}{path}") as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def test_http_answers_while_the_database_is_unreachable(
    database: Database, tmp_path: Path
) -> None:
    """PostgreSQL unreachable at start: 1. /healthz 200, /readyz and /v1/status 503 saying
    why, /metrics 200; 2. PostgreSQL back: /readyz 200, /v1/status lists this relay;
    3. SIGTERM: exit 0."""
    proxy = TcpProxy.for_dsn(database.dsn)
    await proxy.start()
    await proxy.cut()
    port = free_port()
    try:
        async with (
            relay_process(
                tmp_path,
                proxy.dsn_through(database.dsn),
                "http://127.0.0.1:9",  # never called: the outbox is empty
                port,
                RELAYD_METRICS__SAMPLE_INTERVAL_S="0.2",
            ) as process,
            aiohttp.ClientSession() as http,
        ):
            # 1. relay_process returned: /healthz answered 200.
            assert await _get(http, port, "/readyz") == (
                503,
                {"status": "not_ready", "reason": "database unreachable"},
            )
            assert await _get(http, port, "/v1/status") == (
                503,
                {"status": "unavailable", "reason": "database unreachable"},
            )
            status, text = await _get(http, port, "/metrics")
            assert status == 200
            assert "relayd_database_errors_total" in text
            # 2.
            await proxy.restore()

            async def ready() -> bool:
                return (await _get(http, port, "/readyz"))[0] == 200

            async def listed() -> bool:
                status, report = await _get(http, port, "/v1/status")
                return status == 200 and len(report["instances"]) == 1

            await eventually(ready)
            await eventually(listed)
        # 3.
        assert process.returncode == 0
    finally:
        await proxy.close()


def test_metrics_port_in_use_exits_1_in_one_line(
    database: Database, cli_env: dict[str, str]
) -> None:
    """http.listen taken by another process: exit 1 (the setting is valid, the environment
    is not) with one line naming http.listen and the address, no traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_relayd_blocking(
            "run",
            env=cli_env
            | {
                "RELAYD_DATABASE__DSN": database.dsn,
                "RELAYD_SINK__URL": "http://127.0.0.1:9",
                "RELAYD_HTTP__LISTEN": f"127.0.0.1:{port}",
                "RELAYD_LOG__FORMAT": "json",
            },
        )
    assert result.returncode == 1
    assert result.stderr == (
        f"relayd: http.listen: cannot listen on 127.0.0.1:{port}: address already in use\n"
    )
