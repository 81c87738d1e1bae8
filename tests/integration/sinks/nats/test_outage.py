"""A NATS outage as a relay in this process lives it, against a real nats-server stopped and
started again on its port and store: the breaker says why it is open (the server's host and
port, in relayd's words), rows refused unsent are not re-sends, and the client's reconnect
ends the breaker's cooldown at once, counted."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import asyncpg
import structlog
from nats.aio.client import Client
from nats.js.api import StreamConfig

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from relayd.core.retry import BreakerState
from relayd.producer import enqueue_many, new_job
from relayd.settings import Settings
from relayd.testing.nats import NatsServer
from relayd.testing.processes import free_port
from tests.support import Database, drained, eventually, running, sink_settings

STREAM = "EVENTS"
# Far longer than the recovery the test allows: only the reconnect can end it in time.
COOLDOWN_S = 60.0
RECOVERY_S = 10.0


def _settings(dsn: str, url: str, http_port: int) -> Settings:
    route = {"type": "order.updated", "subject": "events.orders"}
    return sink_settings(
        dsn,
        {"kind": "nats", "servers": [url], "stream": STREAM, "routes": [route]},
        # The first cooldown is drawn between half and all of COOLDOWN_S: beyond RECOVERY_S.
        retry={"breaker_threshold": 1, "breaker_cooldown_s": COOLDOWN_S, "cap_s": 60.0},
        http={"enabled": True, "listen": f"127.0.0.1:{http_port}"},
        metrics={"sample_interval_s": 0.1},
        log={"level": "info", "format": "json"},
    )


async def _commit(conn: asyncpg.Connection, count: int) -> list[str]:
    meta = {META_VERSION: 1, META_OCCURRED_AT: "2024-05-01T12:00:00Z"}
    jobs = [new_job("order.updated", [{"order_id": n}], meta=meta) for n in range(count)]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    return [str(job["id"]) for job in jobs]


async def test_an_outage_says_why_and_ends_with_the_reconnect(
    database: Database, conn: asyncpg.Connection, nats_server: NatsServer, js: Client
) -> None:
    """1. NATS stops under a running relay; rows committed meanwhile are refused unsent, the
    breaker opens, and its reason names the server (host:port), what the client met, and
    that nothing was sent, with no client class name: in `breaker.opened`, /readyz and the
    heartbeat (/v1/status). 2. NATS starts again: the client reconnects, the breaker's
    cooldown (half a minute at least) ends at once, the rows are stored, the reconnect is
    counted, and none of those rows was logged as a re-send (nothing of theirs had left)."""
    await js.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["events.>"]))
    http_port = free_port()
    server = f"127.0.0.1:{nats_server.port}"
    settings = _settings(database.dsn, nats_server.url, http_port)
    with structlog.testing.capture_logs() as logs:

        def logged(event: str) -> list[dict[str, Any]]:
            return [dict(entry) for entry in logs if entry["event"] == event]

        async def disconnected() -> bool:
            return bool(logged("sink.nats_disconnected"))

        async with running(settings) as daemon, aiohttp.ClientSession() as http:
            await _commit(conn, 5)
            await eventually(lambda: drained(conn))
            # 1.
            await asyncio.to_thread(nats_server.stop)
            await eventually(disconnected)
            ids = await _commit(conn, 20)

            async def opened() -> bool:
                return daemon.breaker_state is BreakerState.OPEN

            await eventually(opened)
            [opening] = logged("breaker.opened")
            reason = opening["error"]
            assert reason.startswith(f"not connected to NATS at {server} (reconnecting"), reason
            assert reason.endswith("; nothing was sent"), reason
            assert "Error" not in reason, reason  # no client class name
            async with http.get(f"http://127.0.0.1:{http_port}/readyz") as response:
                assert response.status == 503
                assert (await response.json())["reason"] == f"sink circuit breaker open: {reason}"

            async def beat_says_why() -> bool:
                async with http.get(f"http://127.0.0.1:{http_port}/v1/status") as response:
                    [instance] = (await response.json())["instances"]
                return (instance["breaker_state"], instance["breaker_reason"]) == ("open", reason)

            await eventually(beat_says_why)
            # 2.
            await asyncio.to_thread(nats_server.start)
            async with asyncio.timeout(RECOVERY_S):
                await eventually(lambda: drained(conn))
            reconnects = daemon.metrics.registry.get_sample_value(
                "relayd_sink_reconnects_total", {"sink": "nats"}
            )
    assert reconnects == 1.0
    events = [entry["event"] for entry in logs]
    reconnected = events.index("sink.nats_reconnected")
    assert events.index("breaker.cooldown_ended") > reconnected
    assert logged("breaker.closed")[-1]["proof"] == "publish"
    assert [e for e in logged("relay.resending") if e["event_id"] in ids] == []
    retried = {e["event_id"] for e in logged("relay.retry_scheduled")}
    assert retried <= set(ids)
    assert retried  # the rows did fail while NATS was down, and came back as fresh rows
