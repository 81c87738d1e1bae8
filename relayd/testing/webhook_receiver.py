"""A webhook receiver for tests and `relayd demo --sink webhook`: an aiohttp server that
verifies every delivery with the `standardwebhooks` package (an implementation independent
of relayd's, from the dev extra), refuses stale timestamps, stores each verified delivery by
its `webhook-id` (a receiver that deduplicates), and plays scripted faults.

A delivery that fails verification is answered 401 and counted in `refused`; a verified one
is stored (again, if its id was stored before: `seen` counts every arrival) and answered as
the script says: 204, a status (410, 503 with a Retry-After, ...), a connection dropped
after storing, or an answer after a delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from relayd.testing.processes import free_port

# How far a webhook-timestamp may be from the receiver's clock: an attempt signs with its
# own time, so a re-sent delivery carrying its first attempt's timestamp is refused.
STALE_AFTER_S = 30.0


@dataclass(frozen=True, slots=True)
class Fault:
    """What the receiver does with a verified delivery: `status` (with `headers` and
    `body`) after `delay_s`, or, with `drop`, store it and close the connection without an
    answer; `store=False` answers without storing."""

    status: int = 204
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    delay_s: float = 0.0
    drop: bool = False
    store: bool = True


# Decides each verified delivery's fate from its path, its id and how many times that id
# arrived before (0 the first time); None: stored and answered 204.
Script = Callable[[str, str, int], Fault | None]


@dataclass(frozen=True, slots=True)
class Delivery:
    path: str
    webhook_id: str
    timestamp_s: int
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Receiver:
    """The receiver's state: what it accepts and what it saw."""

    secrets: list[str]
    script: Script | None = None
    stale_after_s: float = STALE_AFTER_S
    stored: dict[str, Delivery] = field(default_factory=dict)
    seen: Counter[str] = field(default_factory=Counter)
    refused: list[str] = field(default_factory=list)
    # Every stored delivery's webhook-id, in the order they arrived (repeats included).
    arrivals: list[str] = field(default_factory=list)
    url: str = ""
    # Told of every delivery as it is answered: a line for `relayd receiver` to print.
    announce: Callable[[dict[str, Any]], None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def endpoint(self, path: str = "hooks") -> str:
        return f"{self.url}/{path}"

    async def wait_for(self, check: Callable[[Receiver], bool], timeout_s: float = 30.0) -> None:
        """Until `check(self)` holds, woken by each delivery; fails after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while not check(self):
                self._changed.clear()
                await self._changed.wait()

    def _verified(self, body: bytes, headers: dict[str, str]) -> Any:
        """The parsed body if any accepted secret verifies it and it is fresh, else None."""
        try:
            timestamp_s = int(headers.get("webhook-timestamp", ""))
        except ValueError:
            return None
        if abs(time.time() - timestamp_s) > self.stale_after_s:
            return None
        for secret in self.secrets:
            with contextlib.suppress(WebhookVerificationError, ValueError):
                return Webhook(secret).verify(body, headers)
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {name.lower(): value for name, value in request.headers.items()}
        parsed = self._verified(body, headers)
        try:
            if parsed is None:
                self.refused.append(headers.get("webhook-id", "?"))
                if self.announce is not None:
                    self.announce({"refused": headers.get("webhook-id", "?"), "status": 401})
                return web.Response(status=401, text="signature refused")
            webhook_id = headers["webhook-id"]
            path = request.match_info["path"]
            before = self.seen[webhook_id]
            fault = (self.script(path, webhook_id, before) if self.script else None) or Fault()
            if fault.store:
                self.seen[webhook_id] += 1
                self.arrivals.append(webhook_id)
                self.stored[webhook_id] = Delivery(
                    path, webhook_id, int(headers["webhook-timestamp"]), parsed, headers
                )
                if self.announce is not None:
                    self.announce(
                        {"verified": webhook_id, "path": path, "type": parsed.get("type")}
                    )
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.drop:
                if request.transport is not None:
                    request.transport.abort()
                return web.Response(status=500)  # never written: the transport is gone
            return web.Response(status=fault.status, headers=fault.headers, body=fault.body)
        finally:
            self._changed.set()


@contextlib.asynccontextmanager
async def receiving(
    secrets: Sequence[str],
    script: Script | None = None,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    announce: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncIterator[Receiver]:
    """A receiver listening on `host` (`port`, or a free one) while the block runs;
    deliveries go to `receiver.endpoint(path)`."""
    receiver = Receiver(list(secrets), script, announce=announce)
    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_post("/{path}", receiver.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    port = port or free_port()
    try:
        await web.TCPSite(runner, host, port).start()
        receiver.url = f"http://{host}:{port}"
        yield receiver
    finally:
        await runner.cleanup()


def summary(receiver: Receiver) -> str:
    """One line: stored, arrivals, duplicates, refused."""
    arrivals = sum(receiver.seen.values())
    return json.dumps(
        {
            "stored": len(receiver.stored),
            "arrivals": arrivals,
            "duplicates": arrivals - len(receiver.seen),
            "refused": len(receiver.refused),
        }
    )
