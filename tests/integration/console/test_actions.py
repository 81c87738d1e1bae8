"""The console's safety and its actions over a real database: who may use it (HTTP basic, a
trusted proxy's header), the CSRF token every POST needs, read-only refusal, and each action
the function its command's verb calls, audited with the console user's name: retrying
everything a filter matches (a dry run first, then the rows published and each in one audit
row), a discard, a pause and a resume, a parked key's retry."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import asyncpg

from relayd.testing.emulator.app import RunningEmulator
from tests.integration.console.conftest import LOCAL_USER, dead_letters, served
from tests.support import Database, park_key, relay_settings, run_until_idle


def _basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


async def _audit(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, actor, action, row_count, reason, event_ids::text[] AS ids, filters "
        "FROM relayd.relayd_audit ORDER BY id"
    )


async def test_http_basic_admits_the_password_files_users_only(
    database: Database, tmp_path: Path
) -> None:
    """No credentials, a wrong password or an unknown user: 401 with a challenge, on pages
    and static files alike; the right ones: the page, naming the user."""
    users = tmp_path / "users"
    users.write_text("# operators\nalice:correct horse\nbob:battery staple\n")
    users.chmod(0o600)
    async with served(database, password_file=users) as console:
        for headers in ({}, _basic("alice", "wrong"), _basic("mallory", "correct horse")):
            for path in ("/", "/static/console.css"):
                async with console.client.get(path, headers=headers) as response:
                    assert response.status == 401, (path, headers)
                    assert response.headers["WWW-Authenticate"].startswith("Basic ")
        status, text = await console.page("/", headers=_basic("alice", "correct horse"))
        assert status == 200
        assert '<span class="user"' in text
        assert ">alice</span>" in text
        assert "correct horse" not in text


async def test_a_trusted_proxys_header_names_the_user(database: Database) -> None:
    """Without the header (or with a blank one) the console answers 401; with it, the user
    is its value."""
    async with served(database, proxy_user_header="X-Forwarded-User") as console:
        for headers in ({}, {"X-Forwarded-User": "  "}):
            status, _ = await console.page("/", headers=headers)
            assert status == 401
        status, text = await console.page("/", headers={"X-Forwarded-User": "carol@example"})
        assert status == 200
        assert ">carol@example</span>" in text


async def test_a_post_without_the_users_csrf_token_is_refused(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """Missing, forged, or another user's token: 403, nothing changed, nothing audited."""
    ids = await dead_letters(conn, 2)
    users = tmp_path / "users"
    users.write_text("alice:a-password\nbob:b-password\n")
    users.chmod(0o600)
    alice, bob = _basic("alice", "a-password"), _basic("bob", "b-password")
    async with served(database, password_file=users, actions=True) as console:
        alices = await console.csrf(headers=alice)
        form = {"action": "retry", "id": ids[0], "confirmed": "yes"}
        for token in (None, "0" * 64, alices):
            data = form if token is None else form | {"csrf": token}
            status, text = await console.post("/dead-letters/act", data, headers=bob)
            assert status == 403, token
            assert "CSRF token is missing or not this console" in text
        status, _ = await console.post("/dead-letters/act", form | {"csrf": alices}, headers=alice)
        assert status == 200
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM relayd.outbox "
            "WHERE dead_at IS NULL AND event_id = ANY($1::uuid[])",
            ids,
        )
        == 1
    )
    assert [row["actor"] for row in await _audit(conn)] == ["alice"]


async def test_read_only_shows_no_form_and_refuses_the_raw_post(
    database: Database, conn: asyncpg.Connection
) -> None:
    """Without console.actions no page offers an action, and a POST built by hand, with a
    valid token, is refused all the same."""
    ids = await dead_letters(conn, 3)
    await park_key(conn, "customer-7")
    async with served(database) as console:
        for path in ("/dead-letters", f"/dead-letters/{ids[0]}", "/pauses", "/keys"):
            status, text = await console.page(path)
            assert status == 200
            assert 'method="post"' not in text, path
        token = console.console.gate.csrf_token(LOCAL_USER)
        for path, data in [
            ("/dead-letters/act", {"action": "retry", "scope": "matched", "confirmed": "yes"}),
            ("/pauses/pause", {"reason": "x", "confirmed": "yes"}),
            ("/keys/retry", {"key": "customer-7", "confirmed": "yes"}),
        ]:
            status, text = await console.post(path, data | {"csrf": token})
            assert status == 403, path
            assert "Read-only console" in text
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_audit") == 0
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses") == 0
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL") == 3


async def test_retry_everything_a_filter_matches_dry_run_first_then_published_and_audited(
    database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """1. The filter's form posts a dry run: the count, nothing changed, nothing audited.
    2. Its confirmation retries exactly those rows, in one audit row by the console's user
    naming each row once. 3. A relay then publishes them; the other dead letters stay."""
    matched = await dead_letters(conn, 7, reason="sink_rejected", error="400 bad total")
    others = await dead_letters(conn, 4, reason="max_attempts", error="503 down")
    async with served(database, actions=True) as console:
        status, text = await console.page("/dead-letters?dead_reason=sink_rejected")
        form = dict(
            re.findall(
                r'<input type="hidden" name="(\w+)" value="([^"]*)"',
                text.split('class="bulk"', 1)[1].split("</form>", 1)[0],
            )
        )
        assert form["scope"] == "matched"
        assert form["dead_reason"] == "sink_rejected"
        # 1. The dry run.
        status, text = await console.post(
            "/dead-letters/act", form | {"action": "retry", "reason": "fixed the validator"}
        )
        assert status == 200
        assert re.search(r'<strong id="would-change">7</strong>', text)
        assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_audit") == 0
        assert (
            await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL")
            == 11
        )
        confirm = dict(
            re.findall(
                r'<input type="hidden" name="(\w+)" value="([^"]*)"',
                text.split('class="confirm"', 1)[1].split("</form>", 1)[0],
            )
        )
        # 2. The confirmation.
        status, text = await console.post("/dead-letters/act", confirm)
        assert status == 200
        assert '<span id="changed">7</span>' in text
    [audit] = await _audit(conn)
    assert (audit["actor"], audit["action"], audit["row_count"]) == (LOCAL_USER, "dlq.retry", 7)
    assert audit["reason"] == "fixed the validator"
    assert sorted(audit["ids"]) == sorted(matched)
    # 3. Published by a relay; the others untouched.
    await run_until_idle(relay_settings(database.dsn, emulator.url))
    published = await conn.fetch(
        "SELECT event_id::text AS id FROM relayd.outbox WHERE published_at IS NOT NULL"
    )
    assert sorted(r["id"] for r in published) == sorted(matched)
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL AND event_id = ANY($1)",
            others,
        )
        == 4
    )
    # One audit row per row retried, each naming the action's row.
    named = await conn.fetch(
        "SELECT event_id::text AS id, audit_id FROM relayd.relayd_audit_rows ORDER BY 1"
    )
    assert [r["id"] for r in named] == sorted(matched)
    assert {r["audit_id"] for r in named} == {audit["id"]}


async def test_a_discard_needs_a_reason_and_is_audited_by_id(
    database: Database, conn: asyncpg.Connection
) -> None:
    """One dead letter discarded from its page: refused without a reason, done with one."""
    [event_id] = await dead_letters(conn, 1)
    async with served(database, actions=True) as console:
        token = await console.csrf(f"/dead-letters/{event_id}")
        form = {"csrf": token, "action": "discard", "id": event_id, "confirmed": "yes"}
        status, text = await console.post("/dead-letters/act", form)
        assert status == 400
        assert "reason: required" in text
        status, text = await console.post("/dead-letters/act", form | {"reason": "duplicate"})
        assert status == 200
    row = await conn.fetchrow(
        "SELECT discarded_at IS NOT NULL AS discarded, discard_reason FROM relayd.outbox "
        "WHERE event_id = $1",
        event_id,
    )
    assert row is not None
    assert row["discarded"]
    assert row["discard_reason"] == "duplicate"
    [audit] = await _audit(conn)
    assert (audit["actor"], audit["action"], audit["ids"]) == (
        LOCAL_USER,
        "dlq.discard",
        [event_id],
    )


async def test_pause_resume_and_a_parked_keys_retry_are_confirmed_and_audited(
    database: Database, conn: asyncpg.Connection
) -> None:
    """The first POST asks, the second acts; each action's audit row names the user."""
    [head, *_] = await park_key(conn, "customer-9")
    async with served(database, actions=True) as console:
        token = await console.csrf("/pauses")
        pause = {"csrf": token, "queue": "orders", "reason": "deploy"}
        status, text = await console.post("/pauses/pause", pause)
        assert status == 200
        assert "Pause queue orders" in text
        assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses") == 0
        status, text = await console.post("/pauses/pause", pause | {"confirmed": "yes"})
        assert status == 200
        assert "Paused queue orders" in text
        status, text = await console.page("/pauses")
        assert "deploy" in text
        assert "Resume" in text
        resume = {"csrf": token, "queue": "orders", "confirmed": "yes"}
        status, text = await console.post("/pauses/resume", resume)
        assert status == 200
        assert "Resumed" in text
        status, text = await console.post("/keys/retry", {"csrf": token, "key": "customer-9"})
        assert status == 200
        assert "Dry run" in text
        assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_parked_keys") == 1
        retry = {"csrf": token, "key": "customer-9", "confirmed": "yes", "reason": "db back"}
        status, text = await console.post("/keys/retry", retry)
        assert status == 200
        status, text = await console.post("/keys/retry", retry)
        assert status == 409
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_parked_keys") == 0
    audit = await _audit(conn)
    assert [(a["actor"], a["action"]) for a in audit] == [
        (LOCAL_USER, "pause"),
        (LOCAL_USER, "resume"),
        (LOCAL_USER, "keys.retry"),
    ]
    assert audit[2]["ids"] == [head]
