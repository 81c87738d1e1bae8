"""The emulator's scripted faults, its ledger, reset and clock over real loopback HTTP, and its
entry points (options, the listen address, running until SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from relayd.config.sections import parse_listen
from relayd.testing.emulator import (
    Emulator,
    config_from_options,
    uuid7,
)
from relayd.testing.emulator.faults import FaultRule
from tests.emulator.client import (
    BATCH,
    DISCONNECTED,
    JOBS,
    REPO_ROOT,
    call,
    fetch,
    job,
)
from tests.support import StartEmulator

# --- faults ------------------------------------------------------------------------------


async def test_status_fault_with_retry_after_then_normal(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A status rule answers its status and Retry-After `times` times without storing."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(action="status", method="POST", path=JOBS, status=429, retry_after="3", times=2)
    )
    sent = job()
    answers = [await call(http, "POST", running.url + JOBS, sent) for _ in range(3)]
    assert [a.status for a in answers] == [429, 429, 201]
    assert answers[0].headers["Retry-After"] == "3"
    assert answers[0].body["error"]["code"] == "rate_limited"
    assert answers[0].body["error"]["retryable"] is True
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.created, entry.posts, entry.post_statuses) == (1, 3, (429, 429, 201))


async def test_drop_fault_disconnects_without_storing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """drop: the client sees a disconnect and the job was not stored."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="drop", method="POST", path=JOBS))
    sent = job()
    with pytest.raises(DISCONNECTED):
        await call(http, "POST", running.url + JOBS, sent)
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.job, entry.created, entry.posts, entry.post_statuses) == (None, 0, 1, (None,))


async def test_store_then_drop_stores_and_disconnects(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """store_then_drop: the job IS stored, yet the client gets no answer, only a disconnect."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="store_then_drop", method="POST", path=JOBS))
    sent = job()
    with pytest.raises(DISCONNECTED):
        await call(http, "POST", running.url + JOBS, sent)
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.created, entry.post_statuses) == (1, (None,))
    retry = await call(http, "POST", running.url + JOBS, sent)
    assert (retry.status, retry.body["error"]["code"]) == (409, "duplicate")
    assert (await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")).status == 200


async def test_store_then_drop_batch(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """store_then_drop on a batch stores every item and answers nothing."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="store_then_drop", path=BATCH))
    items = [job(), job()]
    with pytest.raises(DISCONNECTED):
        await call(http, "POST", running.url + BATCH, {"jobs": items})
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [1, 1]


async def test_store_then_delay_outlives_the_client_timeout(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """store_then_delay: the client times out, but the job was stored before the delay."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(action="store_then_delay", method="POST", path=JOBS, delay_ms=60_000)
    )
    sent = job()
    with pytest.raises(TimeoutError):
        await call(http, "POST", running.url + JOBS, sent, timeout_s=0.3)
    assert running.emulator.ledger()[sent["id"]].created == 1


async def test_store_then_status_answers_an_error_after_storing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """store_then_status: a 500 after a commit, the ambiguous case relayd must reconcile."""
    running = await start()
    running.emulator.add_fault(FaultRule(action="store_then_status", path=JOBS, status=500))
    sent = job()
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert (answer.status, answer.body["error"]["code"]) == (500, "internal_error")
    assert running.emulator.ledger()[sent["id"]].created == 1


async def test_latency_fault_delays_then_processes(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """latency: the request is answered normally after the delay, and the rule counts it."""
    running = await start()
    rule_id = running.emulator.add_fault(FaultRule(action="latency", path=JOBS, delay_ms=50))
    answer = await call(http, "POST", running.url + JOBS, job())
    assert answer.status == 201
    assert running.emulator.fault_fired(rule_id) == 1


async def test_fault_targets_one_job_id(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """A rule with job_id fires only for requests carrying that id (POST, batch or GET)."""
    running = await start()
    target, other = job(), job()
    running.emulator.add_fault(
        FaultRule(action="status", status=503, job_id=target["id"], times=None)
    )
    assert (await call(http, "POST", running.url + JOBS, other)).status == 201
    assert (await call(http, "POST", running.url + JOBS, target)).status == 503
    batch = await call(http, "POST", running.url + BATCH, {"jobs": [job(), target]})
    assert batch.status == 503
    assert (await call(http, "GET", f"{running.url}{JOBS}/{target['id']}")).status == 503
    assert (await call(http, "GET", f"{running.url}{JOBS}/{other['id']}")).status == 200


async def test_prefix_fault_until_cleared(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """times=None with a path prefix fails every matching request until the rules are cleared."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(action="status", status=502, path_prefix="/ojs/v1/jobs", times=None)
    )
    for _ in range(3):
        answer = await call(http, "GET", f"{running.url}{JOBS}/{uuid7()}")
        assert (answer.status, answer.body["error"]["code"]) == (502, "backend_error")
    assert (await call(http, "GET", running.url + "/ojs/v1/health")).status == 200
    assert running.emulator.clear_faults() == 1
    assert (await call(http, "POST", running.url + JOBS, job())).status == 201


async def test_raw_body_fault(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """A rule can answer a raw, non-OJS body (e.g. a proxy's HTML error page)."""
    running = await start()
    running.emulator.add_fault(
        FaultRule(
            action="status", status=502, body="<html>bad gateway</html>", content_type="text/html"
        )
    )
    answer = await call(http, "POST", running.url + JOBS, job())
    assert (answer.status, answer.text) == (502, "<html>bad gateway</html>")
    assert answer.headers["Content-Type"] == "text/html"


async def test_fault_control_api_over_http(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """POST/GET/DELETE /_emulator/faults arm, list (with fired counts) and clear rules."""
    running = await start()
    faults_url = running.url + "/_emulator/faults"
    rule = {"method": "POST", "path": JOBS, "action": "status", "status": 503, "times": 2}
    armed = await call(http, "POST", faults_url, {"rules": [rule]})
    assert armed.status == 201
    assert armed.body["rules"][0]["id"] == "f1"
    codes = [(await call(http, "POST", running.url + JOBS, job())).status for _ in range(3)]
    assert codes == [503, 503, 201]
    listed = await call(http, "GET", faults_url)
    assert (listed.body["rules"][0]["fired"], listed.body["rules"][0]["remaining"]) == (2, 0)
    bad = await call(http, "POST", faults_url, {"action": "explode"})
    assert (bad.status, bad.body["error"]["code"]) == (400, "invalid_request")
    assert (await call(http, "DELETE", faults_url)).body == {"cleared": 1}
    assert (await call(http, "GET", faults_url)).body == {"rules": []}


# --- ledger and reset --------------------------------------------------------------------


async def test_ledger_counts_posts_gets_and_deliveries(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """The ledger counts every POST (single or batch) and GET per id, and worker fetches."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    await call(http, "POST", running.url + BATCH, {"jobs": [sent]})
    await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    await fetch(http, running.url)
    ledger = (await call(http, "GET", running.url + "/_emulator/ledger")).body["jobs"]
    entry = ledger[sent["id"]]
    assert entry["job"]["state"] == "active"
    assert {k: entry[k] for k in ("queue", "created", "posts", "post_statuses", "gets")} == {
        "queue": "default",
        "created": 1,
        "posts": 2,
        "post_statuses": [201, 409],
        "gets": 1,
    }
    assert entry["deliveries"] == 1


async def test_reset_forgets_jobs_ledger_and_faults(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """POST /_emulator/reset empties the jobs, the ledger and the fault rules."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    running.emulator.add_fault(FaultRule(action="status", path="/nowhere", times=None))
    assert (await call(http, "POST", running.url + "/_emulator/reset")).status == 200
    assert (await call(http, "GET", running.url + "/_emulator/ledger")).body == {"jobs": {}}
    assert running.emulator.faults() == []
    assert (await call(http, "POST", running.url + JOBS, sent)).status == 201


async def test_arrivals_carry_each_request_receipt_time(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """GET /_emulator/arrivals gives each stored job's request receipt time on the
    emulator's clock; a batch's jobs share their request's."""
    running = await start()
    single, first, second = job(), job(), job()
    before = running.emulator.now()
    assert (await call(http, "POST", running.url + JOBS, single)).status == 201
    between = running.emulator.now()
    running.emulator.advance_clock(3600)
    answer = await call(http, "POST", running.url + BATCH, {"jobs": [first, second]})
    assert answer.status == 201
    after = running.emulator.now()
    shown = (await call(http, "GET", running.url + "/_emulator/arrivals")).body
    assert shown["arrivals"] == [single["id"], first["id"], second["id"]]
    at_single, at_first, at_second = shown["received_at"]
    assert before <= at_single <= between
    assert between + 3600 <= at_first == at_second <= after
    assert running.emulator.receipts() == list(
        zip(shown["arrivals"], shown["received_at"], strict=True)
    )


async def test_reset_answers_the_receipts_it_forgot_when_asked(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """POST /_emulator/reset with {"receipts": true} answers the arrivals it forgot; without
    it, only that it reset; either way the arrivals start again empty."""
    running = await start()
    kept, later = job(), job()
    await call(http, "POST", running.url + JOBS, kept)
    expected = running.emulator.receipts()
    reset_url = running.url + "/_emulator/reset"
    answer = await call(http, "POST", reset_url, {"receipts": True})
    assert answer.body == {
        "reset": True,
        "arrivals": [kept["id"]],
        "received_at": [expected[0][1]],
    }
    await call(http, "POST", running.url + JOBS, later)
    assert (await call(http, "POST", reset_url)).body == {"reset": True}
    arrivals = (await call(http, "GET", running.url + "/_emulator/arrivals")).body
    assert arrivals == {"arrivals": [], "received_at": []}


async def test_wait_until_wakes_on_a_request(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """wait_until returns as soon as a request makes the predicate true."""
    running = await start()
    sent = job()

    def stored(emulator: Emulator) -> bool:
        return emulator.job(sent["id"]) is not None

    async with asyncio.timeout(10):
        waiter = asyncio.create_task(running.emulator.wait_until(stored))
        await asyncio.sleep(0)
        assert not waiter.done()
        await call(http, "POST", running.url + JOBS, sent)
        await waiter


async def test_clock_control_over_http(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """POST /_emulator/clock moves the clock forward; a negative advance is refused."""
    running = await start()
    before = running.emulator.now()
    moved = await call(http, "POST", running.url + "/_emulator/clock", {"advance_s": 3600})
    assert moved.status == 200
    assert running.emulator.now() - before >= 3600
    refused = await call(http, "POST", running.url + "/_emulator/clock", {"advance_s": -1})
    assert refused.status == 400


# --- entry points ------------------------------------------------------------------------


def test_config_from_options(tmp_path: Path) -> None:
    """The CLI helper builds a config from strings and names the option it rejects."""
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    config = config_from_options(
        duplicate_mode="overwrite",
        queue_source="top_level",
        batch_atomic=False,
        auth_token_file=str(token_file),
        retention_s="90",
    )
    assert (config.duplicate_mode, config.queue_source, config.batch_atomic) == (
        "overwrite",
        "top_level",
        False,
    )
    assert (config.auth_token, config.retention_s) == ("s3cret", 90.0)
    assert "s3cret" not in repr(config)
    with pytest.raises(ValueError, match="duplicate_mode"):
        config_from_options(duplicate_mode="sometimes")
    with pytest.raises(ValueError, match="queue_source"):
        config_from_options(queue_source="header")
    with pytest.raises(ValueError, match="retention_s"):
        config_from_options(retention_s="soon")
    with pytest.raises(ValueError, match="auth_token_file"):
        config_from_options(auth_token_file=str(tmp_path / "missing"))


def test_parse_listen() -> None:
    """`relayd emulator --listen`: HOST:PORT, IPv6 in brackets, errors for anything else."""
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8080", "host:", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)


async def test_serve_runs_until_sigterm(http: aiohttp.ClientSession) -> None:
    """serve() prints where it listens, answers, and exits 0 on SIGTERM."""
    script = (
        "from relayd.testing.emulator import EmulatorConfig, serve; "
        "serve('127.0.0.1', 0, EmulatorConfig())"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode().strip()
        assert line.startswith("ojs-emulator listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1]
        health = await call(http, "GET", url + "/ojs/v1/health")
        assert (health.status, health.body["status"]) == (200, "ok")
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _stdout, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
