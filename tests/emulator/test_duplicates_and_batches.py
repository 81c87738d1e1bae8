"""The emulator's switches over real loopback HTTP: what a reused id gets in each duplicate mode,
where the queue is read, and batches, atomic or not."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from relayd.testing.emulator import (
    EmulatorConfig,
    uuid7,
)
from tests.emulator.client import (
    BATCH,
    JOBS,
    call,
    job,
)
from tests.support import StartEmulator

# --- duplicate modes ---------------------------------------------------------------------


async def test_spec409_rejects_reused_id_and_keeps_the_stored_job(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """spec409: a reused id is 409 duplicate, retryable false; the first job is untouched."""
    running = await start(EmulatorConfig(duplicate_mode="spec409"))
    first = job()
    assert (await call(http, "POST", running.url + JOBS, first)).status == 201
    second = {**first, "args": ["different"]}
    answer = await call(http, "POST", running.url + JOBS, second)
    assert answer.status == 409
    assert answer.body["error"]["code"] == "duplicate"
    assert answer.body["error"]["retryable"] is False
    stored = await call(http, "GET", f"{running.url}{JOBS}/{first['id']}")
    assert stored.body["job"]["args"] == first["args"]
    entry = running.emulator.ledger()[first["id"]]
    assert (entry.created, entry.posts, entry.post_statuses) == (1, 2, (201, 409))


async def test_gateway_reuse_in_another_queue_is_500(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Gateway variant: same id, same queue → 409; same id, another queue → 500 internal_error."""
    running = await start(EmulatorConfig.gateway_variant())
    first: dict[str, Any] = {
        "id": uuid7(),
        "type": "order.fulfill",
        "args": [{"order_id": 42}],
        "queue": "gateway",
    }
    assert (await call(http, "POST", running.url + JOBS, first)).status == 201
    same_queue = await call(http, "POST", running.url + JOBS, first)
    assert (same_queue.status, same_queue.body["error"]["code"]) == (409, "duplicate")
    moved = await call(http, "POST", running.url + JOBS, {**first, "queue": "elsewhere"})
    assert moved.status == 500
    assert moved.body["error"] == {
        "code": "internal_error",
        "message": "an internal error occurred",
        "retryable": True,
        "request_id": moved.headers["X-Request-Id"],
    }
    assert running.emulator.ledger()[first["id"]].created == 1


async def test_overwrite_replaces_and_resets_the_job(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """overwrite: a reused id silently replaces the job, back to available, attempt 0, 201."""
    running = await start(EmulatorConfig(duplicate_mode="overwrite"))
    first = job()
    await call(http, "POST", running.url + JOBS, first)
    fetched = await call(
        http, "POST", running.url + "/ojs/v1/workers/fetch", {"queues": ["default"]}
    )
    assert fetched.body["jobs"][0]["attempt"] == 1
    again = await call(http, "POST", running.url + JOBS, {**first, "args": ["new"]})
    assert again.status == 201
    assert (again.body["job"]["state"], again.body["job"]["attempt"]) == ("available", 0)
    assert again.body["job"]["args"] == ["new"]
    entry = running.emulator.ledger()[first["id"]]
    assert (entry.created, entry.overwrites, entry.deliveries) == (2, 1, 1)


async def test_pk500_answers_retryable_internal_error(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """pk500: a reused id is 500 internal_error retryable true (postgres), job untouched."""
    running = await start(EmulatorConfig(duplicate_mode="pk500"))
    first = job()
    await call(http, "POST", running.url + JOBS, first)
    answer = await call(http, "POST", running.url + JOBS, {**first, "args": []})
    assert answer.status == 500
    assert (answer.body["error"]["code"], answer.body["error"]["retryable"]) == (
        "internal_error",
        True,
    )
    assert running.emulator.ledger()[first["id"]].job["args"] == first["args"]  # type: ignore[index]


# --- queue source ------------------------------------------------------------------------


async def test_queue_source_options_ignores_top_level_queue(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """options: a top-level queue is only echoed (shadowing GET's queue); the job is in default."""
    running = await start(EmulatorConfig(queue_source="options"))
    sent = {**job(), "queue": "gateway-jobs"}
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.body["job"]["queue"] == "gateway-jobs"  # the reference MarshalJSON trap
    assert running.emulator.ledger()[sent["id"]].queue == "default"
    other = await call(
        http, "POST", running.url + "/ojs/v1/workers/fetch", {"queues": ["gateway-jobs"]}
    )
    assert other.body["jobs"] == []
    default = await call(
        http, "POST", running.url + "/ojs/v1/workers/fetch", {"queues": ["default"]}
    )
    assert default.body["jobs"][0]["id"] == sent["id"]


async def test_queue_source_top_level_reads_top_level_queue(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """top_level: the job goes to the top-level queue, options.queue is ignored."""
    running = await start(EmulatorConfig(queue_source="top_level"))
    sent = {**job(queue="ignored"), "queue": "gateway-jobs"}
    answer = await call(http, "POST", running.url + JOBS, sent)
    assert answer.body["job"]["queue"] == "gateway-jobs"
    assert running.emulator.ledger()[sent["id"]].queue == "gateway-jobs"
    bad = await call(http, "POST", running.url + JOBS, {**job(), "queue": "Bad!"})
    assert bad.status == 400


async def test_queue_source_either_prefers_options(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """either: options.queue wins, else the top-level queue, else default."""
    running = await start(EmulatorConfig(queue_source="either"))
    both = {**job(queue="from-options"), "queue": "from-top"}
    top_only = {**job(), "queue": "from-top"}
    neither = job()
    for sent in (both, top_only, neither):
        assert (await call(http, "POST", running.url + JOBS, sent)).status == 201
    ledger = running.emulator.ledger()
    assert [ledger[s["id"]].queue for s in (both, top_only, neither)] == [
        "from-options",
        "from-top",
        "default",
    ]


# --- batch -------------------------------------------------------------------------------


async def test_batch_stores_all_in_request_order(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A valid batch is 201 {"jobs", "count"} in request order; each id counted as a post."""
    running = await start()
    items = [job(queue="bulk") for _ in range(5)]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert answer.status == 201
    assert answer.body["count"] == 5
    assert [j["id"] for j in answer.body["jobs"]] == [i["id"] for i in items]
    stats = await call(http, "GET", running.url + "/ojs/v1/queues/bulk/stats")
    assert stats.body["queue"]["available"] == 5
    assert all(
        e.created == 1 and e.post_statuses == (201,) for e in running.emulator.ledger().values()
    )


async def test_batch_invalid_item_names_its_index_and_stores_nothing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """The first invalid item → 400 invalid_request, "…job at index i: …", details.index."""
    running = await start(EmulatorConfig(batch_atomic=False))
    items = [job(), job(), {"id": uuid7(), "args": []}, {"type": "Bad", "args": []}]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert answer.status == 400
    error = answer.body["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("Batch validation failed: job at index 2: ")
    assert error["details"]["index"] == 2
    assert all(e.created == 0 for e in running.emulator.ledger().values())


async def test_atomic_batch_with_a_duplicate_stores_nothing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic: a reused id anywhere fails the batch before anything is stored."""
    running = await start(EmulatorConfig(batch_atomic=True))
    taken = job()
    await call(http, "POST", running.url + JOBS, taken)
    items = [job(), job(), {**taken, "args": ["again"]}]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (409, "duplicate")
    assert answer.body["error"]["details"] == {"index": 2}
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [0, 0, 1]


async def test_non_atomic_batch_keeps_items_before_the_failure(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic=False: items before a failing one stay stored, later ones are not."""
    running = await start(EmulatorConfig(batch_atomic=False, duplicate_mode="pk500"))
    taken = job()
    await call(http, "POST", running.url + JOBS, taken)
    items = [job(), taken, job()]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (500, "internal_error")
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [1, 1, 0]
    assert ledger[items[0]["id"]].post_statuses == (500,)


@pytest.mark.parametrize(
    ("options", "status", "code"),
    [
        ({"priority": 101}, 400, "invalid_request"),
        ({"queue": "Not A Queue"}, 400, "invalid_request"),
        ({"retry": {"max_attempts": -1}}, 422, "validation_error"),
    ],
    ids=["priority", "queue", "retry"],
)
async def test_non_atomic_batch_stores_items_before_an_invalid_one(
    start: StartEmulator,
    http: aiohttp.ClientSession,
    options: dict[str, Any],
    status: int,
    code: str,
) -> None:
    """batch_atomic=False: item k failing validation answers its own status; 0..k-1 stay."""
    running = await start(EmulatorConfig(batch_atomic=False))
    items = [job(), job(), job(options=options), job()]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (status, code)
    error = answer.body["error"]
    assert error["message"].startswith("Batch validation failed: job at index 2: ")
    assert (error["details"]["index"], error["retryable"]) == (2, False)
    ledger = running.emulator.ledger()
    assert [ledger[i["id"]].created for i in items] == [1, 1, 0, 0]
    assert [ledger[i["id"]].post_statuses for i in items] == [(status,)] * 4
    stored = await call(http, "GET", f"{running.url}{JOBS}/{items[1]['id']}")
    assert (stored.status, stored.body["job"]["state"]) == (200, "available")


async def test_non_atomic_batch_checks_every_identity_before_storing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic=False: a bad id, type or args anywhere is 400 at its index, none stored."""
    running = await start(EmulatorConfig(batch_atomic=False))
    items = [job(), job(options={"priority": 101}), job(), {**job(), "args": {"n": 1}}]
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (400, "invalid_request")
    assert answer.body["error"]["details"]["index"] == 3
    assert all(e.created == 0 for e in running.emulator.ledger().values())


async def test_atomic_batch_answers_400_for_a_422_item_and_stores_nothing(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """batch_atomic: an item a single POST answers 422 makes the batch 400 invalid_request."""
    running = await start(EmulatorConfig(batch_atomic=True))
    items = [job(), job(options={"retry": {"max_attempts": -1}}), job()]
    single = await call(http, "POST", running.url + JOBS, items[1])
    assert (single.status, single.body["error"]["code"]) == (422, "validation_error")
    answer = await call(http, "POST", running.url + BATCH, {"jobs": items})
    assert (answer.status, answer.body["error"]["code"]) == (400, "invalid_request")
    error = answer.body["error"]
    assert error["message"].startswith("Batch validation failed: job at index 1: ")
    assert error["details"]["index"] == 1
    assert all(e.created == 0 for e in running.emulator.ledger().values())


async def test_batch_in_batch_duplicate_ids(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """One id twice in a batch: 409 under spec409 (atomic), two creations under overwrite."""
    strict = await start()
    item = job()
    answer = await call(http, "POST", strict.url + BATCH, {"jobs": [item, item]})
    assert (answer.status, answer.body["error"]["details"]["index"]) == (409, 1)
    assert strict.emulator.ledger()[item["id"]].created == 0
    lax = await start(EmulatorConfig(duplicate_mode="overwrite"))
    assert (await call(http, "POST", lax.url + BATCH, {"jobs": [item, item]})).status == 201
    entry = lax.emulator.ledger()[item["id"]]
    assert (entry.created, entry.overwrites, entry.posts) == (2, 1, 2)


async def test_batch_bounds_and_capability(
    start: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """Empty and oversized batches are 400; with batch_enqueue off the route is 404."""
    running = await start(EmulatorConfig(max_batch_jobs=3))
    empty = await call(http, "POST", running.url + BATCH, {"jobs": []})
    assert (empty.status, empty.body["error"]["code"]) == (400, "invalid_request")
    many = await call(http, "POST", running.url + BATCH, {"jobs": [job() for _ in range(4)]})
    assert many.status == 400
    manifest = await call(http, "GET", running.url + "/ojs/manifest")
    assert manifest.body["capabilities"]["batch_enqueue"] is True
    off = await start(EmulatorConfig(batch_enqueue=False))
    assert (await call(http, "POST", off.url + BATCH, {"jobs": [job()]})).status == 404
    off_manifest = await call(http, "GET", off.url + "/ojs/manifest")
    assert off_manifest.body["capabilities"]["batch_enqueue"] is False
    assert off_manifest.body["capabilities"]["unique_jobs"] is False
