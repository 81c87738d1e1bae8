"""The HTTP surface (bound to 127.0.0.1 by default): `/metrics`, `/healthz`, `/readyz`, and the
read-only `/v1/status` (the report of `relayd status --json`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from relayd.core.errors import DatabaseUnavailable, StatementError
from relayd.telemetry.metrics import RelayMetrics


@dataclass(frozen=True, slots=True)
class Readiness:
    """What `/readyz` answers: `reason` why the relay is not ready (None: ready), and
    `detail` added to the body either way (the housekeeping chores failing now)."""

    reason: str | None
    detail: Mapping[str, Any] = field(default_factory=dict)


ReadyCheck = Callable[[], Awaitable[Readiness]]
# The status report as JSON-ready data; DatabaseUnavailable while PostgreSQL cannot answer.
StatusSource = Callable[[], Awaitable[Mapping[str, Any]]]


def make_app(
    metrics: RelayMetrics, ready: ReadyCheck, status: StatusSource | None = None
) -> web.Application:
    async def metrics_handler(_request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        # Answering at all proves the event loop is alive.
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        readiness = await ready()
        if readiness.reason is None:
            return web.json_response({"status": "ready", **readiness.detail})
        body = {"status": "not_ready", "reason": readiness.reason, **readiness.detail}
        return web.json_response(body, status=503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if status is not None:
        app.router.add_get("/v1/status", _status_handler(_SingleFlight(status)))
    return app


def _status_handler(
    status: StatusSource,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_request: web.Request) -> web.Response:
        try:
            report = await status()
        except DatabaseUnavailable:
            reason = "database unreachable"
        except StatementError as exc:
            # A schema without migration 0003, for example: say which statement failed.
            reason = str(exc)
        else:
            return web.json_response(report)
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)

    return handler


class _SingleFlight:
    """Concurrent calls share one run of `source`: the endpoints have no authentication,
    and a burst of requests must not multiply the report's work in PostgreSQL."""

    def __init__(self, source: StatusSource) -> None:
        self._source = source
        self._running: asyncio.Task[Mapping[str, Any]] | None = None

    async def __call__(self) -> Mapping[str, Any]:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._source())
            # Retrieved here too, in case every waiter hung up before it failed.
            self._running.add_done_callback(_retrieve)
        # Shielded: a client that hangs up must not cancel the run the others wait for.
        return await asyncio.shield(self._running)


def _retrieve(task: asyncio.Task[Mapping[str, Any]]) -> None:
    if not task.cancelled():
        task.exception()


async def start_web(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app`; the caller cleans up the returned runner. `OSError` if the address
    cannot be bound (nothing is left open then)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
