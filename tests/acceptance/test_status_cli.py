"""`relayd status` through the command line, and `GET /v1/status` of a running relay: the
same report, read-only, from a migrated outbox with rows in every state."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from typing import Any

import aiohttp
import asyncpg

from relayd.core.retry import Backoff, BreakerState
from relayd.daemon.sampler import Activity, InstanceInfo, Sampler
from relayd.engine.chores import Housekeeping
from relayd.store import Store
from relayd.store import outage as reconnect
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.metrics import RelayMetrics
from relayd.testing.emulator import RunningEmulator
from relayd.testing.processes import free_port
from tests.support import (
    Database,
    eventually,
    relay_settings,
    rows_in_every_state,
    run_relayd,
    running,
)

PAUSE = (
    "INSERT INTO relayd.relayd_pauses (outbox_table, queue, reason, paused_by) "
    "VALUES ('relayd.outbox', $1, $2, 'alice')"
)
# The reason the relays' breakers give (the sink's words).
REFUSED = "cannot connect to 127.0.0.1:8080: connection refused"


async def _status(env: dict[str, str], *args: str) -> str:
    """`relayd status ARGS` in a child process (this loop keeps serving meanwhile)."""
    code, stdout, stderr = await run_relayd("status", *args, env=env)
    assert code == 0, stderr
    assert stderr == ""
    return stdout


async def _beat(store: Store, host: str) -> uuid.UUID:
    """A heartbeat written as a running relay's sampler writes it."""
    metrics = RelayMetrics()
    database = DatabaseRetry(
        Backoff(base_s=reconnect.BASE_S, cap_s=reconnect.CAP_S, rng=random.Random(1)), metrics
    )
    sampler = Sampler(
        store=store,
        metrics=metrics,
        lease_s=30.0,
        instance=InstanceInfo(host=host, pid=1234, version="0.1.0"),
        activity=lambda: Activity(BreakerState.OPEN, 2, REFUSED),
        housekeeping=Housekeeping(metrics, database, asyncio.Event()),
    )
    await sampler.beat()
    return sampler.instance.instance_id


async def test_status_shows_every_state_pause_and_relay(
    database: Database, conn: asyncpg.Connection, store: Store, cli_env: dict[str, str]
) -> None:
    """Human table and --json: rows by state, ages, dead letters by reason, top queues and
    types, the pause with who and why, a live relay and a stale one, and why the live
    relay's breaker is open."""
    await rows_in_every_state(conn)
    await conn.execute(PAUSE, "mail", "smtp maintenance")
    live = await _beat(store, "relay-a")
    stale = await _beat(store, "relay-b")
    await conn.execute(
        "UPDATE relayd.relayd_instances SET last_seen = now() - interval '10 minutes' "
        "WHERE instance_id = $1",
        stale,
    )
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}

    report = json.loads(await _status(env, "--json"))
    assert report["outbox"] == "relayd.outbox"
    backlog = report["backlog"]
    assert backlog["rows"] == {"ready": 3, "paused": 2, "scheduled": 3, "leased": 2, "dead": 2}
    assert backlog["estimated"] == []
    assert backlog["counted_up_to"] == 100_000
    assert 100 <= backlog["oldest_claimable_age_s"] < 160
    assert 5000 <= backlog["oldest_pending_age_s"] < 5060
    assert report["dead_letters"] == {
        "by_reason": [{"reason": "conflict", "rows": 1}, {"reason": "sink_rejected", "rows": 1}],
        "counted": 2,
    }
    assert report["top"]["queues"] == [{"name": "orders", "rows": 8}, {"name": "mail", "rows": 2}]
    assert report["top"]["types"] == [
        {"name": "test.echo", "rows": 8},
        {"name": "mail.send", "rows": 2},
    ]
    assert report["paused"] is True
    assert [(p["queue"], p["reason"], p["paused_by"]) for p in report["pauses"]] == [
        ("mail", "smtp maintenance", "alice")
    ]
    instances = {i["instance_id"]: i for i in report["instances"]}
    assert instances[str(live)]["stale"] is False
    assert instances[str(live)]["breaker_state"] == "open"
    assert instances[str(live)]["in_flight"] == 2
    assert instances[str(live)]["breaker_reason"] == REFUSED
    assert instances[str(stale)]["stale"] is True
    assert report["stale_after_s"] == 15.0

    text = await _status(env)
    lines = text.splitlines()
    assert lines[0].startswith("relayd.outbox at ")
    assert any(line.split()[:2] == ["ready", "3"] for line in lines)
    assert any(line.split()[:2] == ["paused", "2"] for line in lines)
    assert "Top queues, over the first 10 pending rows in claim order" in lines
    assert any(line.split()[:5] == ["mail", "*", "2", "smtp", "maintenance"] for line in lines)
    assert [line.split()[0] for line in lines if "relay-b" in line] == [str(stale)]
    assert next(line for line in lines if "relay-b" in line).endswith("STALE")
    assert not next(line for line in lines if "relay-a" in line).endswith("STALE")
    assert f"  {live}: breaker open: {REFUSED}" in lines


async def test_status_of_a_running_relay_over_http_and_cli(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator, cli_env: dict[str, str]
) -> None:
    """1. A running relay is listed by `relayd status --json` and by its own /v1/status,
    which answer the same report; 2. a clean stop removes its heartbeat."""
    await rows_in_every_state(conn)
    # Nothing is claimed: the rows keep their states while both reports are read.
    await conn.execute(PAUSE, "*", "read the report")
    port = free_port()
    settings = relay_settings(
        database.dsn,
        emulator.url,
        http={"enabled": True, "listen": f"127.0.0.1:{port}"},
        metrics={"sample_interval_s": 0.2},
    )
    env = cli_env | {
        "RELAYD_DATABASE__DSN": database.dsn,
        "RELAYD_METRICS__SAMPLE_INTERVAL_S": "0.2",
    }
    async with running(settings) as daemon, aiohttp.ClientSession() as http:
        instance_id = str(daemon.instance.instance_id)

        async def from_http() -> dict[str, Any]:
            async with http.get(f"http://127.0.0.1:{port}/v1/status") as response:
                assert response.status == 200
                body: dict[str, Any] = await response.json()
                return body

        async def listed() -> bool:
            return [i["instance_id"] for i in (await from_http())["instances"]] == [instance_id]

        await eventually(listed)
        served = await from_http()
        printed = json.loads(await _status(env, "--json"))
        for report in (served, printed):
            (instance,) = report["instances"]
            assert instance["instance_id"] == instance_id
            assert instance["stale"] is False
            assert instance["breaker_state"] == "closed"
            assert report["backlog"]["rows"]["paused"] == 5
        # The same report but for the instants it was read at.
        for moving in ("at", "backlog", "instances"):
            del served[moving], printed[moving]
        assert served == printed
    # 2.
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_instances") == 0
