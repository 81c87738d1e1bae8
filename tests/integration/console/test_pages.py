"""The console's pages over a real database: the overview's figures are `relayd status`'s,
the dead letters filter with `relayd dlq`'s filters and page by keyset, one dead letter shows
its envelope (its payload hidden unless allowed), an event's timeline, the pauses and parked
keys; every page carries the headers that keep it from loading anything from elsewhere."""

from __future__ import annotations

import re

import asyncpg
import pytest

from relayd.console import pages
from relayd.operator.status import build_report
from relayd.store import Store
from tests.integration.console.conftest import dead_letters, served
from tests.support import Database, park_key, produce, rows_in_every_state


def _rows(text: str) -> list[str]:
    """The event ids a dead-letter page lists, in order."""
    return re.findall(r'<a class="id" href="/dead-letters/([0-9a-f-]{36})"', text)


async def test_the_overview_shows_the_figures_relayd_status_reads(
    database: Database, conn: asyncpg.Connection, store: Store
) -> None:
    """Each backlog state on the overview, and its fragment, is the figure `relayd status`
    reports from the same function."""
    await rows_in_every_state(conn)
    report = await build_report(store, sample_interval_s=5.0, lease_s=30.0)
    async with served(database) as console:
        for path in ("/", "/overview/figures"):
            status, text = await console.page(path)
            assert status == 200
            for state in ("ready", "paused", "scheduled", "leased", "dead"):
                figure = re.search(
                    rf'class="tile state-{state}">\s*<div class="label">{state}</div>\s*'
                    r'<div class="figure">(?:<span class="approx">~</span>)?([\d,]+)</div>',
                    text,
                )
                assert figure is not None, (path, state)
                assert int(figure.group(1).replace(",", "")) == getattr(report.backlog, state)
    assert report.backlog.dead > 0
    assert report.backlog.ready > 0


async def test_the_overview_reads_the_database_once_per_interval_however_often_asked(
    database: Database, conn: asyncpg.Connection
) -> None:
    """Ten overviews and fragments within one sample interval: one status read; the rows
    appended meanwhile show at the next read, not before."""
    await produce(conn, 3)
    async with served(database, sample_interval_s=3600.0) as console:
        for path in ["/", "/overview/figures"] * 5:
            status, text = await console.page(path)
            assert status == 200
            assert re.search(r'<div class="label">ready</div>\s*<div class="figure">3<', text)
        await produce(conn, 2)
        status, text = await console.page("/overview/figures")
        assert re.search(r'<div class="label">ready</div>\s*<div class="figure">3<', text)
        assert console.console.status.reads == 1


async def test_every_page_answers_with_a_strict_content_security_policy(
    database: Database, conn: asyncpg.Connection
) -> None:
    """Every page loads only the console's own script and stylesheet; empty states say what
    to do."""
    async with served(database) as console:
        for path, empty in [
            ("/", "No relay is running"),
            ("/dead-letters", "No dead letters in relayd.outbox"),
            ("/pauses", "Nothing is paused"),
            ("/keys", "No key is parked"),
            ("/events", "Paste an event"),
        ]:
            async with console.client.get(path) as response:
                assert response.status == 200, path
                policy = response.headers["Content-Security-Policy"]
                assert "default-src 'none'" in policy
                assert "script-src 'self'" in policy
                assert response.headers["X-Frame-Options"] == "DENY"
                text = await response.text()
            assert empty in text, path
            assert "http://" not in text, path
            assert "https://" not in text, path
        async with console.client.get("/static/console.js") as response:
            assert response.status == 200
            assert "fetch(" in await response.text()


async def test_dead_letters_filter_by_reason_queue_type_age_and_text(
    database: Database, conn: asyncpg.Connection
) -> None:
    """Each filter narrows the list as `relayd dlq list`'s option of the same meaning."""
    rejected = await dead_letters(conn, 3, reason="sink_rejected", dead_for="3 hours")
    exhausted = await dead_letters(
        conn,
        2,
        job_type="mail.send",
        queue="mail",
        reason="max_attempts",
        error="503 Service Unavailable: smtp relay down",
        dead_for="10 minutes",
    )
    async with served(database) as console:
        cases = {
            "": exhausted[::-1] + rejected[::-1],
            "dead_reason=max_attempts": exhausted[::-1],
            "queue=orders": rejected[::-1],
            "type=mail.send": exhausted[::-1],
            "since=1h": exhausted[::-1],
            "until=1h": rejected[::-1],
            "text=SMTP": exhausted[::-1],
            "text=smtp&queue=orders": [],
        }
        for query, expected in cases.items():
            status, text = await console.page(f"/dead-letters?{query}")
            assert status == 200, query
            assert _rows(text) == expected, query
        status, text = await console.page("/dead-letters?text=smtp&queue=orders")
        assert "No dead letter matches these filters" in text
        status, text = await console.page("/dead-letters?dead_reason=bogus")
        assert status == 400
        assert "is not a dead reason" in text
        status, text = await console.page("/dead-letters?since=yesterday")
        assert status == 400
        assert "since: expected an ISO 8601 time" in text
        assert "--since" not in text
        status, text = await console.page("/dead-letters?since=1h&until=2h")
        assert status == 400
        assert "since (" in text
        assert "must be before until (" in text


async def test_dead_letters_page_by_keyset_without_repeating_or_skipping(
    database: Database, conn: asyncpg.Connection
) -> None:
    """Pages follow each other by a (dead_at, event_id) cursor: every dead letter once,
    newest first, the filter kept from page to page."""
    ids = await dead_letters(conn, 120)
    await dead_letters(conn, 5, queue="other")
    async with served(database) as console:
        seen: list[str] = []
        path: str | None = "/dead-letters?queue=orders"
        pages = 0
        while path is not None:
            status, text = await console.page(path)
            assert status == 200
            seen += _rows(text)
            pages += 1
            found = re.search(r'<a rel="next" href="([^"]+)"', text)
            path = None if found is None else found.group(1).replace("&amp;", "&")
            if path is not None:
                assert "queue=orders" in path
        assert pages == 3
        assert seen == ids[::-1]
        status, _ = await console.page("/dead-letters?before=not-a-cursor")
        assert status == 400


async def test_a_dead_letter_shows_its_envelope_with_the_payload_hidden_by_default(
    database: Database, conn: asyncpg.Connection
) -> None:
    """Size and top-level keys only, unless console.show_payloads; its error, attempts and
    timeline always."""
    [event_id] = await dead_letters(conn, 1)
    await conn.execute(
        "UPDATE relayd.outbox SET job = jsonb_set(job, '{args}', "
        '\'[{"card": "4111-secret", "total": 5}]\') WHERE event_id = $1',
        event_id,
    )
    async with served(database) as console:
        status, text = await console.page(f"/dead-letters/{event_id}")
        assert status == 200
        assert "4111-secret" not in text
        assert "array of 1 items" in text
        assert "object keys: card, total" in text
        assert "total must be positive" in text
        assert "Timeline" in text
        assert "dead-lettered: sink_rejected" in text
    async with served(database, show_payloads=True) as console:
        status, text = await console.page(f"/dead-letters/{event_id}")
        assert "4111-secret" in text


async def test_an_events_timeline_by_id(database: Database, conn: asyncpg.Connection) -> None:
    """Created, attempted, published: in order, with the row's state; an unknown id is a
    404 page, a malformed one a 400."""
    [event_id] = await produce(conn, 1)
    await conn.execute(
        "UPDATE relayd.outbox SET attempts = 2, last_attempt_at = now() - interval '1 minute', "
        "last_error = '503 busy', published_at = now(), created_at = now() - interval '1 hour' "
        "WHERE event_id = $1",
        event_id,
    )
    async with served(database) as console:
        status, text = await console.page(f"/events?id={event_id}", allow_redirects=True)
        assert status == 200
        assert ">published</span>" in text
        timeline = text[text.index('<ol class="timeline">') :]
        order = [timeline.index(step) for step in (">created<", ">claimed<", ">published<")]
        assert order == sorted(order)
        status, _ = await console.page("/events/0193a1b2-0000-7000-8000-000000000000")
        assert status == 404
        status, text = await console.page("/events?id=nope")
        assert status == 400


async def test_pauses_and_parked_keys_are_listed(
    database: Database, conn: asyncpg.Connection, store: Store
) -> None:
    """The pauses `relayd pause` wrote and the keys `relayd keys list` shows, without their
    verbs in read-only mode."""
    await store.pause("orders", "*", "deploy in progress", "alice")
    await park_key(conn, "customer-42")
    async with served(database) as console:
        status, text = await console.page("/pauses")
        assert status == 200
        assert "deploy in progress" in text
        assert "alice" in text
        assert "Resume" not in text
        assert "<form" not in text
        _status, text = await console.page("/keys")
        assert "customer-42" in text
        assert "inventory-db is down" in text
        assert "Retry" not in text
        assert "<form" not in text


async def test_a_database_gone_shows_as_a_page_not_a_crash(
    database: Database, conn: asyncpg.Connection
) -> None:
    """The pool closed under the console: the overview (its sampler's read) and a list page
    answer 503 saying the database is unavailable, naming no DSN."""
    await dead_letters(conn, 1)
    async with served(database) as console:
        await console.console.store.close()
        for path in ("/", "/dead-letters"):
            status, text = await console.page(path)
            assert status == 503, path
            assert "Database unavailable" in text
            assert database.dsn not in text


async def test_a_url_token_in_an_error_never_reaches_a_page(
    database: Database, conn: asyncpg.Connection
) -> None:
    """An error quoting a URL with a token (a receiver's answer, an old row): redacted on the
    list and on the dead letter's page."""
    [event_id] = await dead_letters(
        conn, 1, error="POST https://hooks.example/h/AbCdEf0123456789xyz?key=s3cr3t: 400"
    )
    async with served(database) as console:
        for path in ("/dead-letters", f"/dead-letters/{event_id}", f"/events/{event_id}"):
            status, text = await console.page(path)
            assert status == 200
            assert "https://hooks.example/h/***?***" in text, path
            assert "s3cr3t" not in text, path
            assert "AbCdEf0123456789xyz" not in text, path


async def test_a_sparse_filter_reads_a_bounded_window_per_page_and_reads_on(
    database: Database, conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pages reading at most 10 dead letters, a filter matching only the 5 oldest of 35
    shows empty pages that read on, then those 5, newest first, each once."""
    monkeypatch.setattr(pages, "PAGE_WINDOW", 10)
    mail = await dead_letters(conn, 5, queue="mail", dead_for="2 hours")
    await dead_letters(conn, 30, queue="orders", dead_for="1 hour")
    async with served(database) as console:
        seen: list[str] = []
        path: str | None = "/dead-letters?queue=mail"
        reads = 0
        while path is not None:
            status, text = await console.page(path)
            assert status == 200
            seen += _rows(text)
            reads += 1
            if not _rows(text):
                assert "None of the 10 dead letters read for this page matches" in text
            found = re.search(r'<a rel="next" href="([^"]+)"', text)
            path = None if found is None else found.group(1).replace("&amp;", "&")
        assert seen == mail[::-1]
        assert reads == 4  # 30 newer rows read 10 at a time, then the 5 (and the index's end)
