"""A webhook URL that carries a token (in a path segment, in the query) is never shown in
clear: not in a log event, a row's `last_error`, a pause's reason, nor in what `relayd
status` and `relayd check` print, even when the receiver echoes the URL in its answer."""

from __future__ import annotations

import json
from pathlib import Path

import asyncpg
import structlog

from relayd.settings import Settings
from relayd.testing.processes import free_port
from relayd.testing.webhook_receiver import Fault, receiving
from tests.integration.sinks.webhook.test_sink import OLD, commit, webhook_settings, write_secrets
from tests.support import Database, eventually, pending, run_relayd, running

# Path segments the default rule hides (long, letters and digits mixed), and query strings.
GONE_KEY = "Xk9pQ2rT7vW3yZ1aB4cD6eF8"
ECHO_KEY = "q8W2e4R6t8Y0u2I4o6P8a0S2"
SLOW_KEY = "Zx7Cv5Bn3Mm1Lk9Jh7Gf5Dd3"
DOWN_KEY = "Pp0Oo9Ii8Uu7Yy6Tt5Rr4Ee3"
QUERY = "key=s3cr3t-query-value"
SECRETS = (GONE_KEY, ECHO_KEY, SLOW_KEY, DOWN_KEY, "s3cr3t-query-value")


def _config_file(tmp_path: Path, settings: Settings, routes: list[dict[str, str]]) -> Path:
    """The same configuration as a file, for `relayd status` and `relayd check`."""
    lines = [
        "[database]",
        f"dsn = {json.dumps(settings.dsn)}",
        "[sink]",
        "kind = 'webhook'",
        f"secret_file = '{tmp_path / 'whsec'}'",
        "timeout_s = 2.0",
    ]
    for route in routes:
        lines += ["[[sink.routes]]", f"type = '{route['type']}'", f"url = '{route['url']}'"]
    path = tmp_path / "relayd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _in_clear(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


async def test_a_tokened_url_is_never_shown_in_clear(
    database: Database, conn: asyncpg.Connection, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """1. The relay meets a 410 (a pause, its reason), a 400 whose page echoes the URL (a
    dead letter's excerpt) and a 503 (a slow-down, logged), each from an endpoint with a
    token in its path and query: no log event, last_error or pause reason holds a token,
    and each shows the URL with *** in its place. 2. `relayd status` (text and JSON) and
    `relayd check` (an endpoint that answers, one that does not) print no token either."""
    write_secrets(tmp_path / "whsec", OLD)
    slowed: set[str] = set()

    def script(path: str, webhook_id: str, before: int) -> Fault | None:
        if path == GONE_KEY:
            return Fault(410, store=False)
        if path == ECHO_KEY:
            page = f"<html><body>no hook at {receiver.url}/{ECHO_KEY}?{QUERY}</body></html>"
            return Fault(400, body=page.encode(), store=False)
        if path == SLOW_KEY and webhook_id not in slowed:
            slowed.add(webhook_id)
            return Fault(503, {"Retry-After": "1"}, store=False)
        return None

    async with receiving([OLD], script) as receiver:
        routes = [
            {"type": "order.lost", "url": f"{receiver.url}/{GONE_KEY}?{QUERY}"},
            {"type": "order.echo", "url": f"{receiver.url}/{ECHO_KEY}?{QUERY}"},
            {"type": "order.slow", "url": f"{receiver.url}/{SLOW_KEY}"},
        ]
        settings = webhook_settings(database.dsn, tmp_path / "whsec", routes=routes)
        settings = settings.model_copy(
            update={"log": settings.log.model_copy(update={"level": "debug"})}
        )
        lost = await commit(conn, 3, "order.lost")
        await commit(conn, 1, "order.echo")
        slow = await commit(conn, 2, "order.slow")
        with structlog.testing.capture_logs() as logs:
            async with running(settings):
                await receiver.wait_for(lambda r: set(slow) <= set(r.stored))

                async def settled() -> bool:
                    # The lost rows held by the pause, the echoed one dead-lettered.
                    dead: int = await conn.fetchval(
                        "SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL"
                    )
                    return await pending(conn) == len(lost) and dead == 1

                await eventually(settled)

        # 1.
        shown = repr(logs)
        assert _in_clear(shown) == []
        events = {entry["event"]: entry for entry in logs}
        assert events["sink.webhook_gone"]["url"] == f"{receiver.url}/***?***"
        assert events["sink.webhook_slowed"]["url"] == f"{receiver.url}/***"
        errors = [
            row["last_error"]
            for row in await conn.fetch("SELECT last_error FROM relayd.outbox")
            if row["last_error"]
        ]
        assert errors
        assert _in_clear(" ".join(errors)) == []
        [echoed] = await conn.fetch(
            "SELECT last_error FROM relayd.outbox WHERE dead_at IS NOT NULL"
        )
        assert echoed["last_error"].startswith(f"HTTP 400: no hook at {receiver.url}/***?***")
        reason = await conn.fetchval("SELECT reason FROM relayd.relayd_pauses")
        assert f"{receiver.url}/***?*** answered HTTP 410" in reason
        assert _in_clear(reason) == []

        # 2.
        env = cli_env | {"RELAYD_CONFIG": str(_config_file(tmp_path, settings, routes))}
        for command in (["status"], ["status", "--json"]):
            code, out, err = await run_relayd(*command, env=env)
            assert code == 0, err
            assert "/***?*** answered HTTP 410" in out
            assert _in_clear(out + err) == []
        down = f"http://127.0.0.1:{free_port()}"
        routes.append({"type": "order.down", "url": f"{down}/{DOWN_KEY}"})
        env["RELAYD_CONFIG"] = str(_config_file(tmp_path, settings, routes))
        code, out, err = await run_relayd("check", env=env)
        assert code == 1, out + err
        assert f"{down}/*** unreachable" in out
        assert f"{receiver.url}/***?***" in out
        assert _in_clear(out + err) == []
