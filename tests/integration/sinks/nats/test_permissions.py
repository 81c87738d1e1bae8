"""The NATS sink's permissions, against a real nats-server with accounts: the documented
permissions are enough, and a publish or a reply subscription the relay's user may not make
is named, opens the breaker (severe) and loses nothing until an operator grants it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest
import structlog
from nats.aio.client import Client
from nats.js.api import StreamConfig

from relayd.operator.check import Verdict, run_checks
from relayd.settings import Settings
from relayd.testing.nats import NatsServer
from tests.integration.sinks.nats.test_sink import (
    STREAM,
    add_stream,
    commit,
    dead,
    event,
    nats_settings,
    stored,
)
from tests.support import Database, drained, eventually, pending, run_until_idle, running

# The permissions docs/nats.md#operations gives the relay's NATS user: publish on the routes'
# subjects and the three JetStream API subjects, subscribe on its reply inboxes.
RELAY_PERMISSIONS = """
accounts {
  APP {
    jetstream: enabled
    users: [
      {user: admin, password: admin-pw}
      {
        user: relayd, password: relay-pw,
        permissions: {
          publish: {allow: ["events.>", "relayd.markers.*", "$JS.API.INFO",
                            "$JS.API.STREAM.INFO.EVENTS", "$JS.API.STREAM.MSG.GET.EVENTS"]}
          subscribe: {allow: ["_INBOX.>"]}
        }
      }
    ]
  }
}
"""


# The same user without subscribe permission on its reply inbox.
NO_REPLY_PERMISSIONS = RELAY_PERMISSIONS.replace(
    'subscribe: {allow: ["_INBOX.>"]}', 'subscribe: {deny: ["_INBOX.>"]}'
)
assert NO_REPLY_PERMISSIONS != RELAY_PERMISSIONS


def relay_user_settings(
    database: Database, server: NatsServer, tmp_path: Path, **sink: Any
) -> Settings:
    """nats_settings as the `relayd` user of RELAY_PERMISSIONS, its password from a file."""
    password = tmp_path / "password"
    password.write_text("relay-pw\n")
    return nats_settings(
        database.dsn, server.url, user="relayd", password_file=str(password), **sink
    )


async def an_error_says(conn: asyncpg.Connection, text: str) -> bool:
    errors = await conn.fetch("SELECT last_error FROM relayd.outbox")
    return any(text in (row["last_error"] or "") for row in errors)


async def refused_until_granted(  # noqa: PLR0913 - the scene, then what to expect
    server: NatsServer,
    admin: Client,
    conn: asyncpg.Connection,
    settings: Settings,
    ids: list[str],
    wanted: str,
    *,
    nothing_sent: bool = False,
) -> None:
    """A relay whose NATS user lacks a permission: the rows' last_error names it (`wanted`),
    nothing is dead-lettered, every row waits (and none was sent, if `nothing_sent`); once
    the server's configuration grants it, every event is stored once. The breaker opened at
    once (severe), and no row used more than one attempt."""
    with structlog.testing.capture_logs() as logs:
        async with running(settings):
            await eventually(lambda: an_error_says(conn, wanted))
            assert await dead(conn) == {}
            assert await pending(conn) == len(ids)
            if nothing_sent:
                assert (await admin.jetstream().stream_info(STREAM)).state.messages == 0
            server.reload(RELAY_PERMISSIONS)
            await eventually(lambda: drained(conn))
    assert sorted(m["headers"]["Nats-Msg-Id"] for m in await stored(admin)) == sorted(ids)
    opened = [e for e in logs if e["event"] == "breaker.opened"]
    assert opened, "the breaker never opened"
    assert opened[0]["severe"] is True
    assert await conn.fetchval("SELECT max(attempts) FROM relayd.outbox") <= 1


async def test_the_documented_permissions_are_enough(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """docs/nats.md#operations: a NATS user with only the documented permissions passes
    `relayd check`, publishes events with their atomic markers, and reads a duplicate back
    (an event stored outside a batch: the batch is refused, the event alone reconciled)."""
    with NatsServer(config=RELAY_PERMISSIONS) as server:
        admin = await nats.connect(server.url, user="admin", password="admin-pw")  # noqa: S106 - the test server's own
        try:
            await admin.jetstream().add_stream(
                StreamConfig(
                    name=STREAM, subjects=["events.>", "relayd.markers.*"], allow_atomic=True
                )
            )
            ids = await commit(conn, [event(n) for n in range(10)])
            await admin.jetstream().publish(
                "events.orders", b'{"order_id":3}', headers={"Nats-Msg-Id": ids[3]}
            )
            settings = relay_user_settings(database, server, tmp_path)
            lines = {line.name: line for line in await run_checks(settings, "test")}
            assert lines["sink"].verdict is Verdict.OK, lines["sink"].detail
            daemon = await run_until_idle(settings)
            assert await drained(conn)
            assert await dead(conn) == {}
            messages = await stored(admin)
            events = [m for m in messages if m["subject"].startswith("events.")]
            assert sorted(m["headers"]["Nats-Msg-Id"] for m in events) == sorted(ids)
            assert len(messages) == 10 + 9  # a marker for each event relayd stored
        finally:
            await admin.close()
    reconciled = daemon.metrics.registry.get_sample_value(
        "relayd_outcomes_total", {"outcome": "reconciled"}
    )
    assert reconciled == 1


@pytest.mark.parametrize("subject", ["events.orders", "events.Orders"])
async def test_a_publish_the_user_may_not_make_names_the_permission(
    database: Database, conn: asyncpg.Connection, tmp_path: Path, subject: str
) -> None:
    """C5: the relay's NATS user may not publish on the route's subject. The server drops
    each publish unanswered and says why on the side; the timeout that follows names the
    permission, opens the breaker at once (severe) and uses no attempt; nothing is
    dead-lettered. Once the operator grants it (a configuration reload), every event is
    stored once. (A subject with capitals: nats-py lowercases the server's line.)"""
    denied = RELAY_PERMISSIONS.replace('"events.>", ', "")
    assert denied != RELAY_PERMISSIONS
    with NatsServer(config=denied) as server:
        admin = await nats.connect(server.url, user="admin", password="admin-pw")  # noqa: S106 - the test server's own
        try:
            await add_stream(admin)
            ids = await commit(conn, [event(n) for n in range(10)])
            settings = relay_user_settings(
                database, server, tmp_path, routes=[{"type": "order.updated", "subject": subject}]
            )
            wanted = f"refuses publishes to {subject} (permissions violation)"
            await refused_until_granted(server, admin, conn, settings, ids, wanted)
        finally:
            await admin.close()


async def test_a_reply_subscription_the_user_may_not_make_names_the_permission(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """C5: the relay's NATS user may publish but not subscribe to its reply inbox, so no
    PubAck could reach it. The server says so on the side, at the subscription; relayd
    learns it before it sends anything: `relayd check` fails naming the permission, the
    relay opens the breaker at once (severe), sends nothing, uses no attempt and
    dead-letters nothing. Once the operator grants it (a configuration reload), a new
    connection subscribes and every event is stored once."""
    wanted = "subscribe permission on _INBOX.>"
    with NatsServer(config=NO_REPLY_PERMISSIONS) as server:
        admin = await nats.connect(server.url, user="admin", password="admin-pw")  # noqa: S106 - the test server's own
        try:
            await add_stream(admin)
            ids = await commit(conn, [event(n) for n in range(10)])
            settings = relay_user_settings(database, server, tmp_path)
            lines = {line.name: line for line in await run_checks(settings, "test")}
            assert lines["sink"].verdict is Verdict.FAIL
            assert wanted in lines["sink"].detail
            await refused_until_granted(
                server, admin, conn, settings, ids, wanted, nothing_sent=True
            )
        finally:
            await admin.close()


async def test_a_reply_subscription_revoked_while_running_stops_the_sending(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """The operator revokes the relay's subscribe permission on `_INBOX.>` while it runs
    (a configuration reload): the server drops the subscription and says so on the side.
    relayd fails what waits for an answer and sends nothing more on that connection, naming
    the permission (severe); granted again, a new connection takes over and every event is
    stored once."""
    wanted = "subscribe permission on _INBOX.>"
    with NatsServer(config=RELAY_PERMISSIONS) as server:
        admin = await nats.connect(server.url, user="admin", password="admin-pw")  # noqa: S106 - the test server's own
        try:
            await add_stream(admin)
            first = await commit(conn, [event(n) for n in range(5)])
            async with running(relay_user_settings(database, server, tmp_path)):
                await eventually(lambda: drained(conn))
                server.reload(NO_REPLY_PERMISSIONS)
                later = await commit(conn, [event(n) for n in range(5, 15)])
                await eventually(lambda: an_error_says(conn, wanted))
                assert await dead(conn) == {}
                server.reload(RELAY_PERMISSIONS)
                await eventually(lambda: drained(conn))
            ids = [m["headers"]["Nats-Msg-Id"] for m in await stored(admin)]
            assert sorted(ids) == sorted(first + later)
        finally:
            await admin.close()
