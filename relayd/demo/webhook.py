"""`relayd demo --sink webhook`: an embedded webhook receiver (relayd/testing/
webhook_receiver.py) as the demo's destination (relayd/demo/__init__.py). It verifies every
delivery's signature with the `standardwebhooks` package, refuses stale timestamps and
stores each delivery by its `webhook-id`; the relay signs with a freshly generated `whsec_`
secret file.

The receiver drops a few connections after storing (relayd re-sends them with the same id),
answers a few with 503 and a Retry-After (relayd slows down without using their attempts),
and refuses one row with 400; a few rows can never publish (too large, not an event). The
receiver is the ground truth: every published id verified and stored, under its own id,
with its event as the body; ids delivered twice only where a connection was dropped.
"""

from __future__ import annotations

import base64
import json
import secrets
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from relayd.core.envelope import META_OCCURRED_AT
from relayd.demo import TABLE, Orders, Summary, note_problems
from relayd.producer import new_job
from relayd.testing.webhook_receiver import Fault, Receiver, receiving

EVENT_TYPE = "order.paid"
MAX_ENVELOPE_BYTES = 64 * 1024
# Deliveries whose connection the receiver drops after storing, and answers with 503.
DROPPED = 3
SLOWED = 3


def event(data: dict[str, Any], *, event_type: str = EVENT_TYPE) -> dict[str, Any]:
    """An order event as the application commits it (occurred now)."""
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return new_job(event_type, [data], meta={META_OCCURRED_AT: when})


class _Script:
    """The receiver's misbehaviour: the first DROPPED ids stored then dropped, the next
    SLOWED answered 503 with a Retry-After, and the refused ids answered 400, each once."""

    def __init__(self) -> None:
        self.refused: set[str] = set()
        self.dropped: set[str] = set()
        self.slowed: set[str] = set()

    def __call__(self, path: str, webhook_id: str, before: int) -> Fault | None:
        if webhook_id in self.refused:
            return Fault(400, store=False)
        if before == 0 and len(self.dropped) < DROPPED and webhook_id not in self.slowed:
            self.dropped.add(webhook_id)
            return Fault(drop=True)
        if before == 0 and webhook_id not in self.slowed and len(self.slowed) < SLOWED:
            self.slowed.add(webhook_id)
            return Fault(503, {"Retry-After": "1"}, store=False)
        return None


class WebhookDemo:
    """A receiver verifying every signature as the demo's destination."""

    destination = "the receiver"
    requires: tuple[str, ...] = ("standardwebhooks",)

    def __init__(self) -> None:
        self._script = _Script()
        self._receiver: Receiver | None = None

    async def start(self, stack: AsyncExitStack, base: Path) -> dict[str, Any]:
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        secret_file = base / "webhook-secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secret + "\n")
        self._receiver = receiver = await stack.enter_async_context(
            receiving([secret], self._script)
        )
        print(f"  receiver      {receiver.endpoint()} (embedded), verifying every signature")
        print(f"  receiver faults  {DROPPED} connections dropped after storing; {SLOWED} x 503")
        return {
            "url": receiver.endpoint(),
            "secret_file": str(secret_file),
            "max_envelope_bytes": MAX_ENVELOPE_BYTES,
        }

    def orders(self) -> Orders:
        script = self._script

        async def before_commit(
            jobs: list[dict[str, Any]], bad: list[tuple[str, dict[str, Any]]]
        ) -> None:
            script.refused.update(str(job["id"]) for reason, job in bad if reason != "too_large")

        return Orders(
            lambda ids: [event({"order_id": n, "amount_cents": 100 * n}) for n in ids],
            _poison(),
            before_commit,
        )

    async def check(self, watch: asyncpg.Connection, summary: Summary) -> None:
        await _check_receiver(watch, self._started(), self._script, summary)

    def verdict(self) -> tuple[str, str, str]:
        arrivals = sum(self._started().seen.values())
        return (
            "- receivers deduplicate by webhook-id instead",
            "receiver check",
            f"{arrivals:,} verified deliveries; every published id stored under its own\n"
            "                     webhook-id with its event; duplicates only where a "
            "connection dropped",
        )

    def _started(self) -> Receiver:
        if self._receiver is None:
            raise RuntimeError("WebhookDemo.start() was not called")
        return self._receiver


def _poison() -> dict[str, dict[str, Any]]:
    """Rows that can never publish, by the reason they are dead-lettered with: the receiver
    refuses one (400), one is too large, one is not an event."""
    return {
        "sink_rejected": event({"order_id": 0, "amount_cents": -1}),
        "too_large": event({"order_id": 0, "note": "x" * (2 * MAX_ENVELOPE_BYTES)}),
        "invalid_envelope": new_job(EVENT_TYPE, [{"order_id": 0}, "two args"]),
    }


async def _check_receiver(
    conn: asyncpg.Connection, receiver: Receiver, script: _Script, summary: Summary
) -> None:
    """The receiver is the ground truth: compare it with the outbox."""
    rows = await conn.fetch(
        f"SELECT event_id::text, job::text FROM {TABLE.qualified} WHERE published_at IS NOT NULL"
    )
    missing, changed = 0, 0
    for row in rows:
        delivery = receiver.stored.get(row["event_id"])
        if delivery is None:
            missing += 1
            continue
        job = json.loads(row["job"])
        expected = {
            "type": job["type"],
            "timestamp": job["meta"][META_OCCURRED_AT],
            "data": job["args"][0],
        }
        if delivery.body != expected:
            changed += 1
    twice = {webhook_id for webhook_id, n in receiver.seen.items() if n > 1} - script.dropped
    unexpected = set(receiver.stored) - {row["event_id"] for row in rows}
    note_problems(
        summary,
        "receiver check",
        [
            (missing, "published ids the receiver never stored"),
            (changed, "deliveries whose body differs from the event"),
            (len(twice), "ids delivered twice without a dropped connection"),
            (len(unexpected), "deliveries the outbox does not know"),
            (len(receiver.refused), "deliveries whose signature did not verify"),
        ],
    )
