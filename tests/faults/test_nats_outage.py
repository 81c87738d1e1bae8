"""A NATS outage as an operator lives it, on a real nats-server under a steady load, with a
real `relayd run` using the breaker's default cooldowns (5 s, doubling up to 60 s): while
the server is down, `relayd status` (text and --json) and `/readyz` say why the breaker is
open, naming the server; once it is back, rows flow within 2 s of the client's reconnect,
however long the breaker's cooldown still had to run; the reconnect is counted; rows refused
unsent are not logged as re-sends; and the history is clean (nothing lost, nothing stored
twice)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from tests.faults.harness import Process
from tests.faults.nats_stage import EVENT_TYPE, WHEN, NatsStage
from tests.support import produce

DRAIN_TIMEOUT_S = 90.0
# The outage: longer than several steps of the breaker's cooldown (5 s, then 10, 20...).
OUTAGE_S = 20.0
# The server comes back only when the breaker's next probe is due at least this long after:
# waiting out the cooldown would then take longer than the 2 s the reconnect is allowed.
PROBE_MARGIN_S = 6.0
RECOVERY_S = 2.0
# The steady load: this many events every tick.
EVENTS_PER_TICK, TICK_S = 2, 0.1


def _entries(relay: Process) -> Iterator[dict[str, Any]]:
    """The relay's JSON log lines, in order."""
    for line in relay.log().splitlines():
        if line.startswith("{"):
            entry: dict[str, Any] = json.loads(line)
            yield entry


def _at(entry: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(entry["timestamp"])


def _next_probe_at(relay: Process) -> tuple[int, float]:
    """How many times the breaker opened, and when (unix time) the last opening's cooldown
    ends: the breaker's next probe, unless something ends the cooldown sooner."""
    opened = [e for e in _entries(relay) if e["event"] == "breaker.opened"]
    return len(opened), _at(opened[-1]).timestamp() + opened[-1]["cooldown_s"]


async def _steady_load(dsn: str, stop: asyncio.Event) -> int:
    """Commit EVENTS_PER_TICK events every TICK_S until `stop`; how many in all."""
    conn = await asyncpg.connect(dsn)
    meta = {META_VERSION: 1, META_OCCURRED_AT: WHEN}
    committed = 0
    try:
        while not stop.is_set():
            await produce(conn, EVENTS_PER_TICK, job_type=EVENT_TYPE, meta=meta)
            committed += EVENTS_PER_TICK
            try:
                async with asyncio.timeout(TICK_S):
                    await stop.wait()
            except TimeoutError:
                pass
    finally:
        await conn.close()
    return committed


async def _status(stage: NatsStage) -> dict[str, Any]:
    """The one relay of `relayd status --json`."""
    [instance] = json.loads(await stage.operator("status", "--json"))["instances"]
    return dict(instance)


async def _readyz(stage: NatsStage) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{stage.http_ports['relay']}/readyz"
    async with stage.scene.http.get(url) as response:
        return response.status, await response.json()


async def _reconnects(stage: NatsStage) -> float:
    url = f"http://127.0.0.1:{stage.http_ports['relay']}/metrics"
    async with stage.scene.http.get(url) as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "relayd_sink_reconnects_total" and sample.labels == {"sink": "nats"}
    )


def _resent_unsent(relay: Process) -> tuple[set[str], list[str]]:
    """The rows whose attempts were all refused unsent ("nothing was sent"), and the
    `relay.resending` events of rows none of whose earlier attempts may have delivered them
    (which must be none)."""
    unsent: set[str] = set()
    maybe_delivered: set[str] = set()
    wrong: list[str] = []
    for entry in _entries(relay):
        event, event_id = entry["event"], str(entry.get("event_id"))
        if event == "relay.retry_scheduled":
            if entry["error"].endswith("nothing was sent"):
                unsent.add(event_id)
            else:
                maybe_delivered.add(event_id)  # an attempt without an answer: ambiguous
        elif event == "relay.resending" and event_id not in maybe_delivered:
            wrong.append(event_id)
    return unsent - maybe_delivered, wrong


async def test_an_outage_says_why_and_rows_flow_at_the_reconnect(stage: NatsStage) -> None:
    """1. Events flow (a steady load, the breaker's default cooldowns); 2. nats-server stops
    for OUTAGE_S: the breaker opens and reopens at each failed probe; `relayd status` (text
    and --json) and /readyz say why, naming the server's host and port, in relayd's words;
    3. the server starts again at a moment when the breaker's next probe is still at least
    PROBE_MARGIN_S away: rows flow within RECOVERY_S of the client's reconnect, and
    relayd_sink_reconnects_total counts it; 4. the load stops and drains: no row refused
    unsent was logged as a re-send, nothing is dead-lettered, and the checker finds every
    event stored once."""
    await stage.add_stream()
    stop_load = asyncio.Event()
    load = asyncio.create_task(_steady_load(stage.scene.dsn, stop_load))
    server = f"127.0.0.1:{stage.server.port}"
    try:
        relay = await stage.relay(
            "relay", RELAYD_RETRY__BREAKER_COOLDOWN_S="5", RELAYD_RETRY__CAP_S="60"
        )
        table = stage.scene.sql_table
        # 1.
        await stage.scene.until(
            f"SELECT count(*) >= 50 FROM {table} WHERE published_at IS NOT NULL"
        )
        # 2.
        await asyncio.to_thread(stage.server.stop)
        stopped_at = time.time()
        await relay.logged('"breaker.opened"')
        why = f"not connected to NATS at {server} (reconnecting: connection refused); "
        why += "nothing was sent"
        deadline = stopped_at + OUTAGE_S
        async with asyncio.timeout(OUTAGE_S):
            # The heartbeat lives in PostgreSQL, read by another process: poll it.
            while (await _status(stage)).get("breaker_reason") != why:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
        instance = await _status(stage)
        assert (instance["breaker_state"], instance["breaker_reason"]) == ("open", why)
        assert (
            f"  {instance['instance_id']}: breaker open: {why}"
            in (await stage.operator("status")).splitlines()
        )
        code, ready = await _readyz(stage)
        assert (code, ready["reason"]) == (503, f"sink circuit breaker open: {why}")
        await asyncio.sleep(max(deadline - time.time(), 0.0))
        openings, probe_at = _next_probe_at(relay)
        while probe_at - time.time() < PROBE_MARGIN_S:
            # Too close: the next probe would end the outage on its own. Let it fail, and
            # bring the server back at the start of the longer cooldown that follows.
            await relay.logged('"breaker.opened"', times=openings + 1, timeout_s=120.0)
            openings, probe_at = _next_probe_at(relay)
        assert openings >= 2  # a probe failed during the outage: longer than a cooldown step
        # 3.
        await asyncio.to_thread(stage.server.start)
        await relay.logged('"sink.nats_reconnected"')
        [reconnected] = [e for e in _entries(relay) if e["event"] == "sink.nats_reconnected"]
        reconnected_at = _at(reconnected)
        assert probe_at - reconnected_at.timestamp() > RECOVERY_S  # only the reconnect helps
        since = datetime.fromtimestamp(stopped_at, UTC)
        await stage.scene.until(
            f"SELECT count(*) > 0 FROM {table} WHERE published_at > "
            f"'{since.isoformat()}'::timestamptz",
            timeout_s=60.0,
        )
        first: datetime = await stage.scene.conn.fetchval(
            f"SELECT min(published_at) FROM {table} WHERE published_at > $1", since
        )
        flowed_s = (first - reconnected_at).total_seconds()
        assert flowed_s < RECOVERY_S, (
            f"rows flowed {flowed_s:.2f} s after the reconnect (the breaker's next probe was "
            f"due {probe_at - reconnected_at.timestamp():.2f} s after it)"
        )
        assert await _reconnects(stage) == 1.0
    finally:
        stop_load.set()
        committed = await load
    # 4.
    await stage.scene.drained(DRAIN_TIMEOUT_S)
    assert await relay.stop() == 0  # its log is complete
    unsent, wrong = _resent_unsent(relay)
    assert unsent  # rows were refused unsent, then claimed again (all are published)...
    assert wrong == []  # ... and none of them was logged as a re-send
    assert await stage.scene.dead() == {}
    assert await stage.scene.published() == committed
    await stage.check()
