"""The emulator's worker side over real loopback HTTP: fetch, ack, nack, heartbeats, scheduling,
cancel, and retention of terminal jobs."""

from __future__ import annotations

import aiohttp

from relayd.testing.emulator import (
    EmulatorConfig,
    uuid7,
)
from tests.emulator.client import (
    JOBS,
    call,
    fetch,
    job,
)
from tests.support import StartEmulator

# --- worker side -------------------------------------------------------------------------


async def test_stale_lease_token_is_409(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """Gateway dialect: after a lease expires and is reclaimed, the old token's ack is 409
    stale_lease and the new holder's ack succeeds."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    (first,) = await fetch(http, running.url, worker_id="a", visibility_timeout_ms=1000)
    running.emulator.advance_clock(2.0)
    expired = await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    assert expired.body["job"]["state"] == "available"
    (second,) = await fetch(http, running.url, worker_id="b")
    assert second["attempt"] == 2
    assert second["lease_token"] != first["lease_token"]
    ack_url = running.url + "/ojs/v1/workers/ack"
    stale = await call(
        http, "POST", ack_url, {"job_id": sent["id"], "lease_token": first["lease_token"]}
    )
    assert (stale.status, stale.body["error"]["code"]) == (409, "stale_lease")
    nack_url = running.url + "/ojs/v1/workers/nack"
    stale_beat = await call(
        http,
        "POST",
        running.url + "/ojs/v1/workers/heartbeat",
        {"worker_id": "a", "job_id": sent["id"], "lease_token": first["lease_token"]},
    )
    assert (stale_beat.status, stale_beat.body["error"]["code"]) == (409, "stale_lease")
    stale_nack = await call(
        http, "POST", nack_url, {"job_id": sent["id"], "lease_token": first["lease_token"]}
    )
    assert stale_nack.body["error"]["code"] == "stale_lease"
    fresh = await call(
        http, "POST", ack_url, {"job_id": sent["id"], "lease_token": second["lease_token"]}
    )
    assert (fresh.status, fresh.body["state"]) == (200, "completed")
    again = await call(
        http, "POST", ack_url, {"job_id": sent["id"], "lease_token": second["lease_token"]}
    )
    assert again.body["error"]["code"] == "stale_lease"


async def test_ack_without_token_follows_public_ojs(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Without a lease_token a late ack succeeds while the job is active, else 409 conflict."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    ack_url = running.url + "/ojs/v1/workers/ack"
    early = await call(http, "POST", ack_url, {"job_id": sent["id"]})
    assert (early.status, early.body["error"]["code"]) == (409, "conflict")
    assert early.body["error"]["details"]["current_state"] == "available"
    await fetch(http, running.url, visibility_timeout_ms=1000)
    running.emulator.advance_clock(2.0)
    await fetch(http, running.url)
    late = await call(http, "POST", ack_url, {"job_id": sent["id"], "result": {"ok": True}})
    assert (late.status, late.body["acknowledged"]) == (200, True)
    stored = await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    assert stored.body["job"]["result"] == {"ok": True}
    unknown = await call(http, "POST", ack_url, {"job_id": uuid7()})
    assert unknown.status == 404


async def test_nack_retries_after_backoff_then_discards(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """nack → retryable, available again after its backoff; the last attempt → discarded."""
    running = await start()
    sent = job(options={"retry": {"max_attempts": 2, "initial_interval": "PT10S"}})
    await call(http, "POST", running.url + JOBS, sent)
    nack_url = running.url + "/ojs/v1/workers/nack"
    failure = {"job_id": sent["id"], "error": {"code": "boom", "message": "first"}}
    await fetch(http, running.url)
    first = await call(http, "POST", nack_url, failure)
    assert (first.body["state"], first.body["attempt"], first.body["retry_delay_ms"]) == (
        "retryable",
        1,
        10000,
    )
    assert await fetch(http, running.url) == []
    running.emulator.advance_clock(10.0)
    (retried,) = await fetch(http, running.url)
    assert retried["attempt"] == 2
    last = await call(http, "POST", nack_url, failure)
    assert last.body["state"] == "discarded"
    stored = await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")
    assert stored.body["job"]["error"]["type"] == "boom"
    assert len(stored.body["job"]["errors"]) == 2


async def test_heartbeat_extends_the_lease(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A heartbeat pushes the lease deadline out; without one the job returns to available."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    await fetch(http, running.url, visibility_timeout_ms=3000)
    running.emulator.advance_clock(2.0)
    beat = await call(
        http,
        "POST",
        running.url + "/ojs/v1/workers/heartbeat",
        {"worker_id": "w", "active_jobs": [sent["id"]], "visibility_timeout_ms": 3000},
    )
    assert (beat.body["state"], beat.body["jobs_extended"]) == ("running", [sent["id"]])
    running.emulator.advance_clock(2.0)
    assert running.emulator.job(sent["id"])["state"] == "active"  # type: ignore[index]
    running.emulator.advance_clock(1.5)
    assert running.emulator.job(sent["id"])["state"] == "available"  # type: ignore[index]


async def test_scheduled_job_becomes_available_on_time(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A future delay_until gives scheduled; once the clock passes it, available."""
    running = await start()
    sent = job(options={"delay_until": "+PT30S"})
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.body["job"]["state"] == "scheduled"
    assert await fetch(http, running.url) == []
    running.emulator.advance_clock(31.0)
    (fetched,) = await fetch(http, running.url)
    assert fetched["id"] == sent["id"]


async def test_cancel(start: StartEmulator, http: aiohttp.ClientSession) -> None:
    """DELETE cancels a live job (200), a terminal one is 409 conflict, an unknown one 404."""
    running = await start()
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    url = f"{running.url}{JOBS}/{sent['id']}"
    cancelled = await call(http, "DELETE", url)
    assert (cancelled.status, cancelled.body["job"]["state"]) == (200, "cancelled")
    assert (await call(http, "DELETE", url)).status == 409
    assert (await call(http, "DELETE", f"{running.url}{JOBS}/{uuid7()}")).status == 404


# --- retention ---------------------------------------------------------------------------


async def test_retention_purges_terminal_jobs_and_frees_the_id(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """After retention_s a terminal job is gone (GET 404, ledger job null) and its id is
    accepted again as a new creation."""
    running = await start(EmulatorConfig(retention_s=60))
    sent = job()
    await call(http, "POST", running.url + JOBS, sent)
    await fetch(http, running.url)
    await call(http, "POST", running.url + "/ojs/v1/workers/ack", {"job_id": sent["id"]})
    running.emulator.advance_clock(59.0)
    assert (await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")).status == 200
    running.emulator.advance_clock(2.0)
    assert (await call(http, "GET", f"{running.url}{JOBS}/{sent['id']}")).status == 404
    ledger = (await call(http, "GET", running.url + "/_emulator/ledger")).body["jobs"]
    assert (ledger[sent["id"]]["job"], ledger[sent["id"]]["purged"]) == (None, True)
    assert (await call(http, "POST", running.url + JOBS, sent)).status == 201
    entry = running.emulator.ledger()[sent["id"]]
    assert (entry.created, entry.overwrites, entry.purged, entry.gets) == (2, 0, False, 2)
