"""A real Prometheus (Debian's) scraping a running relayd every second with the shipped rules
loaded: the claimable-age alert goes pending while the sink is down and resolves once it is
back, and every expression of the Grafana dashboard evaluates without error on series relayd
really exports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import yaml

from relayd.testing.emulator import start_emulator
from relayd.testing.processes import await_http, free_port
from tests.deploy.conftest import DEPLOY
from tests.deploy.promql import metric_names
from tests.support import Database, drained, eventually, produce, relayd_env, start_relayd
from tests.tools import tool

RULES = DEPLOY / "prometheus" / "relayd.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "relayd.json"
ALERT = "RelaydClaimableAgeHigh"


@pytest.fixture(scope="module")
def prometheus() -> Path:
    """The prometheus server binary (Debian package prometheus)."""
    return tool("prometheus", "prometheus")


@contextlib.asynccontextmanager
async def _relayd(
    tmp_path: Path, dsn: str, sink_url: str, port: int
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`relayd run` with a one-failure breaker and a long cooldown (so, once open, it leaves
    the backlog alone), sampling every 0.5 s; drained with SIGTERM on exit, which must be 0."""
    env = relayd_env(
        {
            "RELAYD_CONFIG": str(tmp_path / "empty.toml"),
            "RELAYD_DATABASE__DSN": dsn,
            "RELAYD_SINK__URL": sink_url,
            "RELAYD_HTTP__LISTEN": f"127.0.0.1:{port}",
            "RELAYD_METRICS__SAMPLE_INTERVAL_S": "0.5",
            "RELAYD_RETRY__BREAKER_THRESHOLD": "1",
            "RELAYD_RETRY__BREAKER_COOLDOWN_S": "5",
            "RELAYD_RETRY__CAP_S": "5",
            "RELAYD_RETRY__BASE_S": "0.1",
            "RELAYD_SINK__CONNECT_TIMEOUT_S": "0.5",
            "RELAYD_LOG__FORMAT": "json",
        }
    )
    (tmp_path / "empty.toml").write_text("")
    with (tmp_path / "relayd.log").open("wb") as log:
        process = await start_relayd("run", env=env, stdout=log, stderr=log)
        try:
            await await_http(f"http://127.0.0.1:{port}/healthz", process)
            yield process
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                async with asyncio.timeout(30):
                    await process.wait()
    assert process.returncode == 0, (tmp_path / "relayd.log").read_text()[-2000:]


@pytest.fixture
async def scraped(prometheus: Path, tmp_path: Path) -> AsyncIterator[tuple[int, int]]:
    """(relayd's metrics port, Prometheus's port): a Prometheus on loopback scraping that port
    every second as job "relayd", the shipped rules evaluated every second."""
    relayd_port, prometheus_port = free_port(), free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "relayd", "static_configs": [{"targets": [f"127.0.0.1:{relayd_port}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        prometheus,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{prometheus_port}",
        stdout=log,
        stderr=log,
    )
    try:
        await await_http(f"http://127.0.0.1:{prometheus_port}/-/ready", process)
        yield relayd_port, prometheus_port
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await process.wait()
        log.close()


async def _api(http: aiohttp.ClientSession, port: int, path: str, **params: str) -> Any:
    async with http.get(f"http://127.0.0.1:{port}/api/v1/{path}", params=params) as response:
        body = await response.json()
    assert body["status"] == "success", body
    return body["data"]


async def _alert_state(http: aiohttp.ClientSession, port: int) -> str:
    """The claimable-age alert's state: inactive, pending or firing."""
    data = await _api(http, port, "rules", type="alert")
    for group in data["groups"]:
        for rule in group["rules"]:
            if rule["name"] == ALERT:
                return str(rule["state"])
    raise AssertionError(f"{ALERT} is not loaded")


async def test_a_real_prometheus_sees_the_claimable_age_alert_come_and_go(
    scraped: tuple[int, int], database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """1. relayd runs with the sink stopped: its breaker opens on the first row; 2. rows that
    have been claimable for 5 minutes wait: through Prometheus's API the claimable-age alert
    goes pending (or firing); 3. the sink comes back on the same port: the rows drain and the
    alert resolves; 4. every dashboard expression evaluates, on names relayd exports."""
    relayd_port, prometheus_port = scraped
    sink_port = free_port()
    await produce(conn, 1)
    async with (
        _relayd(tmp_path, database.dsn, f"http://127.0.0.1:{sink_port}", relayd_port),
        aiohttp.ClientSession() as http,
    ):
        # 1. Nothing listens at the sink's port: connection refused.
        async def breaker_open() -> bool:
            data = await _api(http, prometheus_port, "query", query="relayd_breaker_state")
            return [sample["value"][1] for sample in data["result"]] == ["2"]

        await eventually(breaker_open, timeout_s=30)
        # 2.
        await produce(conn, 30)
        await conn.execute(
            "UPDATE relayd.outbox SET available_at = now() - interval '5 minutes' "
            "WHERE attempts = 0"
        )

        async def alerting() -> bool:
            return await _alert_state(http, prometheus_port) in ("pending", "firing")

        await eventually(alerting, timeout_s=30)
        # 3.
        async with await start_emulator(port=sink_port) as sink:
            await eventually(lambda: drained(conn), timeout_s=60)

            async def resolved() -> bool:
                return await _alert_state(http, prometheus_port) == "inactive"

            await eventually(resolved, timeout_s=30)
            assert {e.created for e in sink.emulator.ledger().values()} == {1}
            # 4.
            await _every_dashboard_expression_evaluates(http, prometheus_port)


async def _every_dashboard_expression_evaluates(http: aiohttp.ClientSession, port: int) -> None:
    exported = set(await _api(http, port, "label/__name__/values"))
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
    assert expressions
    for expression in expressions:
        # Grafana's range variables, given values as Grafana would.
        query = expression.replace("$__rate_interval", "1m").replace("$__interval", "15s")
        await _api(http, port, "query", query=query)  # status "success", or the assert says
        for name in metric_names(expression):
            if name.startswith(("relayd_", "process_")):
                assert name in exported, f"{name} (in {expression!r}) is not exported"
