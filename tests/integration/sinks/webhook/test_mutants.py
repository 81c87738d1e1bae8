"""Negative controls of the webhook tests: a sink that signs with a wrong secret, or gives a
re-sent delivery a new webhook-id, fails the scenario that a correct sink passes, with the
violation it causes (tests/faults/switches/webhook_mutants.py)."""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from relayd.core.envelope import META_OCCURRED_AT
from relayd.producer import enqueue_many, new_job
from relayd.settings import Settings
from relayd.testing.webhook_receiver import Fault, receiving
from tests.faults.switches.patches import Patches
from tests.faults.switches.webhook_mutants import WEBHOOK_MUTANTS, install
from tests.support import FAST, Database, drained, eventually, running

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
CAUGHT_BY = {
    "wrong_secret": r"signatures refused \(\d+\)",
    "id_per_attempt": r"deliveries under ids no row has \(\d+\)",
}


@pytest.fixture
def patches() -> Iterator[Patches]:
    installed = Patches()
    yield installed
    installed.restore()


async def every_row_verified_once_per_id(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """20 rows, 3 of them dropped after the receiver stored them: every delivery verifies,
    every id the receiver stores is a row's event id, and every row is stored."""
    secret_file = tmp_path / "whsec"
    secret_file.write_text(SECRET + "\n")
    # One event says when it occurred; the rest take the time from their UUIDv7 ids.
    jobs = [new_job("order.paid", [{"n": 0}], meta={META_OCCURRED_AT: "2024-05-01T12:00:00Z"})]
    jobs += [new_job("order.paid", [{"n": n}]) for n in range(1, 20)]
    async with conn.transaction():
        await enqueue_many(conn, jobs)
    ids = {str(job["id"]) for job in jobs}
    dropped = sorted(ids)[:3]
    arrivals: Counter[str] = Counter()

    def script(path: str, webhook_id: str, before: int) -> Fault | None:
        arrivals[webhook_id] += 1
        return Fault(drop=True) if webhook_id in dropped and arrivals[webhook_id] == 1 else None

    merged = {name: dict(values) for name, values in FAST.items()}
    merged["database"] = {"dsn": dsn}
    async with receiving([SECRET], script) as receiver:
        merged["sink"] |= {
            "kind": "webhook",
            "timeout_s": 1.0,
            "url": receiver.endpoint(),
            "secret_file": str(secret_file),
        }
        async with running(Settings(**merged)):  # type: ignore[arg-type]

            async def settled() -> bool:
                return len(receiver.refused) >= 5 or await drained(conn)

            await eventually(settled, timeout_s=20)
    assert not receiver.refused, f"signatures refused ({len(receiver.refused)})"
    foreign = set(receiver.stored) - ids
    assert not foreign, f"deliveries under ids no row has ({len(foreign)})"
    assert ids <= set(receiver.stored), "rows never delivered"
    assert all(receiver.seen[event_id] == 2 for event_id in dropped)


def test_every_webhook_mutant_is_caught() -> None:
    """Each mutant has the scenario's violation it must cause."""
    assert set(CAUGHT_BY) == set(WEBHOOK_MUTANTS)


async def test_the_scenario_passes_on_the_real_sink(
    database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """The positive control: the unbroken sink passes the scenario."""
    await every_row_verified_once_per_id(database.dsn, conn, tmp_path)


@pytest.mark.parametrize("mutant", WEBHOOK_MUTANTS)
async def test_the_mutant_fails_the_scenario(
    database: Database, conn: asyncpg.Connection, tmp_path: Path, patches: Patches, mutant: str
) -> None:
    """A broken sink fails the scenario with the violation it causes."""
    install(mutant, patches)
    with pytest.raises(AssertionError, match=CAUGHT_BY[mutant]):
        await every_row_verified_once_per_id(database.dsn, conn, tmp_path)
