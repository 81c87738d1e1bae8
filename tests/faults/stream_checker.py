"""The history checker's NATS side: it reads a JetStream stream back, message by message,
and judges it against the outbox.

`read_stream` (relayd/testing/nats.py) returns every stored message. `ledger_of`
turns them into the emulator's ledger shape (`{"jobs": {id: {"created", "job", ...}}}`, the
job rebuilt from the message: id from `Nats-Msg-Id`, type from `ce-type`, args `[body]`,
meta from `ce-dataversion` and `ce-time`), so that tests/faults/checker.py's rules (lost,
unexpected, duplicated, falsely published, stale token) run unchanged over a stream. A
message without `Nats-Msg-Id` shows as an id the outbox never had (unexpected).

`stream_problems` adds what only a stream can get wrong: every published row's message must
carry exactly the headers relayd promises (`Nats-Msg-Id` = `Message-Id` = `ce-id` = the
event id, the `ce-` attributes, the expected stream) on its route's subject, with the
event's data as the body, in relayd's encoding (compact JSON, sorted keys); a dead row's id
may be in the stream only as the message a scenario planted there (`planted`: id -> body,
the conflict), and that row must be dead-lettered `conflict`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from nats.aio.client import Client

from relayd.core.envelope import META_OCCURRED_AT, META_VERSION
from relayd.core.rows import OutboxTable
from relayd.testing.nats import Stored, read_stream
from tests.faults.checker import Report, assert_clean, check

# The header a route whose subject holds the ordering key fences each publish with.
FENCE = "Nats-Expected-Last-Subject-Sequence"


@dataclass(frozen=True)
class Expected:
    """What the stream should hold: its name, the events' ce-source, each event type's
    subject (`{key}` in it: the row's ordering key), and the messages a scenario planted
    under an event's id (id -> body)."""

    stream: str
    source: str
    subjects: Mapping[str, str]
    planted: Mapping[str, bytes] = field(default_factory=dict)
    # Atomic-marker mode: each published event's marker on `<markers>.<id>`, stored just
    # before it (one batch); None: no markers expected.
    markers: str | None = None
    # lease_s - sink.timeout_s of the relays: an attempt starts before lease_s - 2 x
    # timeout_s from its claim (its start-by time, C4) and ends within timeout_s, so no
    # message may be stored later than this after the claim that sent it.
    send_window_s: float | None = None


def ledger_of(messages: list[Stored]) -> dict[str, Any]:
    """The stream as an emulator ledger: per id, how many messages carry it and the job the
    first one spells."""
    counts = Counter(m.event_id for m in messages)
    jobs: dict[str, dict[str, Any]] = {}
    for message in messages:
        if message.event_id in jobs:
            continue
        headers = message.headers
        try:
            data = json.loads(message.body)
        except ValueError:
            data = f"(unreadable body: {message.body[:60]!r})"
        meta: dict[str, Any] = {META_OCCURRED_AT: headers.get("ce-time")}
        version = headers.get("ce-dataversion", "")
        meta[META_VERSION] = int(version) if version.isdigit() else version
        job = {"id": headers.get("ce-id"), "type": headers.get("ce-type"), "args": [data]}
        jobs[message.event_id] = {
            "created": counts[message.event_id],
            "overwrites": 0,
            "queue": None,
            "job": job | {"meta": meta},
        }
    return {"jobs": jobs}


def body_of(data: Any) -> bytes:
    """The body relayd promises for an event's data: JSON, compact, keys sorted."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def stream_problems(  # noqa: PLR0912 - each rule of a published row's message
    rows: Sequence[Mapping[str, Any]], messages: Sequence[Stored], expected: Expected
) -> list[str]:
    """What the stream holds wrongly for the outbox `rows` (event_id, job, published_at,
    dead_reason)."""
    by_id: dict[str, list[Stored]] = {}
    for message in messages:
        by_id.setdefault(message.event_id, []).append(message)
    # Where a route's subject holds the ordering key, each message expects the sequence of
    # the one before it on its subject (0 for the first): the fence.
    before: dict[int, int] = {}
    last_on: dict[str, int] = {}
    for message in messages:
        before[message.seq] = last_on.get(message.subject, 0)
        last_on[message.subject] = message.seq
    problems = []
    for row in rows:
        event_id, held = row["event_id"], by_id.get(row["event_id"], [])
        if row["published_at"] is not None:
            if len(held) != 1:
                problems.append(f"{event_id}: published, {len(held)} messages in the stream")
                continue
            envelope = json.loads(row["job"])
            headers = {
                "Nats-Msg-Id": event_id,
                "Message-Id": event_id,
                "Nats-Expected-Stream": expected.stream,
                "ce-specversion": "1.0",
                "ce-id": event_id,
                "ce-type": envelope["type"],
                "ce-source": expected.source,
                "ce-time": envelope["meta"][META_OCCURRED_AT],
                "ce-dataversion": str(envelope["meta"][META_VERSION]),
                "ce-datacontenttype": "application/json",
                "Content-Type": "application/json",
            }
            [message] = held
            held_headers = dict(message.headers)
            subject = expected.subjects.get(envelope["type"], "")
            if "{key}" in subject.split("."):
                subject = subject.replace("{key}", str(row["ordering_key"]))
                headers[FENCE] = str(before[message.seq])
            if expected.markers is not None:
                # The event closes its batch (marker first); marker_problems checks the id.
                headers |= {"Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"}
                headers["Nats-Batch-Id"] = held_headers.get("Nats-Batch-Id", "(none)")
            if held_headers != headers:
                wrong = {
                    name: held_headers.get(name)
                    for name in headers.keys() | held_headers.keys()
                    if held_headers.get(name) != headers.get(name)
                }
                problems.append(f"{event_id}: headers differ: {wrong}")
            if message.body != body_of(envelope["args"][0]):
                problems.append(f"{event_id}: body {message.body!r}")
            if message.subject != subject:
                problems.append(f"{event_id}: on subject {message.subject}")
        elif event_id in expected.planted:
            if row["dead_reason"] != "conflict":
                problems.append(f"{event_id}: planted conflict, dead {row['dead_reason']}")
            if [m.body for m in held] != [expected.planted[event_id]]:
                problems.append(f"{event_id}: the planted message is not alone under its id")
        elif row["dead_reason"] is not None and held:
            problems.append(f"{event_id}: dead ({row['dead_reason']}) but in the stream")
    return problems


def split_markers(
    stored: Sequence[Stored], prefix: str | None
) -> tuple[dict[str, list[Stored]], list[Stored]]:
    """Atomic-marker mode's markers (by the event id their subject names) apart from the
    events; with no `prefix`, every message is an event."""
    markers: dict[str, list[Stored]] = {}
    messages = []
    for message in stored:
        if prefix is not None and message.subject.startswith(f"{prefix}."):
            markers.setdefault(message.subject.removeprefix(f"{prefix}."), []).append(message)
        else:
            messages.append(message)
    return markers, messages


def marker_problems(
    rows: Sequence[Mapping[str, Any]],
    stored: Sequence[Stored],
    markers: Mapping[str, list[Stored]],
) -> list[str]:
    """In atomic-marker mode: each published row's marker once, stored just before its
    event (one batch), and no marker for anything else."""
    at = {message.seq: message for message in stored}
    published = {row["event_id"] for row in rows if row["published_at"] is not None}
    problems = []
    for event_id in sorted(published | markers.keys()):
        held = markers.get(event_id, [])
        if event_id not in published:
            problems.append(f"{event_id}: {len(held)} marker(s), not published")
        elif len(held) != 1:
            problems.append(f"{event_id}: published, {len(held)} markers")
        elif (after := at.get(held[0].seq + 1)) is None or after.event_id != event_id:
            problems.append(f"{event_id}: its marker (seq {held[0].seq}) is not before it")
        elif held[0].headers.get("Nats-Batch-Id") != after.headers.get("Nats-Batch-Id"):
            problems.append(f"{event_id}: its marker is of another batch")
    return problems


def late_stores(
    messages: Sequence[Stored], claims: Sequence[Mapping[str, Any]], expected: Expected
) -> list[str]:
    """Messages stored after their start-by bound (C4): later than `send_window_s` after
    the row's latest claim (`claims`: event_id, tx_now, in order) before the store, or
    before any claim of the row at all (planted messages aside)."""
    assert expected.send_window_s is not None
    claimed: dict[str, list[datetime]] = {}
    for claim in claims:
        claimed.setdefault(claim["event_id"], []).append(claim["tx_now"])
    problems = []
    for message in messages:
        if message.event_id in expected.planted or message.stored_at is None:
            continue
        before = [at for at in claimed.get(message.event_id, []) if at <= message.stored_at]
        if not before:
            problems.append(f"{message.event_id}: stored (seq {message.seq}) before any claim")
            continue
        late_s = (message.stored_at - before[-1]).total_seconds() - expected.send_window_s
        if late_s > 0:
            problems.append(
                f"{message.event_id}: stored {late_s:.3f} s past its claim's start-by bound "
                f"({expected.send_window_s:g} s after the claim at {before[-1].isoformat()})"
            )
    return problems


# Each claim of a row (a new lease owner): when its transaction ran.
_CLAIMS = (
    "SELECT event_id::text AS event_id, tx_now FROM relayd_test.transitions "
    "WHERE outbox = $1 AND new_lease_owner IS NOT NULL "
    "AND new_lease_owner IS DISTINCT FROM old_lease_owner ORDER BY serial"
)

_ROWS = (
    "SELECT event_id::text AS event_id, job::text AS job, published_at, dead_reason, "
    "ordering_key FROM {t}"
)


async def check_stream(
    conn: asyncpg.Connection, client: Client, expected: Expected, *, table: str = "relayd.outbox"
) -> Report:
    """The history checker over the outbox and the stream, then the stream's own rules;
    fails the test with every violation."""
    stored = await read_stream(client, expected.stream)
    markers, messages = split_markers(stored, expected.markers)
    report = await check(conn, ledger_of(messages), table=table)
    assert_clean(report)
    rows = [
        dict(row) for row in await conn.fetch(_ROWS.format(t=OutboxTable.parse(table).qualified))
    ]
    problems = stream_problems(rows, messages, expected)
    if expected.markers is not None:
        problems += marker_problems(rows, stored, markers)
    if expected.send_window_s is not None:
        claims = [dict(r) for r in await conn.fetch(_CLAIMS, str(OutboxTable.parse(table)))]
        problems += late_stores(messages, claims, expected)
    if problems:
        raise AssertionError(
            f"stream check: {len(problems)} problem(s) over {len(rows)} rows and "
            f"{len(messages)} messages:\n" + "\n".join(problems[:50])
        )
    return report
