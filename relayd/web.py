"""The HTTP surface (bound to 127.0.0.1 by default): `/metrics`, `/healthz`, `/readyz`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from relayd.metrics import RelayMetrics

ReadyCheck = Callable[[], Awaitable[str | None]]  # None when ready, else the reason


def make_app(metrics: RelayMetrics, ready: ReadyCheck) -> web.Application:
    async def metrics_handler(_request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        # Answering at all proves the event loop is alive.
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        reason = await ready()
        if reason is None:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not_ready", "reason": reason}, status=503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def start_web(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app`; the caller cleans up the returned runner."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
