"""The console's application served in this process over the test's database (a pool of two
connections, as `relayd console` opens), driven with aiohttp's test client."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
from aiohttp.test_utils import TestClient, TestServer

from relayd.config.console import ConsoleSettings
from relayd.console.app import Console, build_app, new_console
from relayd.console.auth import Gate
from relayd.console.command import POOL_MAX
from relayd.console.overview import sampling
from relayd.store import Store
from tests.support import Database, produce

LOCAL_USER = "ops-tester"
# The overview's figures are read at most this often (metrics.sample_interval_s).
SAMPLE_INTERVAL_S = 1.0
_CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


@dataclass
class Served:
    client: TestClient[Any, Any]
    console: Console

    async def page(self, path: str, **kwargs: Any) -> tuple[int, str]:
        async with self.client.get(path, **kwargs) as response:
            return response.status, await response.text()

    async def post(self, path: str, data: Any, **kwargs: Any) -> tuple[int, str]:
        async with self.client.post(path, data=data, **kwargs) as response:
            return response.status, await response.text()

    async def csrf(self, path: str = "/dead-letters", **kwargs: Any) -> str:
        """The CSRF token a page's forms carry."""
        status, text = await self.page(path, **kwargs)
        assert status == 200, text
        found = _CSRF.search(text)
        assert found is not None, "the page has no form"
        return found.group(1)


@contextlib.asynccontextmanager
async def served(
    database: Database, *, sample_interval_s: float = SAMPLE_INTERVAL_S, **console: Any
) -> AsyncIterator[Served]:
    """The console over `database`, with `[console]` as given (loopback, the local user by
    default), its overview read at most every `sample_interval_s`."""
    settings = ConsoleSettings(**console)
    if settings.authentication is None:
        gate = Gate(None, local_user=LOCAL_USER)
    else:
        gate = Gate.from_settings(settings)
    store = await Store.connect(
        database.dsn,
        database.table,
        max_size=POOL_MAX,
        statement_timeout_s=settings.statement_timeout_s,
    )
    console_ = new_console(store, settings, gate, sample_interval_s=sample_interval_s, lease_s=30.0)
    client: TestClient[Any, Any] = TestClient(TestServer(build_app(console_), host="127.0.0.1"))
    await client.start_server()
    try:
        async with sampling(console_.status):
            yield Served(client, console_)
    finally:
        await client.close()
        await store.close()


async def dead_letters(  # noqa: PLR0913 - what the dead letters look like, each by keyword
    conn: asyncpg.Connection,
    count: int,
    *,
    job_type: str = "order.created",
    queue: str = "orders",
    reason: str = "sink_rejected",
    error: str = "400 invalid_request: total must be positive",
    dead_for: str = "1 hour",
) -> list[str]:
    """Commit `count` rows and dead-letter them in SQL, as the relay leaves them: `dead_for`
    ago, one attempt, `error`. Their ids, oldest dead first."""
    ids = await produce(conn, count, job_type=job_type, queue=queue)
    await conn.execute(
        "UPDATE relayd.outbox AS o "
        "SET dead_at = now() - $2::text::interval + u.n * interval '1 ms', "
        "dead_reason = $3, last_error = $4, attempts = 1, "
        "last_attempt_at = now() - $2::text::interval "
        "FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, n) WHERE o.event_id = u.id",
        ids,
        dead_for,
        reason,
        error,
    )
    return ids


def audit_filters(text: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(text)
    return data
