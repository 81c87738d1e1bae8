"""`relayd demo` (the default, `--sink ojs`): the OJS emulator in its own process, with a few
scripted faults (answers lost after the job was stored, 503s), and its ledger as the ground
truth: every published id on the sink exactly once, with an identical envelope.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from relayd.core.envelope import Envelope
from relayd.demo import TABLE, Orders, Summary, note_problems
from relayd.producer import new_job, uuid7
from relayd.sinks.ojs.answers import differences
from relayd.testing.processes import emulator_process

# Scripted sink misbehaviour, so the summary shows reconciliation at work.
DEMO_FAULTS: list[dict[str, Any]] = [
    {"action": "store_then_drop", "method": "POST", "path": "/ojs/v1/jobs/batch", "times": 2},
    {"action": "store_then_drop", "method": "POST", "path": "/ojs/v1/jobs", "times": 3},
    {"action": "status", "method": "POST", "path": "/ojs/v1/jobs/batch", "status": 503, "times": 3},
]


class OjsDemo:
    """The OJS emulator as the demo's destination."""

    destination = "the emulator"
    requires: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._url = ""

    async def start(self, stack: AsyncExitStack, base: Path) -> dict[str, Any]:
        self._url = await stack.enter_async_context(emulator_process(base))
        print(f"  OJS emulator  {self._url} (separate process)")
        async with aiohttp.ClientSession() as http:
            await http.post(f"{self._url}/_emulator/faults", json=DEMO_FAULTS)
        print("  sink faults   2 batch answers and 3 single answers lost after storing; 3 x 503")
        return {"url": self._url}

    def orders(self) -> Orders:
        def jobs_for(order_ids: range) -> list[dict[str, Any]]:
            return [
                new_job(
                    "order.fulfill",
                    [{"order_id": order_id, "version": 1}],
                    queue="orders",
                    meta={"correlation_id": f"order-{order_id}"},
                )
                for order_id in order_ids
            ]

        return Orders(jobs_for, _poison_jobs())

    async def check(self, watch: asyncpg.Connection, summary: Summary) -> None:
        """The emulator's ledger is the ground truth: compare it with the outbox."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self._url}/_emulator/ledger") as answer,
        ):
            ledger: dict[str, Any] = (await answer.json())["jobs"]
        rows = await watch.fetch(
            f"SELECT event_id::text, job::text FROM {TABLE.qualified} "
            "WHERE published_at IS NOT NULL"
        )
        missing, twice, changed = 0, 0, 0
        for row in rows:
            entry = ledger.get(row["event_id"])
            if entry is None or entry["job"] is None:
                missing += 1
                continue
            if entry["created"] != 1:
                twice += 1
            if differences(Envelope.parse(row["job"], row["event_id"]), entry["job"]):
                changed += 1
        unexpected = set(ledger) - {row["event_id"] for row in rows} - set(summary.poison)
        note_problems(
            summary,
            "ledger check",
            [
                (missing, "published ids missing on the sink"),
                (twice, "ids created more than once"),
                (changed, "envelopes that differ on the sink"),
                (len(unexpected), "jobs on the sink the outbox does not know"),
            ],
        )

    def verdict(self) -> tuple[str, str, str]:
        return (
            "by GET after a lost answer",
            "ledger check",
            "every published id is on the sink exactly once, with an identical envelope",
        )


def _poison_jobs() -> dict[str, dict[str, Any]]:
    """Rows the outbox's checks accept but that can never publish, by expected reason."""
    return {
        "invalid_envelope": {"id": uuid7(), "type": "Order.Fulfill", "args": []},
        "too_large": new_job("report.attach", ["x" * (2 * 1024 * 1024)]),
        # Tags must be strings; relayd does not check their items, the sink does (400).
        "sink_rejected": new_job("order.fulfill", [], options={"tags": [1, 2]}),
        "sink_unprocessable": new_job("order.fulfill", [], options={"retry": {"max_attempts": -1}}),
    }
