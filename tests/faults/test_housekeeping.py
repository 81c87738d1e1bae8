"""A housekeeping statement that PostgreSQL refuses never stops a real relay: retention
cleanup meeting a foreign key from an application table, a heartbeat meeting a trigger that
refuses it. The relay keeps running and publishing, says which chore fails (log, metric,
/readyz, `relayd status`), retries on the chore's schedule, and recovers once the cause is
gone."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from relayd.testing.processes import free_port
from tests.faults.harness import Process, Scene, await_ok
from tests.support import relayd_argv, run_relayd

CHORES = {"RELAYD_METRICS__SAMPLE_INTERVAL_S": "0.2", "RELAYD_CLEANUP__INTERVAL_S": "0.2"}


async def _relay(scene: Scene, **settings: str) -> tuple[Process, str]:
    """A real `relayd run` (the scene's FAST settings, then these) and its HTTP base URL."""
    listen = f"127.0.0.1:{free_port()}"
    env = scene.relay_env("relay", listen, **(CHORES | settings))
    proc = await scene.spawn("relay", relayd_argv("run"), env)
    await await_ok(scene.http, f"http://{listen}/healthz", proc)
    return proc, f"http://{listen}"


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as answer:
        return answer.status, await answer.json(content_type=None)


async def _metric(http: aiohttp.ClientSession, base: str, line: str) -> bool:
    async with http.get(f"{base}/metrics") as answer:
        return line in (await answer.text()).splitlines()


async def test_cleanup_refused_by_a_foreign_key_never_stops_publishing(scene: Scene) -> None:
    """1. an application table references a published row: retention cleanup's DELETE is
    refused, once at start and at every turn after; the relay stays up, rows committed
    meanwhile publish, and the failure shows in /readyz (still ready), the metrics and
    `relayd status`; 2. the foreign key dropped: the next turn deletes the expired rows and
    says the chore recovered."""
    await scene.conn.execute(
        f"CREATE TABLE app_orders (event_id uuid REFERENCES {scene.sql_table} (event_id))"
    )
    await scene.start_sink()
    first = await scene.produce(10)
    await scene.conn.execute("INSERT INTO app_orders VALUES ($1)", first[0])
    relay, base = await _relay(
        scene,
        RELAYD_CLEANUP__ENABLED="true",
        RELAYD_CLEANUP__PUBLISHED_RETENTION_S="0",
    )
    # 1.
    await scene.until(f"SELECT count(*) = 10 FROM {scene.sql_table} WHERE published_at IS NOT NULL")
    await relay.logged('"event": "housekeeping.failed"')
    await relay.logged('"chore": "cleanup"')
    assert relay.returncode is None
    more = await scene.produce(10)
    await scene.drained()
    assert await scene.published() == len(first) + len(more)  # nothing deleted: all refused
    status, ready = await _get(scene.http, f"{base}/readyz")
    assert status == 200
    assert ready["status"] == "ready"
    assert "violates foreign key constraint" in ready["housekeeping"]["cleanup"]["error"]
    assert await _metric(scene.http, base, 'relayd_housekeeping_failing{chore="cleanup"} 1.0')
    env = scene.relay_env("status", "127.0.0.1:0")
    code, out, err = await run_relayd("status", "--json", env=env)
    assert (code, err) == (0, "")
    [instance] = json.loads(out)["instances"]
    assert "foreign key" in instance["housekeeping"]["cleanup"]["error"]
    code, out, _ = await run_relayd("status", env=env)
    assert code == 0
    assert ": housekeeping cleanup failing since " in out
    # 2.
    await scene.conn.execute("DROP TABLE app_orders")
    await relay.logged('"event": "housekeeping.recovered"')
    await scene.until(f"SELECT count(*) = 0 FROM {scene.sql_table}")
    status, ready = await _get(scene.http, f"{base}/readyz")
    assert (status, ready) == (200, {"status": "ready"})
    assert relay.returncode is None
    assert await relay.stop() == 0
    assert relay.log().count('"event": "housekeeping.failed"') == 1  # once per change


async def test_a_heartbeat_refused_by_a_trigger_never_stops_publishing(scene: Scene) -> None:
    """1. a trigger refuses every write to relayd_instances: the heartbeat fails at start
    and at every turn; the relay stays up and publishes, /readyz names the chore; 2. the
    trigger dropped: the heartbeat is written again."""
    await scene.conn.execute(
        """
        CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'relay registry is read-only during the audit'; END $$;
        CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON relayd.relayd_instances
            FOR EACH ROW EXECUTE FUNCTION refuse();
        """
    )
    await scene.start_sink()
    ids = await scene.produce(20)
    relay, base = await _relay(scene)
    # 1.
    await relay.logged('"chore": "heartbeat"')
    await scene.drained()
    assert await scene.published() == len(ids)
    assert relay.returncode is None
    status, ready = await _get(scene.http, f"{base}/readyz")
    assert status == 200
    assert "read-only during the audit" in ready["housekeeping"]["heartbeat"]["error"]
    assert await scene.conn.fetchval("SELECT count(*) FROM relayd.relayd_instances") == 0
    # 2.
    await scene.conn.execute("DROP TRIGGER refuse ON relayd.relayd_instances")
    await scene.until("SELECT count(*) = 1 FROM relayd.relayd_instances")
    await relay.logged('"event": "housekeeping.recovered"')
    assert await relay.stop() == 0
    await scene.check()
