"""The console in a real headless browser (Debian's Chromium, driven through its own
chromedriver with selenium): sign in, filter the dead letters, dry-run a retry of everything
the filter matches, confirm it, and see the rows published by a relay with one audit row
naming each; a read-only console refuses the action, and a POST made without its page; a
forged CSRF token is refused. Each page's screenshot is written to a temporary directory,
or to the directory RELAYD_TEST_CONSOLE_SCREENSHOTS names (the docs' are made so:
`RELAYD_TEST_CONSOLE_SCREENSHOTS=docs/console pytest tests/acceptance/test_console_browser.py`).

Where Chromium or chromium-driver is missing the tests skip naming the package (and fail
under RELAYD_TEST_REQUIRE_TOOLS=1, as in CI: tests/tools.py).
"""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from relayd.testing.emulator.app import RunningEmulator
from tests import tools
from tests.integration.console.conftest import Served, dead_letters, served
from tests.support import (
    Database,
    eventually,
    park_key,
    produce,
    relay_settings,
    running,
)

SCREENSHOTS_ENV = "RELAYD_TEST_CONSOLE_SCREENSHOTS"
# A laptop's screen.
WINDOW = (1366, 900)
_WAIT_S = 20.0
_T = TypeVar("_T")


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: the test-only directory the environment names, else tmp."""
    named = os.environ.get(SCREENSHOTS_ENV)
    directory = Path(named) if named else tmp_path / "screenshots"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """Headless Chromium at a laptop's size, in Paris time (so that the page's local times
    differ from UTC)."""
    chromium = tools.tool("chromium", "chromium")
    driver_path = tools.tool("chromedriver", "chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--lang=en-GB",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    service = Service(executable_path=str(driver_path), env=os.environ | {"TZ": "Europe/Paris"})
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


async def _in_thread(call: Callable[[], _T]) -> _T:
    """selenium blocks: it runs in a thread while the console serves in this loop."""
    return await asyncio.to_thread(call)


def _sign_in(driver: WebDriver, user: str, password: str) -> None:
    """HTTP basic for every request of the browser, as a user's saved credentials."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}}
    )


def _post(driver: WebDriver, path: str, fields: dict[str, str]) -> int:
    """A POST the page's script did not offer (as another site, or a user, would build):
    its status."""
    status: int = driver.execute_async_script(
        "const [path, fields, done] = arguments;"
        "fetch(path, {method: 'POST', body: new URLSearchParams(fields)})"
        ".then(r => done(r.status), () => done(-1));",
        path,
        fields,
    )
    return status


def _wait(driver: WebDriver, check: Callable[[Any], Any]) -> Any:
    return WebDriverWait(driver, _WAIT_S).until(check)


async def _seed(conn: asyncpg.Connection) -> dict[str, list[str]]:
    """A busy outbox: rows pending, dead letters of two reasons, a pause, a parked key, a
    relay's heartbeat with an open breaker."""
    ready = await produce(conn, 40, queue="orders", job_type="order.created")
    await produce(conn, 12, queue="mail", job_type="mail.send")
    rejected = await dead_letters(conn, 6, reason="sink_rejected", dead_for="2 hours")
    exhausted = await dead_letters(
        conn,
        3,
        job_type="invoice.issue",
        queue="billing",
        reason="max_attempts",
        error="503 Service Unavailable: billing-api is down",
        dead_for="20 minutes",
    )
    await conn.execute(
        "INSERT INTO relayd.relayd_pauses (outbox_table, queue, reason, paused_by) "
        "VALUES ('relayd.outbox', 'mail', 'smtp provider maintenance until 18:00', 'dana')"
    )
    await park_key(conn, "customer-1042")
    await conn.execute(
        "INSERT INTO relayd.relayd_instances (outbox_table, instance_id, host, pid, version, "
        "started_at, last_seen, breaker_state, in_flight, breaker_reason) VALUES "
        "('relayd.outbox', $1, 'relay-a', 4242, '0.1.0', now() - interval '3 hours', now(), "
        "'closed', 3, NULL), "
        "('relayd.outbox', $2, 'relay-b', 977, '0.1.0', now() - interval '1 hour', now(), "
        "'open', 0, 'cannot connect to jobs.internal:8080: connection refused')",
        uuid.uuid4(),
        uuid.uuid4(),
    )
    return {"ready": ready, "rejected": rejected, "exhausted": exhausted}


def _users(tmp_path: Path) -> Path:
    path = tmp_path / "console-users"
    path.write_text("alice:wonderland-7\n")
    path.chmod(0o600)
    return path


async def test_sign_in_filter_dry_run_retry_all_matched_and_see_them_published(  # noqa: PLR0913 - fixtures
    database: Database,
    conn: asyncpg.Connection,
    emulator: RunningEmulator,
    browser: WebDriver,
    shots: Path,
    tmp_path: Path,
) -> None:
    """1. Signed out: no page. 2. Signed in, the overview refreshes in place, in local time.
    3. Filter the dead letters by reason. 4. Retry all matched: the dry run's count, then the
    confirmation. 5. A relay publishes them; one audit row by alice names each once.
    Screenshots of every page on the way."""
    rows = await _seed(conn)
    async with served(
        database, password_file=_users(tmp_path), actions=True, refresh_s=1.0
    ) as console:
        base = str(console.client.make_url("/")).rstrip("/")

        def signed_out() -> str:
            browser.get(base + "/")
            return str(browser.page_source)

        # 1. The challenge is the browser's (no page of the console is shown).
        assert "Overview" not in await _in_thread(signed_out)

        def overview() -> None:
            _sign_in(browser, "alice", "wonderland-7")
            browser.get(base + "/")
            box = browser.find_element(By.ID, "figures")
            _wait(browser, lambda _: box.get_attribute("data-refreshed") == "1")
            time = browser.find_element(By.CSS_SELECTOR, "#figures time")
            assert (time.get_attribute("title") or "").endswith("Z (UTC)")
            assert "CET" in time.text or "GMT+1" in time.text, time.text
            assert browser.find_element(By.CLASS_NAME, "user").text == "alice"
            browser.save_screenshot(str(shots / "overview.png"))

        # 2.
        await _in_thread(overview)

        def filtered() -> list[str]:
            browser.get(base + "/dead-letters")
            select = browser.find_element(By.NAME, "dead_reason")
            select.find_element(By.CSS_SELECTOR, "option[value=sink_rejected]").click()
            browser.find_element(By.CSS_SELECTOR, "form.filters button").click()
            _wait(browser, lambda d: "dead_reason=sink_rejected" in d.current_url)
            browser.save_screenshot(str(shots / "dead-letters.png"))
            return [a.text for a in browser.find_elements(By.CSS_SELECTOR, "table.list a.id")]

        # 3.
        assert sorted(await _in_thread(filtered)) == sorted(rows["rejected"])

        def retried() -> tuple[str, str]:
            bulk = browser.find_element(By.CSS_SELECTOR, "form.bulk")
            bulk.find_element(By.NAME, "reason").send_keys("validator fixed in 4.2.1")
            bulk.find_element(By.CSS_SELECTOR, "button[value=retry]").click()
            would = _wait(browser, lambda d: d.find_element(By.ID, "would-change")).text
            browser.save_screenshot(str(shots / "retry-dry-run.png"))
            browser.find_element(By.CSS_SELECTOR, "form.confirm button").click()
            changed = _wait(browser, lambda d: d.find_element(By.ID, "changed")).text
            browser.save_screenshot(str(shots / "retry-done.png"))
            return would, changed

        # 4.
        assert await _in_thread(retried) == ("6", "6")

        def the_other_pages() -> None:
            for name, path in [
                ("dead-letter", f"/dead-letters/{rows['exhausted'][0]}"),
                ("event", f"/events/{rows['rejected'][0]}"),
                ("pauses", "/pauses"),
                ("parked-keys", "/keys"),
            ]:
                browser.get(base + path)
                _wait(browser, lambda d: d.find_element(By.TAG_NAME, "h1"))
                browser.save_screenshot(str(shots / f"{name}.png"))

        # 5. (A paused queue and a parked key keep rows pending: the relay runs until the
        # retried rows are published, not until idle.)
        async def published() -> bool:
            count = await conn.fetchval(
                "SELECT count(*) FROM relayd.outbox "
                "WHERE published_at IS NOT NULL AND event_id = ANY($1::uuid[])",
                rows["rejected"],
            )
            return bool(count == len(rows["rejected"]))

        async with running(relay_settings(database.dsn, emulator.url)):
            await eventually(published)
        await _in_thread(the_other_pages)
    audit = await conn.fetch(
        "SELECT actor, action, event_ids::text[] AS ids FROM relayd.relayd_audit"
    )
    assert [(a["actor"], a["action"]) for a in audit] == [("alice", "dlq.retry")]
    assert sorted(audit[0]["ids"]) == sorted(rows["rejected"])
    # One audit row per row retried (relayd_audit_rows), each naming alice's action.
    named = await conn.fetch(
        "SELECT r.event_id::text AS id, a.actor FROM relayd.relayd_audit_rows AS r "
        "JOIN relayd.relayd_audit AS a ON a.id = r.audit_id ORDER BY 1"
    )
    assert [(r["id"], r["actor"]) for r in named] == [
        (i, "alice") for i in sorted(rows["rejected"])
    ]
    for name in ("overview", "dead-letters", "retry-dry-run", "retry-done", "dead-letter"):
        assert (shots / f"{name}.png").read_bytes().startswith(b"\x89PNG"), name


async def test_read_only_and_forged_tokens_are_refused_in_the_browser(
    database: Database, conn: asyncpg.Connection, browser: WebDriver
) -> None:
    """A read-only console offers no action and refuses a POST made without its page; an
    acting console refuses a POST with a forged or missing token. Nothing is changed."""
    rows = await _seed(conn)

    async def attempts(console: Served, token: str | None) -> list[int]:
        base = str(console.client.make_url("/")).rstrip("/")

        def run() -> list[int]:
            browser.get(base + "/dead-letters")
            forms = browser.find_elements(By.CSS_SELECTOR, "form[method=post]")
            statuses = [len(forms)]
            fields = {"action": "retry", "id": rows["rejected"][0], "confirmed": "yes"}
            statuses.append(_post(browser, "/dead-letters/act", fields))
            if token is not None:
                statuses.append(_post(browser, "/dead-letters/act", fields | {"csrf": token}))
            return statuses

        return await _in_thread(run)

    async with served(database) as console:
        token = console.console.gate.csrf_token("ops-tester")
        # No form; without a token, and with the user's own: both 403 (read-only).
        assert await attempts(console, token) == [0, 403, 403]
    async with served(database, actions=True) as console:
        # The bulk form is there; a missing and a forged token: 403.
        assert await attempts(console, "f" * 64) == [1, 403, 403]
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_audit") == 0
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL AND discarded_at IS NULL"
        )
        == 9
    )
