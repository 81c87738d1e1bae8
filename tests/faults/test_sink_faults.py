"""The sink misbehaves under a real relay process: it stores jobs and then loses, delays or
fails the answer; it answers gateway errors for a while; it asks for patience with 429 and
`Retry-After` in every form; it holds a different job under a reused id, or claims a
conflict it then cannot show; it answers 2xx with a body that is not an OJS answer; it
redirects. Whatever it does, nothing is dead-lettered that it did not refuse, no job is
created twice on a sink that overwrites a reused id, and the history checker finds nothing
lost, unexpected, duplicated or falsely published.
"""

from __future__ import annotations

import asyncio
import signal
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime, parsedate_to_datetime

import asyncpg
import pytest

from tests.faults import scenarios
from tests.faults.harness import Scene

# A sink that silently overwrites a reused id: a second POST of a stored job shows in its
# ledger as an overwrite, which the checker reports as a duplicate.
OVERWRITE = ("--duplicate-mode", "overwrite")
JOBS = "/ojs/v1/jobs"  # single and batch enqueues, and the GETs that reconcile


def _sql(scene: Scene, where: str) -> str:
    return f"SELECT count(*) FROM {scene.sql_table} WHERE {where}"


@pytest.mark.parametrize(
    "fault",
    [
        {"action": "store_then_drop"},
        # The answer comes after the attempt's deadline (sink.timeout_s is 1 s).
        {"action": "store_then_delay", "delay_ms": 1500},
        {"action": "store_then_status", "status": 500},
        # The jobs are stored, then the answer is not an OJS answer at all.
        {"action": "store_then_status", "status": 200, "body": "<html>ok</html>"},
    ],
    ids=["drop", "late", "500", "unreadable-2xx"],
)
@pytest.mark.parametrize("batch", ["on", "off"])
async def test_stored_then_the_answer_is_lost(
    scene: Scene, fault: dict[str, object], batch: str
) -> None:
    """The sink stores the jobs of the first three POSTs, then the answer is lost, late,
    a 500 or unreadable: each outcome is ambiguous, so the rows are reconciled with a GET
    and recorded published without being created again."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults({"method": "POST", "path_prefix": JOBS, "times": 3, **fault})
    await scene.produce(60)
    await scene.relay("relay", RELAYD_SINK__BATCH=batch)
    await scene.drained()
    assert await scene.dead() == {}
    reconciled = await scene.conn.fetchval(_sql(scene, "attempts > 1"))
    assert reconciled > 0, "no row needed a second attempt: the fault never fired"
    await scene.check()


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_a_storm_of_gateway_errors(scene: Scene, status: int) -> None:
    """Every POST answers `status` for a while: nothing is published or dead-lettered and
    no row spends its retry budget (the breaker holds the relay back); once the storm ends,
    everything goes out once."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults({"action": "status", "status": status, "method": "POST", "times": None})
    await scene.produce(80)
    relay = await scene.relay("relay")
    await relay.logged(f"HTTP {status}")
    await relay.logged("breaker.opened")
    assert await scene.published() == 0
    await sink.clear_faults()
    await scene.drained()
    assert await scene.dead() == {}
    worst = await scene.conn.fetchval(f"SELECT max(attempts) FROM {scene.sql_table}")
    assert worst <= 5, f"a row used {worst} attempts of its 10 in a storm"
    assert await relay.stop() == 0
    await scene.check()


def _http_date(offset_s: float) -> str:
    return format_datetime(datetime.now(UTC) + timedelta(seconds=offset_s), usegmt=True)


# Retry-After as the sink sent it (None: an HTTP date 4 s ahead when the fault is installed),
# with retry.cap_s at 5: honoured when sane, never negative, never beyond the cap.
CAP_S = 5.0
RETRY_AFTER = {
    "seconds": "2",
    "http-date": None,
    "past": _http_date(-3600),
    "absurd": "99999999999999999999",
}


def _owed_s(header: str, attempted_at: datetime) -> float:
    """The wait owed to a row attempted at `attempted_at` and answered `Retry-After: header`,
    counted from the attempt: the seconds, or until the date, within [0, CAP_S]."""
    if header.isdigit():
        owed = float(header)
    else:
        owed = (parsedate_to_datetime(header) - attempted_at).total_seconds()
    return min(max(owed, 0.0), CAP_S)


def _due_bounds(header: str, row: asyncpg.Record) -> tuple[datetime, datetime]:
    """When a row answered 429 may be due again, from what the database recorded: the
    attempt's start (`last_attempt_at`, A) and a moment after its settle (`seen_at`, O).

    relayd hears the answer at some R in [A, O] and settles at some S in [R, O]; the row is
    due at S + min(max(until - R, 0), cap) (the seconds, or the date less R). That is at
    least A + owed(A) and at most O + owed(A), whatever R and S were: bounds that no
    scheduling delay can break, and that a wait ignored, negative or uncapped falls outside.
    (0.01 s either way: timestamps are microseconds, an HTTP date is whole seconds.)"""
    owed = timedelta(seconds=_owed_s(header, row["last_attempt_at"]))
    slack = timedelta(seconds=0.01)
    return row["last_attempt_at"] + owed - slack, row["seen_at"] + owed + slack


@pytest.mark.parametrize("form", sorted(RETRY_AFTER))
async def test_429_with_retry_after(scene: Scene, form: str) -> None:
    """The sink answers 429 to every POST with `Retry-After` in seconds, as an HTTP
    date, as a date in the past or absurdly large: the rows wait what it asked, bounded by
    retry.cap_s (a sink cannot park a row for centuries), and are published after."""
    sink = await scene.start_sink(*OVERWRITE)
    await scene.relay(
        "relay",
        RELAYD_RETRY__CAP_S=str(CAP_S),
        RELAYD_SINK__BATCH="on",
        RELAYD_RELAY__WORKERS="1",
    )
    # The relay is up before the date is written, so a slow start cannot spend the 4 s.
    header = RETRY_AFTER[form] or _http_date(4)
    await sink.faults(
        {"action": "status", "status": 429, "method": "POST", "times": None, "retry_after": header}
    )
    await scene.produce(20)
    # Rows between attempts: their last one was answered 429 and no claim holds them.
    waiting = (
        f"SELECT last_attempt_at, available_at, clock_timestamp() AS seen_at "
        f"FROM {scene.sql_table} WHERE last_error LIKE 'HTTP 429%' "
        "AND lease_owner IS NULL AND published_at IS NULL"
    )
    async with asyncio.timeout(30):
        while not (waits := await scene.conn.fetch(waiting)):  # noqa: ASYNC110 - SQL state
            await asyncio.sleep(0.02)
    for row in waits:
        low, high = _due_bounds(header, row)
        assert low <= row["available_at"] <= high, (
            f"due at {row['available_at']}, owed between {low} and {high}"
        )
    if form == "http-date":
        # Not vacuous: the date was still ahead when the first 429 was answered.
        first = min(row["last_attempt_at"] for row in waits)
        assert _owed_s(header, first) > 0, "the date passed before any attempt"
    await sink.clear_faults()
    await scene.drained(timeout_s=30)
    assert await scene.dead() == {}
    await scene.check()


@pytest.mark.parametrize("batch", ["off", "on"])
async def test_409_with_a_different_job(scene: Scene, batch: str) -> None:
    """Someone else already created one of our ids on the sink with other args: the POST
    answers 409 (one row's, or its batch's), the GET shows a different job, and the row is
    dead-lettered `conflict` (never recorded published); the other rows go out."""
    await scenarios.a_different_job_under_our_id(scene, batch)


async def test_409_then_the_get_finds_nothing(scene: Scene) -> None:
    """The sink answers 409 to a POST, then 404 to the GET that should show the job it
    claimed to hold (a purge in between, a confused proxy): the row is sent again and
    published once."""
    sink = await scene.start_sink()
    ids = await scene.produce(5)
    await sink.faults(
        {"action": "status", "status": 409, "code": "duplicate", "method": "POST", "times": 1},
        {"action": "status", "status": 404, "code": "not_found", "method": "GET", "times": 1},
    )
    await scene.relay("relay", RELAYD_SINK__BATCH="off")
    await scene.drained()
    assert await scene.dead() == {}
    assert await scene.published() == len(ids)
    assert await scene.conn.fetchval(_sql(scene, "attempts > 1")) >= 1
    await scene.check()


async def test_an_unreadable_2xx_from_a_proxy(scene: Scene) -> None:
    """A proxy answers 200 with its own HTML page, the jobs never reaching the sink: relayd
    does not take a 2xx it cannot read as an acceptance; the GET finds nothing, and the rows
    are sent again."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults(
        {
            "action": "status",
            "status": 200,
            "body": "<html>welcome</html>",
            "content_type": "text/html",
            "method": "POST",
            "times": 2,
        }
    )
    ids = await scene.produce(30)
    await scene.relay("relay")
    await scene.drained()
    assert await scene.dead() == {}
    assert await scene.published() == len(ids)
    await scene.check()


async def test_a_redirect_is_not_followed(scene: Scene) -> None:
    """The sink answers 307 to every POST (a moved endpoint, a login page): relayd follows
    no redirect and dead-letters nothing; it says to check sink.url, and publishes once the
    sink answers properly."""
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults({"action": "status", "status": 307, "method": "POST", "times": None})
    await scene.produce(20)
    relay = await scene.relay("relay")
    await relay.logged("check sink.url")
    assert await scene.published() == 0
    await sink.clear_faults()
    await scene.drained()
    assert await scene.dead() == {}
    await scene.check()


async def test_sink_rejects_are_dead_letters_and_the_rest_go_out(scene: Scene) -> None:
    """The sink refuses three particular jobs (400, 413, 422): those rows are dead-lettered
    with the matching reason after one attempt; every other row is published."""
    sink = await scene.start_sink(*OVERWRITE)
    ids = await scene.produce(12)
    refused = {ids[1]: 400, ids[5]: 413, ids[9]: 422}
    await sink.faults(
        *(
            {"action": "status", "status": status, "method": "POST", "job_id": job_id}
            for job_id, status in refused.items()
        )
    )
    await scene.relay("relay", RELAYD_SINK__BATCH="off")
    await scene.drained()
    assert await scene.dead() == {
        ids[1]: "sink_rejected",
        ids[5]: "sink_too_large",
        ids[9]: "sink_unprocessable",
    }
    assert await scene.published() == len(ids) - 3
    await scene.check()


async def test_the_sink_freezes_after_storing(scene: Scene) -> None:
    """The emulator process stops (SIGSTOP, a stalled VM) right after it stored a request's
    jobs, before answering: the relay's attempts run into their deadline, nothing is
    dead-lettered; once the sink continues, the rows are reconciled and published once."""
    sink = await scene.start_sink(*OVERWRITE, failpoints="sink_after_store=pause@1")
    ids = await scene.produce(40)
    await scene.relay("relay")
    await sink.proc.fired("sink_after_store")
    assert sink.proc.stopped()
    await scene.until(f"SELECT ({_sql(scene, 'last_error IS NOT NULL')}) > 0")
    assert await scene.dead() == {}
    sink.proc.signal(signal.SIGCONT)
    await scene.drained()
    assert await scene.dead() == {}
    assert await scene.published() == len(ids)
    await scene.check()


async def test_a_request_held_past_the_deadline_on_a_sink_that_refuses_reused_ids(
    scene: Scene,
) -> None:
    """The sink takes up the first POSTs 1.5 s late, after relayd gave up on them (the
    window no client can close, docs/contract.md C4). On a sink that refuses a reused id the
    late request is harmless: the retry's GET finds the job, or the late POST is refused;
    nothing is created twice, dead-lettered or falsely published."""
    sink = await scene.start_sink()  # spec409: a reused id is refused
    await sink.faults({"action": "latency", "delay_ms": 1500, "method": "POST", "times": 3})
    ids = await scene.produce(40)
    await scene.relay("relay", RELAYD_SINK__BATCH="off")
    await scene.drained()
    await scene.check()
    assert await scene.dead() == {}
    assert await scene.published() == len(ids)
    ledger = (await sink.ledger())["jobs"]
    # The window was open: some job was asked for again after a late POST had created it.
    assert any(entry["posts"] + entry["gets"] > 1 for entry in ledger.values()), ledger
