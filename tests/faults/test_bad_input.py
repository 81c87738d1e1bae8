"""Bad input reaches a real relay: rows whose envelopes relayd cannot send (every kind the
outbox's checks let through), a sink whose error text carries newlines and control
characters, and a configuration naming a hostile table. A poison row is dead-lettered with
its reason and never stops the worker; an error text stays one escaped log record; a bad
table name is refused before any SQL, with one line naming the key.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from relayd.core.envelope import MAX_TYPE_CHARS
from relayd.producer import new_job
from tests.faults.harness import Scene

OVERWRITE = ("--duplicate-mode", "overwrite")
MAX_ENVELOPE_BYTES = 4096


def _deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


# Each poison envelope (as the producer might have written it by hand, past the table's
# checks) -> the dead_reason relayd must give it.
POISON: dict[str, tuple[dict[str, Any], str]] = {
    "type-pattern": ({"type": "Not A Type!"}, "invalid_envelope"),
    "type-too-long": ({"type": "a" * (MAX_TYPE_CHARS + 1)}, "invalid_envelope"),
    "options-not-object": ({"options": "fast"}, "invalid_envelope"),
    "queue-pattern": ({"options": {"queue": "Bad Queue!"}}, "invalid_envelope"),
    "top-level-queue-pattern": ({"queue": "UPPER"}, "invalid_envelope"),
    "priority-out-of-range": ({"options": {"priority": 500}}, "invalid_envelope"),
    "priority-not-integer": ({"options": {"priority": "high"}}, "invalid_envelope"),
    "priority-boolean": ({"options": {"priority": True}}, "invalid_envelope"),
    "tags-not-array": ({"options": {"tags": "a,b"}}, "invalid_envelope"),
    "nested-too-deep": ({"args": [_deep(300)]}, "invalid_envelope"),
    "too-large": ({"args": ["x" * MAX_ENVELOPE_BYTES]}, "too_large"),
}


async def test_every_kind_of_poison_envelope_is_dead_lettered(scene: Scene) -> None:
    """One row of each poison kind among good rows: each poison row is dead-lettered with
    its reason after one look, never sent; every good row is published; the relay never
    crashes."""
    await scene.start_sink(*OVERWRITE)
    good = await scene.produce(30)
    poison: dict[str, str] = {}
    for patch, reason in POISON.values():
        job = new_job("test.echo", [{"n": 1}]) | patch
        await scene.conn.execute(
            f"INSERT INTO {scene.sql_table} (event_id, job) VALUES ($1, $2::jsonb)",
            uuid.UUID(job["id"]),
            json.dumps(job),
        )
        poison[job["id"]] = reason
    more = await scene.produce(30)
    relay = await scene.relay("relay", RELAYD_SINK__MAX_ENVELOPE_BYTES=str(MAX_ENVELOPE_BYTES))
    await scene.drained()
    await scene.check()
    assert await scene.dead() == poison
    assert await scene.published() == len(good) + len(more)
    assert scene.sink is not None
    sent = (await scene.sink.ledger())["jobs"]
    assert not set(poison) & set(sent), "a poison row reached the sink"
    assert await relay.stop() == 0
    assert "daemon.task_crashed" not in relay.log()


# Newlines, a carriage return, an escape sequence, a NUL, a bell and a Unicode line separator:
# what a hostile or broken sink might echo into its error message.
HOSTILE_TEXT = "bad\nline two\r\n\x1b[31mred\x1b[0m \x00nul \x07bell \u2028sep"


async def test_sink_error_text_with_control_characters(scene: Scene) -> None:
    """The sink refuses one job with a 400 whose message holds newlines and control
    characters: the row is dead-lettered `sink_rejected`; the relay's log stays one JSON
    record per line, and last_error holds no raw control character."""
    sink = await scene.start_sink(*OVERWRITE)
    ids = await scene.produce(5)
    body = {"error": {"code": "invalid_request", "message": HOSTILE_TEXT, "retryable": False}}
    await sink.faults(
        {
            "action": "status",
            "status": 400,
            "method": "POST",
            "job_id": ids[2],
            "body": json.dumps(body),
            "content_type": "application/json",
        }
    )
    relay = await scene.relay("relay", RELAYD_SINK__BATCH="off")
    await scene.drained()
    await scene.check()
    assert await scene.dead() == {ids[2]: "sink_rejected"}
    assert await relay.stop() == 0
    records = [json.loads(line) for line in relay.log().splitlines() if line.startswith("{")]
    lines = [line for line in relay.log().splitlines() if line.strip()]
    # Every line is a whole record (failpoint lines aside, none are armed here).
    assert len(records) == len(lines), "a log record was split across lines"
    dead = [r for r in records if ids[2] in json.dumps(r) and "dead" in r.get("event", "")]
    assert len(dead) == 1, f"expected one dead-letter record for the row, got {dead}"
    last_error = await scene.conn.fetchval(
        f"SELECT last_error FROM {scene.sql_table} WHERE event_id = $1", uuid.UUID(ids[2])
    )
    assert last_error.startswith("HTTP 400: invalid_request")
    assert not any(ord(ch) < 0x20 or ch in "\x7f\u2028\u2029" for ch in last_error), last_error


@pytest.mark.parametrize(
    "table",
    [
        "outbox; DROP TABLE relayd.outbox; --",
        '"relayd"."outbox"',
        "Relayd.Outbox",
        "relayd.outbox.extra",
        "relayd.out box",
    ],
)
async def test_a_hostile_table_name_is_refused(scene: Scene, table: str) -> None:
    """`outbox.table` names something that is not a plain identifier: `relayd run` exits 2
    with one line naming the key, touching nothing; the outbox keeps its rows, which a
    correctly configured relay then publishes."""
    await scene.start_sink(*OVERWRITE)
    ids = await scene.produce(10)
    refused = await scene.relay("refused", ready=False, RELAYD_OUTBOX__TABLE=table)
    assert await refused.wait() == 2
    lines = [line for line in refused.log().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "outbox.table" in lines[0]
    assert "Traceback" not in refused.log()
    assert await scene.pending() == len(ids)
    await scene.relay("relay")
    await scene.drained()
    await scene.check()
