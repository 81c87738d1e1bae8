"""The emulator's newer fault actions: their JSON form and validation, what each does to an
answer over real loopback HTTP, and serving HTTPS (`relayd emulator --tls-cert/--tls-key`)."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from relayd.cli import main
from relayd.testing.emulator import RunningEmulator, start_emulator, uuid7
from relayd.testing.emulator.app import tls_context
from relayd.testing.emulator.faults import DEFAULT_OVERSIZED_BYTES, FaultRule

JOBS = "/ojs/v1/jobs"
BATCH = "/ojs/v1/jobs/batch"
MEDIA = {"Content-Type": "application/openjobspec+json"}


def job() -> dict[str, Any]:
    return {"id": uuid7(), "type": "test.echo", "args": [1]}


@pytest.fixture
async def running() -> AsyncIterator[RunningEmulator]:
    async with await start_emulator() as emulator:
        yield emulator


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


# --- the JSON form -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"action": "store_some_then_status", "path": BATCH, "count": 2, "status": 500},
            {"count": 2, "status": 500},
        ),
        ({"action": "store_some_then_status"}, {"count": 1, "status": 503}),
        ({"action": "omit_ids", "count": 0}, {"count": 0, "status": 503}),
        ({"action": "trickle", "delay_ms": 200, "times": None}, {"delay_ms": 200, "times": None}),
        ({"action": "oversized"}, {"status": 200, "size_bytes": DEFAULT_OVERSIZED_BYTES}),
        ({"action": "oversized", "status": 201, "size_bytes": 4096}, {"status": 201}),
    ],
)
def test_new_actions_parse(data: dict[str, Any], expected: dict[str, Any]) -> None:
    rule = FaultRule.from_json(data)
    assert rule.action == data["action"]
    for name, value in expected.items():
        assert getattr(rule, name) == value
    assert FaultRule.from_json(rule.to_json()) == rule


def test_status_defaults_to_503_except_for_oversized() -> None:
    assert FaultRule(action="status").status == 503
    assert FaultRule(action="store_then_status").status == 503
    assert FaultRule(action="oversized").status == 200
    assert FaultRule(action="oversized", status=500).status == 500
    assert FaultRule(action="store_then_status").to_json()["status"] == 503
    # The defaults of the fields the new actions read.
    rule = FaultRule(action="status")
    assert (rule.count, rule.size_bytes) == (1, 17 * 1024 * 1024)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"action": "omit_ids", "count": -1}, "count must be >= 0"),
        ({"action": "omit_ids", "count": "2"}, "count must be an integer"),
        ({"action": "omit_ids", "count": None}, "count must be an integer"),
        ({"action": "omit_ids", "count": True}, "count must be an integer"),
        ({"action": "oversized", "size_bytes": 0}, "size_bytes must be between"),
        ({"action": "oversized", "size_bytes": 1 << 31}, "size_bytes must be between"),
        ({"action": "oversized", "size_bytes": 1.5}, "size_bytes must be an integer"),
        ({"action": "trickle", "delay_ms": -1}, "delay_ms must be >= 0"),
        ({"action": "oversized", "status": 600}, "status must be an HTTP status"),
        ({"action": "trickles"}, "action must be one of"),
    ],
)
def test_new_fields_are_validated(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultRule.from_json(data)


# --- what each action does --------------------------------------------------------------


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, *, timeout_s: float | None = None
) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with http.post(url, data=json.dumps(body), headers=MEDIA, timeout=timeout) as answer:
        return answer.status, json.loads(await answer.read())


async def test_store_some_then_status_stores_the_first_jobs_then_fails(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    running.emulator.add_fault(
        FaultRule(action="store_some_then_status", path=BATCH, count=2, status=500)
    )
    items = [job() for _ in range(5)]
    status, body = await post(http, running.url + BATCH, {"jobs": items})
    assert (status, body["error"]["code"]) == (500, "internal_error")
    ledger = running.emulator.ledger()
    assert [ledger[item["id"]].created for item in items] == [1, 1, 0, 0, 0]
    assert [ledger[item["id"]].post_statuses for item in items] == [(500,)] * 5
    # Sent again, the jobs it did not store are stored now.
    status, body = await post(http, running.url + BATCH, {"jobs": items[2:]})
    assert status == 201
    assert all(running.emulator.job(item["id"]) is not None for item in items)


async def test_store_some_then_status_on_a_single_job_stores_it(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    running.emulator.add_fault(FaultRule(action="store_some_then_status", path=JOBS, status=502))
    sent = job()
    status, _ = await post(http, running.url + JOBS, sent)
    assert status == 502
    assert running.emulator.ledger()[sent["id"]].created == 1


async def test_omit_ids_stores_every_job_and_lists_the_first(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    running.emulator.add_fault(FaultRule(action="omit_ids", path=BATCH, count=1))
    items = [job() for _ in range(3)]
    status, body = await post(http, running.url + BATCH, {"jobs": items})
    assert status == 201
    assert [listed["id"] for listed in body["jobs"]] == [items[0]["id"]]
    assert all(running.emulator.ledger()[item["id"]].created == 1 for item in items)


async def test_omit_ids_leaves_an_error_answer_alone(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    running.emulator.add_fault(FaultRule(action="omit_ids", path=BATCH, count=0))
    status, body = await post(http, running.url + BATCH, {"jobs": []})
    assert (status, body["error"]["code"]) == (400, "invalid_request")


async def test_trickle_outlives_the_client_deadline_after_storing(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    running.emulator.add_fault(FaultRule(action="trickle", path=JOBS, delay_ms=100))
    sent = job()
    with pytest.raises(TimeoutError):
        await post(http, running.url + JOBS, sent, timeout_s=0.5)
    assert running.emulator.ledger()[sent["id"]].created == 1


async def test_trickle_writes_a_whole_valid_answer(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    """With no delay the hand-written answer is an ordinary HTTP/1.1 response."""
    running.emulator.add_fault(FaultRule(action="trickle", path=JOBS, delay_ms=0))
    sent = job()
    status, body = await post(http, running.url + JOBS, sent, timeout_s=10)
    assert (status, body["job"]["id"]) == (201, sent["id"])


async def test_oversized_pads_the_real_answer(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    running.emulator.add_fault(FaultRule(action="oversized", path=JOBS, size_bytes=300_000))
    sent = job()
    async with http.post(running.url + JOBS, data=json.dumps(sent), headers=MEDIA) as answer:
        raw = await answer.read()
        assert answer.status == 200
    assert len(raw) == 300_000
    assert json.loads(raw)["job"]["id"] == sent["id"]
    assert running.emulator.ledger()[sent["id"]].post_statuses == (200,)


async def test_oversized_survives_a_client_that_stops_reading(
    running: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    """A client that hangs up part way (as relayd does past its limit) breaks nothing."""
    running.emulator.add_fault(FaultRule(action="oversized", path=JOBS, size_bytes=1 << 24))
    async with http.post(running.url + JOBS, data=json.dumps(job()), headers=MEDIA) as answer:
        assert len(await answer.content.read(1024)) > 0
    status, _ = await post(http, running.url + JOBS, job())
    assert status == 201


# --- HTTPS --------------------------------------------------------------------------------


async def test_serves_https_with_the_given_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    client = ssl.create_default_context()
    ca.configure_trust(client)
    context = tls_context(str(cert_file), str(key_file))
    async with (
        await start_emulator(ssl_context=context) as emulator,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client)) as http,
    ):
        assert emulator.url.startswith("https://127.0.0.1:")
        async with http.get(emulator.url + "/ojs/v1/health") as answer:
            assert answer.status == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", "cert.pem"], "give --tls-cert and --tls-key together"),
        (["--tls-key", "key.pem"], "give --tls-cert and --tls-key together"),
        (["--tls-cert", "missing.pem", "--tls-key", "missing.pem"], "cannot load"),
    ],
)
def test_emulator_tls_options_are_checked(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["emulator", "--listen", "127.0.0.1:0"]
    argv += [str(tmp_path / arg) if arg.endswith(".pem") else arg for arg in args]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
