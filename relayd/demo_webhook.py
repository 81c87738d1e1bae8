"""`relayd demo --sink webhook`: the Standard Webhooks path end to end on a laptop, with
nothing installed beyond relayd's dev extra.

1. an embedded PostgreSQL, and an embedded webhook receiver (relayd/testing/
   webhook_receiver.py) that verifies every delivery's signature with the `standardwebhooks`
   package, refuses stale timestamps and stores each delivery by its `webhook-id`;
2. `relayd migrate`, then `relayd run` as a subprocess with `[sink] kind = "webhook"` and a
   freshly generated `whsec_` secret file;
3. a producer that commits orders and their events together; the receiver drops a few
   connections after storing (relayd re-sends them with the same id), answers a few with
   503 and a Retry-After (relayd slows down without using their attempts), and refuses one
   row with 400; a few rows can never publish (too large, not an event);
4. a progress bar until the outbox is drained, a summary, and the receiver's deliveries
   checked against the outbox: every published id verified and stored, under its own id,
   with its event as the body; ids delivered twice only where a connection was dropped.

The demo plays the application and the operator, so it talks to PostgreSQL directly.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from relayd.demo import (
    TABLE,
    Orders,
    Summary,
    embedded_database,
    migrated,
    note_problems,
    print_summary,
    produce_orders,
    relay_through,
    run_in,
)
from relayd.events import META_OCCURRED_AT
from relayd.producer import new_job
from relayd.testing.processes import free_port, relay_process
from relayd.testing.webhook_receiver import Fault, Receiver, receiving

EVENT_TYPE = "order.paid"
MAX_ENVELOPE_BYTES = 64 * 1024
# Deliveries whose connection the receiver drops after storing, and answers with 503.
DROPPED = 3
SLOWED = 3


def run_webhook_demo(rows: int) -> int:
    """Run the demo; returns the process exit code."""
    return run_in("relayd-demo-webhook-", lambda base: _demo(base, rows))


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


async def _demo(base: Path, rows: int) -> int:
    print("relayd demo --sink webhook")
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    secret_file = base / "webhook-secret"
    secret_file.touch(mode=0o600)
    secret_file.write_text(secret + "\n")
    script = _Script()
    async with AsyncExitStack() as stack:
        dsn = await embedded_database(stack, base)
        receiver = await stack.enter_async_context(receiving([secret], script))
        print(f"  receiver      {receiver.endpoint()} (embedded), verifying every signature")
        conn, watch = await migrated(stack, dsn)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, paid boolean NOT NULL)"
        )
        metrics_port = free_port()
        relay = await stack.enter_async_context(
            relay_process(
                base,
                dsn,
                None,
                metrics_port,
                RELAYD_SINK__KIND="webhook",
                RELAYD_SINK__URL=receiver.endpoint(),
                RELAYD_SINK__SECRET_FILE=str(secret_file),
                RELAYD_SINK__MAX_ENVELOPE_BYTES=str(MAX_ENVELOPE_BYTES),
                RELAYD_RETRY__BASE_S="0.05",
                RELAYD_RETRY__CAP_S="1",
                RELAYD_RETRY__BREAKER_COOLDOWN_S="0.2",
            )
        )
        print(f"  relayd run    pid {relay.pid}, [sink] kind = webhook, signed with {secret_file}")
        print(f"  receiver faults  {DROPPED} connections dropped after storing; {SLOWED} x 503")
        print()
        summary = Summary()

        async def before_commit(
            jobs: list[dict[str, Any]], bad: list[tuple[str, dict[str, Any]]]
        ) -> None:
            script.refused.update(str(job["id"]) for reason, job in bad if reason != "too_large")

        orders = Orders(
            lambda ids: [event({"order_id": n, "amount_cents": 100 * n}) for n in ids],
            _poison(),
            before_commit,
        )
        await relay_through(
            watch,
            produce_orders(conn, rows, summary, orders),
            rows=rows,
            relay=relay,
            metrics_port=metrics_port,
            summary=summary,
        )
        await _check_receiver(watch, receiver, script, summary)
        arrivals = sum(receiver.seen.values())
    print_summary(
        summary,
        "- receivers deduplicate by webhook-id instead",
        "receiver check",
        f"{arrivals:,} verified deliveries; every published id stored under its own\n"
        "                     webhook-id with its event; duplicates only where a connection "
        "dropped",
    )
    if summary.problems:
        print(f"  logs kept in {base}")
        return 1
    shutil.rmtree(base, ignore_errors=True)
    return 0


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
