"""The webhook sink through the daemon, against an independent receiver that verifies every
delivery with the `standardwebhooks` package and refuses stale timestamps: every row
arrives and verifies (across a secret rotation too), slow-downs, drops after storing and slow
answers lose nothing, and a 410 pauses its route once, audited, dead-lettering nothing,
until an operator's resume lets it through at once."""

from __future__ import annotations

import asyncio
import base64
import os
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import structlog

from relayd.core.envelope import META_OCCURRED_AT, Envelope
from relayd.core.outcomes import Published
from relayd.core.rows import ClaimedRow
from relayd.operator.check import Verdict, run_checks
from relayd.operator.status import build_report
from relayd.producer import enqueue_many, new_job
from relayd.settings import Settings
from relayd.sinks import SendWindow
from relayd.sinks.webhook.sink import WebhookSink
from relayd.store import Store
from relayd.testing.processes import free_port
from relayd.testing.webhook_receiver import Fault, receiving
from tests.support import (
    FAST,
    Database,
    SinkHealthRecord,
    claimed,
    drained,
    eventually,
    pending,
    run_until_idle,
    running,
)

WHEN = "2024-05-01T12:00:00Z"
OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
NEW = "whsec_" + base64.b64encode(b"n" * 32).decode()
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def webhook_settings(dsn: str, secret_file: Path, **sink: Any) -> Settings:
    """FAST, with `[sink] kind = "webhook"` signing with `secret_file`."""
    merged: dict[str, dict[str, Any]] = {name: dict(values) for name, values in FAST.items()}
    merged["database"] = {"dsn": dsn}
    merged["sink"] = {
        "kind": "webhook",
        "timeout_s": 2.0,
        "connect_timeout_s": 1.0,
        "concurrency": 16,
        "secret_file": str(secret_file),
    } | sink
    return Settings(**merged)  # type: ignore[arg-type]


def write_secrets(path: Path, *secrets: str) -> None:
    """Rewrite the secret file as an operator does: a new file renamed over the old one."""
    staged = path.with_suffix(".new")
    staged.write_text("\n".join(secrets) + "\n")
    os.replace(staged, path)


async def commit(conn: asyncpg.Connection, count: int, event_type: str = "order.paid") -> list[str]:
    jobs = [new_job(event_type, [{"n": n}], meta={META_OCCURRED_AT: WHEN}) for n in range(count)]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    return [str(job["id"]) for job in jobs]


async def dead(conn: asyncpg.Connection) -> list[tuple[str, str]]:
    rows = await conn.fetch(
        "SELECT dead_reason, last_error FROM relayd.outbox WHERE dead_at IS NOT NULL"
    )
    return [(row["dead_reason"], row["last_error"]) for row in rows]


async def test_every_row_arrives_once_signed_with_its_event_id(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """C1: each row is one verified delivery, webhook-id its event id, its body the event;
    each row is marked published."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    ids = await commit(conn, 120)
    async with receiving([OLD]) as receiver:
        await run_until_idle(webhook_settings(database.dsn, secret_file, url=receiver.endpoint()))
    assert await drained(conn)
    assert await dead(conn) == []
    assert sorted(receiver.stored) == sorted(ids)
    assert set(receiver.seen.values()) == {1}
    assert receiver.refused == []
    first = receiver.stored[ids[0]]
    assert first.body == {"type": "order.paid", "timestamp": WHEN, "data": {"n": 0}}
    assert first.headers["content-type"] == "application/json"


async def test_a_secret_rotation_mid_run_loses_no_delivery(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """The secret file rewritten while relayd runs: both secrets sign, the receiver moves to
    the new one, the old line goes; every delivery verifies, none is refused."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    async with receiving([OLD]) as receiver:
        settings = webhook_settings(database.dsn, secret_file, url=receiver.endpoint())
        async with running(settings):
            first = await commit(conn, 20)
            await receiver.wait_for(lambda r: set(first) <= set(r.stored))
            write_secrets(secret_file, OLD, NEW)
            signed_twice: list[str] = []

            async def both_sign() -> bool:
                # A row at a time, until one is signed with both secrets.
                signed_twice.extend(await commit(conn, 1))
                await receiver.wait_for(lambda r: signed_twice[-1] in r.stored)
                delivery = receiver.stored[signed_twice[-1]]
                return len(delivery.headers["webhook-signature"].split(" ")) == 2

            await eventually(both_sign, timeout_s=10)
            receiver.secrets = [NEW]  # the receiver moves over
            write_secrets(secret_file, NEW)  # then the old secret is retired
            last = await commit(conn, 20)
            await receiver.wait_for(lambda r: set(last) <= set(r.stored))
            await eventually(lambda: drained(conn))
    assert receiver.refused == []
    assert set(first + signed_twice + last) == set(receiver.stored)


async def test_a_rotation_after_a_long_idle_spell_signs_every_later_delivery_anew(
    tmp_path: Path,
) -> None:
    """The rotation bound: every delivery that starts more than a second after the secret
    file changed is signed with the new secrets, however long the sink was idle before (60 s
    on the sink's clock): 40 deliveries at once after the change all verify against the new
    secret alone."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    now = [1000.0]
    async with receiving([OLD]) as receiver:
        settings = webhook_settings("postgresql://unused@127.0.0.1/x", secret_file)
        sink = WebhookSink(
            settings.sink.model_copy(update={"url": receiver.endpoint()}),  # type: ignore[arg-type]
            SinkHealthRecord(),
            files_clock=lambda: now[0],
        )
        await sink.start()
        try:
            window = SendWindow(asyncio.get_running_loop().time() + 60)
            first = _rows(1)
            await sink.publish(first, _envelopes(first), window=window)
            assert list(receiver.stored) == [first[0].event_id]  # signed with the old secret
            now[0] += 60.0  # idle
            write_secrets(secret_file, NEW)
            receiver.secrets = [NEW]  # the receiver has moved over: the old secret fails
            now[0] += 1.0  # the bound
            rows = _rows(40)
            envelopes = _envelopes(rows)
            outcomes = await asyncio.gather(
                *(sink.publish([row], envelopes, window=window) for row in rows)
            )
        finally:
            await sink.close()
    assert receiver.refused == []
    assert sorted(receiver.stored) == sorted(row.event_id for row in first + rows)
    assert all(isinstance(o, Published) for outcome in outcomes for o in outcome.values())


def _rows(count: int) -> list[ClaimedRow]:
    """Rows of webhook events, as a claim returns them."""
    return [
        claimed(type="order.paid", args=[{"n": n}], meta={META_OCCURRED_AT: WHEN})
        for n in range(count)
    ]


def _envelopes(rows: list[ClaimedRow]) -> dict[str, Envelope]:
    return {row.event_id: Envelope.parse(row.job, row.event_id) for row in rows}


async def test_slow_downs_drops_and_slow_answers_lose_nothing(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """503 with a Retry-After, 429, a connection dropped after the receiver stored, an answer
    slower than the attempt's deadline: every row ends published, no attempt is used up, each
    id is seen at least once and only the ambiguous ones twice."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    ids = await commit(conn, 60)
    faults = {
        ids[0]: Fault(503, {"Retry-After": "1"}, store=False),
        ids[1]: Fault(429, store=False),
        ids[2]: Fault(drop=True),
        ids[3]: Fault(drop=True),
        ids[4]: Fault(delay_s=2.5),  # past the 2 s attempt deadline: no answer
        ids[5]: Fault(delay_s=0.3),  # slow, but within it
    }

    arrivals: Counter[str] = Counter()

    def script(path: str, webhook_id: str, before: int) -> Fault | None:
        arrivals[webhook_id] += 1  # stored or not: each fault strikes once
        return faults.get(webhook_id) if arrivals[webhook_id] == 1 else None

    async with receiving([OLD], script) as receiver:
        await run_until_idle(webhook_settings(database.dsn, secret_file, url=receiver.endpoint()))
    assert await drained(conn)
    assert await dead(conn) == []
    assert set(receiver.stored) == set(ids)
    twice = {webhook_id for webhook_id, count in receiver.seen.items() if count > 1}
    assert twice == {ids[2], ids[3], ids[4]}
    assert max(receiver.seen.values()) == 2
    attempts = await conn.fetchval(
        "SELECT max(attempts) FROM relayd.outbox WHERE event_id = ANY($1::uuid[])", ids[:2]
    )
    assert attempts == 1  # the slow-downs gave their attempts back


async def test_a_410_pauses_its_route_once_and_a_resume_lets_it_through_at_once(
    database: Database, conn: asyncpg.Connection, store: Store, tmp_path: Path
) -> None:
    """1. An endpoint answers 410 Gone to many deliveries at once: its type is paused once
    (one pause row, one audit row) with the answer as the reason; its rows stay pending, due
    and held by the pause (`relayd status`'s paused count and the pause's held rows agree);
    other routes flow; nothing is dead-lettered. 2. The operator resumes it while the relay
    runs: the held rows, and rows committed after the resume, are delivered at once, without
    waiting out any hold the 410 left in the process."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    gone = True

    def script(path: str, webhook_id: str, before: int) -> Fault | None:
        return Fault(410, store=False) if path == "gone" and gone else None

    async with receiving([OLD], script) as receiver:
        routes = [
            {"type": "order.paid", "url": receiver.endpoint("hooks")},
            {"type": "order.lost", "url": receiver.endpoint("gone")},
        ]
        settings = webhook_settings(database.dsn, secret_file, routes=routes)
        paid = await commit(conn, 30)
        lost = await commit(conn, 60, "order.lost")
        async with running(settings) as daemon:
            await receiver.wait_for(lambda r: set(paid) <= set(r.stored))

            async def held() -> bool:
                # Every lost row settled and due: the pause alone holds it.
                due: int = await conn.fetchval(
                    "SELECT count(*) FROM relayd.outbox WHERE event_id = ANY($1::uuid[]) "
                    "AND lease_owner IS NULL AND available_at <= now()",
                    lost,
                )
                counted = daemon.metrics.registry.get_sample_value("relayd_sink_pauses_total")
                return due == len(lost) and counted == 1

            await eventually(held)
            # 1.
            pause = await conn.fetchrow("SELECT queue, type, reason FROM relayd.relayd_pauses")
            assert pause is not None
            assert (pause["queue"], pause["type"]) == ("*", "order.lost")
            assert "410" in pause["reason"]
            assert receiver.endpoint("gone") in pause["reason"]
            audit = await conn.fetch("SELECT action, reason FROM relayd.relayd_audit")
            assert [(row["action"], row["reason"]) for row in audit] == [("pause", pause["reason"])]
            report = await build_report(store, sample_interval_s=1.0, lease_s=10.0)
            [holding] = report.pauses
            assert holding.rows == report.backlog.paused == len(lost)
            assert await dead(conn) == []
            assert not set(lost) & set(receiver.stored)

            # 2. The operator's runbook: the endpoint is back, resume the type.
            gone = False
            assert await store.resume("*", "order.lost", "alice", "the endpoint is back")
            later = await commit(conn, 5, "order.lost")
            await receiver.wait_for(lambda r: set(lost + later) <= set(r.stored), timeout_s=5)
            await eventually(lambda: drained(conn))
    assert await dead(conn) == []
    actions = await conn.fetch("SELECT action FROM relayd.relayd_audit ORDER BY id")
    assert [row["action"] for row in actions] == ["pause", "resume"]


async def test_relayd_check_states_the_webhook_guarantee(
    database: Database, tmp_path: Path
) -> None:
    """`relayd check`: the endpoints answer, how many secrets sign, the retry horizon a
    receiver must remember ids for, and C2 for webhooks; an endpoint nobody listens on
    fails the line."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD, NEW)
    async with receiving([OLD]) as receiver:
        settings = webhook_settings(database.dsn, secret_file, url=receiver.endpoint())
        lines = {line.name: line for line in await run_checks(settings, "test")}
    assert lines["sink"].verdict is Verdict.OK
    assert "2 signing secrets" in lines["sink"].detail
    horizon_s = settings.sink.retry_horizon_s
    assert horizon_s is not None
    assert f"retry horizon {horizon_s:g}s: keep each webhook-id" in lines["sink"].detail
    assert "at least once, deduplicated by webhook-id at the receiver" in lines["sink"].detail
    gone = webhook_settings(database.dsn, secret_file, url=f"http://127.0.0.1:{free_port()}/")
    lines = {line.name: line for line in await run_checks(gone, "test")}
    assert lines["sink"].verdict is Verdict.FAIL
    assert "unreachable" in lines["sink"].detail


async def test_a_valid_traceparent_travels_and_junk_does_not(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """The producer's meta.traceparent arrives as the traceparent header; a value with a
    line break in it is not sent, and its row is delivered all the same."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    good = new_job("order.paid", [{}], meta={META_OCCURRED_AT: WHEN, "traceparent": TRACE})
    junk = new_job(
        "order.paid", [{}], meta={META_OCCURRED_AT: WHEN, "traceparent": TRACE + "\r\nX-A: 1"}
    )
    async with conn.transaction():
        await enqueue_many(conn, [good, junk])
    async with receiving([OLD]) as receiver:
        await run_until_idle(webhook_settings(database.dsn, secret_file, url=receiver.endpoint()))
    assert receiver.stored[good["id"]].headers["traceparent"] == TRACE
    assert "traceparent" not in receiver.stored[junk["id"]].headers
    assert "x-a" not in receiver.stored[junk["id"]].headers


async def test_a_refused_signature_dead_letters_nothing_until_the_secret_is_fixed(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """A receiver that refuses our signature (401) is the sink's failure, not the rows':
    nothing is dead-lettered, no secret is logged, and once the operator writes the right
    secret (a bad rewrite in between is ignored) every row arrives."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    ids = await commit(conn, 10)
    async with receiving([NEW]) as receiver:
        settings = webhook_settings(database.dsn, secret_file, url=receiver.endpoint())
        with structlog.testing.capture_logs() as logs:
            async with running(settings):
                await receiver.wait_for(lambda r: len(r.refused) >= 1)
                secret_file.write_text("whsec_not-base64!\n")  # a mistake: kept the old one
                # Each 401 has the file read again: two more, and the mistake was seen.
                before = len(receiver.refused)
                await receiver.wait_for(lambda r: len(r.refused) >= before + 2)
                write_secrets(secret_file, NEW)
                await receiver.wait_for(lambda r: set(ids) <= set(r.stored))
                await eventually(lambda: drained(conn))
    assert await dead(conn) == []
    shown = repr(logs)
    assert OLD.removeprefix("whsec_") not in shown
    assert NEW.removeprefix("whsec_") not in shown
    assert any(entry["event"] == "sink.token_unreadable" for entry in logs)


async def test_redirects_are_not_followed_and_answers_are_read_with_a_bound(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """A 307 to another endpoint is not followed (nothing reaches it, nothing is
    dead-lettered); a 400 with a 10 MiB page dead-letters its row with a short excerpt."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    redirected = await commit(conn, 1, "order.moved")
    refused = await commit(conn, 1, "order.refused")
    page = b"<html><body>" + b"no such order " * (10 * 1024 * 1024 // 14) + b"</body></html>"
    async with receiving([OLD]) as elsewhere, receiving([OLD]) as receiver:
        moved = Fault(307, {"Location": elsewhere.endpoint()}, store=False)

        def script(path: str, webhook_id: str, before: int) -> Fault | None:
            return moved if path == "moved" else Fault(400, body=page, store=False)

        receiver.script = script
        routes = [
            {"type": "order.moved", "url": receiver.endpoint("moved")},
            {"type": "order.refused", "url": receiver.endpoint("refused")},
        ]
        settings = webhook_settings(database.dsn, secret_file, routes=routes)
        async with running(settings):

            async def settled() -> bool:
                return await pending(conn) == 1 and len(receiver.refused) == 0

            await eventually(settled)
    assert elsewhere.seen == Counter()
    assert elsewhere.stored == {}
    [(reason, error)] = await dead(conn)
    assert reason == "sink_rejected"
    assert error.startswith("HTTP 400: no such order no such order")
    assert len(error) < 200
    dead_ids = await conn.fetch(
        "SELECT event_id::text FROM relayd.outbox WHERE dead_at IS NOT NULL"
    )
    assert [row["event_id"] for row in dead_ids] == refused
    assert redirected[0] not in refused


async def test_a_slowed_endpoint_holds_back_only_its_own_rows(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """The slow-down is per endpoint: one answering 503 with a long Retry-After is left
    alone (its rows wait unsent, no attempt used, nothing dead-lettered) while another
    endpoint's rows are all delivered."""
    secret_file = tmp_path / "whsec"
    write_secrets(secret_file, OLD)
    fast = await commit(conn, 20, "order.paid")
    busy = await commit(conn, 100, "order.busy")

    arrivals_at_busy: list[str] = []

    def script(path: str, webhook_id: str, before: int) -> Fault | None:
        if path != "busy":
            return None
        arrivals_at_busy.append(webhook_id)
        return Fault(503, {"Retry-After": "30"}, store=False)

    async with receiving([OLD], script) as receiver:
        routes = [
            {"type": "order.paid", "url": receiver.endpoint("fast")},
            {"type": "order.busy", "url": receiver.endpoint("busy")},
        ]
        settings = webhook_settings(database.dsn, secret_file, routes=routes)
        async with running(settings):
            await receiver.wait_for(lambda r: set(fast) <= set(r.stored))

            async def all_held() -> bool:
                # Every busy row was tried or held once (none is in flight or unclaimed).
                held: int = await conn.fetchval(
                    "SELECT count(*) FROM relayd.outbox WHERE event_id = ANY($1::uuid[]) "
                    "AND available_at > now() + interval '5 s'",
                    busy,
                )
                return held == len(busy)

            await eventually(all_held)
    # Before its first 503 was read, at most the 16 concurrent requests (and one per slot a
    # fast row freed) went to the busy endpoint; after it, none.
    assert len(arrivals_at_busy) <= 16 + len(fast)
    assert await dead(conn) == []
    attempts = await conn.fetchval(
        "SELECT max(attempts) FROM relayd.outbox WHERE event_id = ANY($1::uuid[])", busy
    )
    assert attempts == 0
