"""The sink's answers go wrong on the wire, under a real relay process: a batch is stored in
part and then fails; a 2xx to a batch leaves ids out; the headers of an answer trickle in a
byte at a time; a 2xx body is larger than relayd reads; the server's certificate is for
another host, from a CA relayd does not trust, or expired. Whatever happens, no row is
dead-lettered that the sink did not refuse, no job is created twice on a sink that
overwrites a reused id, a TLS failure publishes nothing, and the history checker finds
nothing lost, unexpected, duplicated or falsely published.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from relayd.testing.processes import free_port
from tests.faults.harness import Process, Scene, Sink, await_ok
from tests.support import relayd_argv

# A sink that silently overwrites a reused id: a second POST of a stored job shows in its
# ledger as an overwrite, which the checker reports as a duplicate.
OVERWRITE = ("--duplicate-mode", "overwrite")
BATCH = "/ojs/v1/jobs/batch"
JOBS = "/ojs/v1/jobs"  # single and batch enqueues, and the GETs that reconcile
ROWS = 60


def _any(scene: Scene, where: str) -> str:
    """SQL: whether some row of the outbox matches `where`."""
    return f"SELECT EXISTS (SELECT 1 FROM {scene.sql_table} WHERE {where})"


def _records(proc: Process, event: str) -> list[dict[str, Any]]:
    """The process's JSON log records of this event."""
    records = []
    for line in proc.log().splitlines():
        if f'"{event}"' not in line:
            continue
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                records.append(record)
    return records


def _reconciled(proc: Process) -> set[str]:
    """The ids the relay recorded published on the word of a GET."""
    return {str(record["event_id"]) for record in _records(proc, "relay.reconciled")}


def _retry_errors(proc: Process) -> list[str]:
    return [str(record.get("error", "")) for record in _records(proc, "relay.retry_scheduled")]


def _left_out(proc: Process) -> set[str]:
    """The ids of the rows a 2xx batch answer did not list (or could not be read)."""
    return {
        str(record["event_id"])
        for record in _records(proc, "relay.retry_scheduled")
        if "does not list this id" in str(record.get("error", ""))
    }


async def _fired(sink: Sink) -> list[int]:
    """How many times each armed rule fired, in the order they were armed."""
    async with sink.http.get(f"{sink.url}/_emulator/faults") as answer:
        assert answer.status == 200, await answer.text()
        listing: dict[str, Any] = await answer.json()
    return [int(rule["fired"]) for rule in listing["rules"]]


# --- the answers to a batch ------------------------------------------------------------


async def test_a_batch_stored_in_part_then_failed(scene: Scene) -> None:
    """The first two batches store only their first 5 jobs and answer 500: every row of
    them is ambiguous; the next attempt finds the stored ones with a GET (reconciled, not
    created again), sends the others, and nothing is dead-lettered."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults(
        {
            "action": "store_some_then_status",
            "method": "POST",
            "path": BATCH,
            "count": 5,
            "status": 500,
            "times": 2,
        }
    )
    await scene.produce(ROWS)
    relay = await scene.relay("relay")
    await scene.drained()
    assert await _fired(sink) == [2]
    assert await scene.dead() == {}
    assert await scene.published() == ROWS
    statuses = {
        job_id: entry["post_statuses"] for job_id, entry in (await sink.ledger())["jobs"].items()
    }
    # The jobs a failed batch stored were found on the sink with a GET, not posted again;
    # the rest of each failed batch was posted again, alone.
    stored_in_part = {job_id for job_id, seen in statuses.items() if seen == [500]}
    sent_again = {job_id for job_id, seen in statuses.items() if seen == [500, 201]}
    assert 0 < len(stored_in_part) <= 10
    assert _reconciled(relay) == stored_in_part
    assert sent_again, "every row of the failed batches was among the stored ones"
    assert all(seen in ([201], [500], [500, 201]) for seen in statuses.values()), statuses
    assert any("HTTP 500" in error for error in _retry_errors(relay))
    assert await relay.stop() == 0
    await scene.check()


async def test_a_2xx_to_a_batch_that_omits_ids(scene: Scene) -> None:
    """The first two batches are stored whole, but their 201 lists only 3 jobs each: the
    rows it leaves out are reconciled with a GET and published once; none is dead."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults(
        {"action": "omit_ids", "method": "POST", "path": BATCH, "count": 3, "times": 2}
    )
    await scene.produce(ROWS)
    relay = await scene.relay("relay")
    await scene.drained()
    assert await _fired(sink) == [2]
    assert await scene.dead() == {}
    assert await scene.published() == ROWS
    # The rows the answers left out were retried, found with a GET and posted once only.
    left_out = _left_out(relay)
    assert left_out, "no row was left out of an answer: the fault never fired"
    assert _reconciled(relay) == left_out
    ledger = (await sink.ledger())["jobs"]
    assert all(entry["posts"] == 1 for entry in ledger.values())
    assert await relay.stop() == 0
    await scene.check()


# --- answers that never finish, or never end --------------------------------------------


async def test_headers_trickled_byte_by_byte(scene: Scene) -> None:
    """Every enqueue and GET is processed (stored), but its status line and headers come a
    byte every 200 ms: the attempt's deadline (sink.timeout_s, 1 s) ends each exchange, the
    relay does not hang and dead-letters nothing; once the sink answers normally again, the
    stored rows are reconciled with a GET and everything is published once."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults({"action": "trickle", "path_prefix": JOBS, "delay_ms": 200, "times": None})
    await scene.produce(ROWS)
    relay = await scene.relay("relay")
    await scene.until(_any(scene, "last_error LIKE 'no answer within the attempt deadline%'"))
    await relay.logged("breaker.opened")
    assert await scene.published() == 0
    assert relay.returncode is None
    await sink.clear_faults()
    await scene.drained()
    assert await scene.dead() == {}
    assert await scene.published() == ROWS
    # The first batch was stored before its answer trickled: found again by a GET.
    assert _reconciled(relay), "no row was reconciled: the trickled POST stored nothing?"
    assert await relay.stop() == 0
    await scene.check()


async def test_an_oversized_2xx_body(scene: Scene) -> None:
    """The first two batches are stored, then answered 200 with a 17 MiB body (over the
    16 MiB relayd reads): the answer is unreadable, so every row of them is reconciled with
    a GET and published once."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults({"action": "oversized", "method": "POST", "path": BATCH, "times": 2})
    await scene.produce(ROWS)
    # Time enough to read 16 MiB on a busy machine: this tests the size limit, not the
    # deadline (the lease must stay above twice the timeout).
    relay = await scene.relay("relay", RELAYD_SINK__TIMEOUT_S="5", RELAYD_RELAY__LEASE_S="12")
    await scene.drained()
    assert await _fired(sink) == [2]
    assert await scene.dead() == {}
    assert await scene.published() == ROWS
    # Both oversized answers were unreadable: each of their rows was left ambiguous, then
    # found with a GET and posted once only.
    left_out = _left_out(relay)
    assert left_out, f"no answer went unread: {_retry_errors(relay)}"
    assert _reconciled(relay) == left_out
    ledger = (await sink.ledger())["jobs"]
    assert sum(entry["post_statuses"] == [200] for entry in ledger.values()) == len(left_out)
    assert all(entry["posts"] == 1 for entry in ledger.values())
    assert await relay.stop() == 0
    await scene.check()


# --- TLS ---------------------------------------------------------------------------------


@pytest.fixture
async def insecure() -> AsyncIterator[aiohttp.ClientSession]:
    """The test's own control channel to an HTTPS emulator, whatever its certificate."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False)) as session:
        yield session


def _write_cert(cert: trustme.LeafCert, base: Path, name: str) -> tuple[Path, Path]:
    cert_file, key_file = base / f"{name}-cert.pem", base / f"{name}-key.pem"
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_file))
    return cert_file, key_file


async def _start_tls_sink(
    scene: Scene, http: aiohttp.ClientSession, name: str, cert: trustme.LeafCert
) -> Sink:
    """`relayd emulator` over HTTPS with this certificate, as the scene's sink."""
    cert_file, key_file = _write_cert(cert, scene.base, name)
    port = free_port()
    args = ["emulator", "--listen", f"127.0.0.1:{port}", *OVERWRITE]
    args += ["--tls-cert", str(cert_file), "--tls-key", str(key_file)]
    # Scene.start_sink speaks plain HTTP only: spawn the emulator the way it does.
    proc = await scene.spawn(name, relayd_argv(*args), {})
    url = f"https://127.0.0.1:{port}"
    await await_ok(http, f"{url}/ojs/v1/health", proc)
    scene.sink = Sink(url=url, proc=proc, http=http)
    return scene.sink


def _expired(ca: trustme.CA) -> trustme.LeafCert:
    now = datetime.datetime.now(datetime.UTC)
    return ca.issue_cert(
        "127.0.0.1",
        not_before=now - datetime.timedelta(days=2),
        not_after=now - datetime.timedelta(days=1),
    )


@pytest.mark.parametrize("case", ["wrong-host", "untrusted-ca", "expired"])
async def test_tls_fails_closed(scene: Scene, insecure: aiohttp.ClientSession, case: str) -> None:
    """relayd trusts one CA (sink.ca_file). The sink presents a certificate for another host
    name, one from a CA relayd does not trust, or an expired one: nothing is published or
    dead-lettered, the relay logs a TLS failure, the sink never sees a request. A relay
    against the same CA's good certificate then publishes everything once."""
    trusted, stranger = trustme.CA(), trustme.CA()
    ca_file = scene.base / "trusted-ca.pem"
    trusted.cert_pem.write_to_path(str(ca_file))
    bad_cert = {
        "wrong-host": lambda: trusted.issue_cert("wrong.example"),
        "untrusted-ca": lambda: stranger.issue_cert("127.0.0.1"),
        "expired": lambda: _expired(trusted),
    }[case]()
    bad = await _start_tls_sink(scene, insecure, "sink-bad", bad_cert)
    await scene.produce(ROWS)
    blind = await scene.relay("blind", RELAYD_SINK__CA_FILE=str(ca_file))
    await scene.until(_any(scene, "last_error LIKE 'TLS failure%'"))
    await blind.logged("TLS failure")
    await blind.logged("breaker.opened")
    assert await scene.published() == 0
    assert await scene.dead() == {}
    assert (await bad.ledger())["jobs"] == {}
    assert await blind.stop() == 0
    assert await scene.published() == 0
    assert await scene.dead() == {}
    assert await bad.proc.stop() == 0

    await _start_tls_sink(scene, insecure, "sink-good", trusted.issue_cert("127.0.0.1"))
    healed = await scene.relay("healed", RELAYD_SINK__CA_FILE=str(ca_file))
    await scene.drained()
    assert await scene.dead() == {}
    assert await scene.published() == ROWS
    assert await healed.stop() == 0
    await scene.check()
