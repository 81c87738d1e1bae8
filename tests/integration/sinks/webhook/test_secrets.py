"""Each endpoint its own secrets: a route's `secret_file` signs its endpoint's deliveries, each
verified by a receiver that accepts that secret alone (the `standardwebhooks` package), and
each file rotates on its own, under the same bound as the shared one."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import asyncpg
import structlog

from relayd.core.envelope import META_OCCURRED_AT, Envelope
from relayd.core.outcomes import Published
from relayd.core.rows import ClaimedRow
from relayd.operator.check import Verdict, run_checks
from relayd.sinks import SendWindow
from relayd.sinks.webhook.settings import WebhookSettings
from relayd.sinks.webhook.sink import WebhookSink
from relayd.testing.webhook_receiver import Receiver, receiving
from tests.integration.sinks.webhook.test_sink import (
    WHEN,
    commit,
    webhook_settings,
    write_secrets,
)
from tests.support import (
    Database,
    SinkHealthRecord,
    claimed,
    drained,
    eventually,
    run_until_idle,
    running,
)

SHARED = "whsec_" + base64.b64encode(b"s" * 32).decode()
A_OLD = "whsec_" + base64.b64encode(b"a" * 32).decode()
A_NEW = "whsec_" + base64.b64encode(b"A" * 32).decode()
B_ONLY = "whsec_" + base64.b64encode(b"b" * 32).decode()


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    shared, a, b = tmp_path / "shared", tmp_path / "a", tmp_path / "b"
    write_secrets(shared, SHARED)
    write_secrets(a, A_OLD)
    write_secrets(b, B_ONLY)
    return shared, a, b


def _routes(a: Receiver, a_file: Path, b: Receiver, b_file: Path) -> list[dict[str, str]]:
    return [
        {"type": "order.a", "url": a.endpoint(), "secret_file": str(a_file)},
        {"type": "order.b", "url": b.endpoint(), "secret_file": str(b_file)},
    ]


def _signatures(receiver: Receiver, event_id: str) -> int:
    return len(receiver.stored[event_id].headers["webhook-signature"].split(" "))


async def test_each_endpoint_is_signed_with_its_own_secrets(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """Two routes with their own secret files and the shared one for sink.url: every row
    reaches its receiver, which accepts its own secret alone, signed once; none refused."""
    shared_file, a_file, b_file = _files(tmp_path)
    ids = {kind: await commit(conn, 20, f"order.{kind}") for kind in ("a", "b", "other")}
    async with (
        receiving([SHARED]) as shared,
        receiving([A_OLD]) as a,
        receiving([B_ONLY]) as b,
    ):
        settings = webhook_settings(
            database.dsn,
            shared_file,
            url=shared.endpoint(),
            routes=_routes(a, a_file, b, b_file),
        )
        await run_until_idle(settings)
    assert await drained(conn)
    for receiver, kind in ((a, "a"), (b, "b"), (shared, "other")):
        assert receiver.refused == []
        assert sorted(receiver.stored) == sorted(ids[kind])
        assert {_signatures(receiver, event_id) for event_id in ids[kind]} == {1}


async def test_relayd_check_counts_the_secrets_of_every_file(
    database: Database, tmp_path: Path
) -> None:
    """`relayd check` reads every endpoint's file and says how many secrets sign in how many
    files, naming each file's key."""
    shared_file, a_file, b_file = _files(tmp_path)
    write_secrets(a_file, A_OLD, A_NEW)
    async with receiving([SHARED]) as shared, receiving([A_OLD]) as a, receiving([B_ONLY]) as b:
        settings = webhook_settings(
            database.dsn, shared_file, url=shared.endpoint(), routes=_routes(a, a_file, b, b_file)
        )
        lines = {line.name: line for line in await run_checks(settings, "test")}
    assert lines["sink"].verdict is Verdict.OK
    assert (
        "endpoints answer; 4 signing secrets in 3 files (sink.secret_file, "
        "sink.routes.0.secret_file, sink.routes.1.secret_file)"
    ) in lines["sink"].detail


async def test_one_endpoint_rotates_its_secret_alone_mid_run(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """Endpoint a's file gains a second secret while relayd runs, its receiver moves over,
    the old line goes: no delivery to either endpoint is refused, and b's deliveries stay
    signed with b's one secret throughout."""
    shared_file, a_file, b_file = _files(tmp_path)
    async with receiving([A_OLD]) as a, receiving([B_ONLY]) as b:
        settings = webhook_settings(database.dsn, shared_file, routes=_routes(a, a_file, b, b_file))
        async with running(settings):
            first = await commit(conn, 10, "order.a") + await commit(conn, 10, "order.b")
            await eventually(lambda: drained(conn))
            write_secrets(a_file, A_OLD, A_NEW)
            to_a: list[str] = []

            async def both_sign() -> bool:
                # A row at a time, until one to a is signed with both of its secrets.
                to_a.extend(await commit(conn, 1, "order.a"))
                await a.wait_for(lambda r: to_a[-1] in r.stored)
                return _signatures(a, to_a[-1]) == 2

            await eventually(both_sign, timeout_s=10)
            a.secrets = [A_NEW]  # receiver a moves over
            write_secrets(a_file, A_NEW)  # then its old secret is retired
            last = await commit(conn, 10, "order.a") + await commit(conn, 10, "order.b")
            await eventually(lambda: drained(conn))
    assert a.refused == b.refused == []
    assert set(first + to_a + last) == set(a.stored) | set(b.stored)
    assert {_signatures(b, event_id) for event_id in b.stored} == {1}


async def test_the_rotation_bound_holds_for_each_file(tmp_path: Path) -> None:
    """The bound, per file: after 60 s idle on the sink's clock, a's file is rewritten; every
    delivery starting more than a second later is signed with a's new secret, while b's
    deliveries, at the same moment, are still signed with b's untouched file."""
    shared_file, a_file, b_file = _files(tmp_path)
    now = [1000.0]
    async with receiving([A_OLD]) as a, receiving([B_ONLY]) as b:
        routed = webhook_settings(
            "postgresql://unused@127.0.0.1/x", shared_file, routes=_routes(a, a_file, b, b_file)
        ).sink
        assert isinstance(routed, WebhookSettings)
        sink = WebhookSink(routed, SinkHealthRecord(), files_clock=lambda: now[0])
        await sink.start()
        try:
            window = SendWindow(asyncio.get_running_loop().time() + 60)
            rows = [_row("order.a"), _row("order.b")]
            await sink.publish(rows[:1], _envelopes(rows), window=window)
            await sink.publish(rows[1:], _envelopes(rows), window=window)
            now[0] += 60.0  # idle
            with structlog.testing.capture_logs() as logs:
                write_secrets(a_file, A_NEW)
                a.secrets = [A_NEW]  # receiver a has moved over: its old secret fails
                now[0] += 1.0  # the bound
                later = [_row(f"order.{kind}") for kind in "ab" for _ in range(40)]
                envelopes = _envelopes(later)
                outcomes = await asyncio.gather(
                    *(sink.publish([row], envelopes, window=window) for row in later)
                )
        finally:
            await sink.close()
    assert a.refused == b.refused == []
    assert len(a.stored) == len(b.stored) == 41
    assert all(isinstance(o, Published) for outcome in outcomes for o in outcome.values())
    reloads = [entry["path"] for entry in logs if entry["event"] == "sink.token_reloaded"]
    assert reloads == [str(a_file)]


def _row(event_type: str) -> ClaimedRow:
    return claimed(type=event_type, args=[{}], meta={META_OCCURRED_AT: WHEN})


def _envelopes(rows: list[ClaimedRow]) -> dict[str, Envelope]:
    return {row.event_id: Envelope.parse(row.job, row.event_id) for row in rows}
