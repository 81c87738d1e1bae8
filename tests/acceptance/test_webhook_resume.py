"""A webhook endpoint that answered 410 Gone, then `relayd resume`, as an operator meets it with
two `relayd run` replicas on one outbox and a receiver that verifies every signature (the
`standardwebhooks` package): each replica that met the 410 delivers a row committed after
the resume within 2 s, and `relayd status` adds up meanwhile."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg

from relayd.core.envelope import META_OCCURRED_AT
from relayd.producer import enqueue_many, new_job
from relayd.testing.webhook_receiver import Fault, receiving
from tests.support import Database, eventually, run_relayd, start_relayd

SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()
# A row committed after the resume reaches the receiver within this (the bound).
RESUMED_WITHIN_S = 2.0


async def _commit(conn: asyncpg.Connection, event_type: str) -> str:
    job = new_job(event_type, [{}], meta={META_OCCURRED_AT: "2024-05-01T12:00:00Z"})
    async with conn.transaction():
        await enqueue_many(conn, [job])
    return str(job["id"])


@contextlib.asynccontextmanager
async def _replica(env: dict[str, str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """`relayd run`, its log in a file (an unread pipe would fill and stall it); continued
    if stopped, then stopped with SIGTERM on exit."""
    with log.open("wb") as out:
        process = await start_relayd("run", env=env, stdout=out, stderr=out)
        try:
            yield process
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                try:
                    async with asyncio.timeout(15):
                        await process.wait()
                except TimeoutError:
                    process.kill()
                    await process.wait()


@contextlib.contextmanager
def _stopped(process: asyncio.subprocess.Process) -> Iterator[None]:
    """The replica frozen (SIGSTOP) while the block runs: only the other one claims."""
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


async def test_a_resume_lets_every_replica_deliver_at_once(
    database: Database, conn: asyncpg.Connection, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """1. replica A meets the 410 alone: the type is paused (one pause, one audit row) and
    `relayd status` counts the held row as paused; 2. resumed, replica B meets the 410 alone:
    paused again; 3. the endpoint is back, `relayd resume`: the held row is delivered at
    once; 4. with B frozen, A delivers a row committed after the resume within 2 s; 5. with A
    frozen, B does. Every delivery verifies; nothing is dead-lettered."""
    secret_file = tmp_path / "whsec"
    secret_file.write_text(SECRET + "\n")
    gone = True
    arrivals: Counter[str] = Counter()

    def script(path: str, webhook_id: str, before: int) -> Fault | None:
        arrivals[webhook_id] += 1
        return Fault(410, store=False) if path == "gone" and gone else None

    async with receiving([SECRET], script) as receiver:
        env = cli_env | {
            "RELAYD_DATABASE__DSN": database.dsn,
            "RELAYD_SINK__KIND": "webhook",
            "RELAYD_SINK__SECRET_FILE": str(secret_file),
            "RELAYD_SINK__ROUTES": json.dumps(
                [
                    {"type": "order.paid", "url": receiver.endpoint("hooks")},
                    {"type": "order.lost", "url": receiver.endpoint("gone")},
                ]
            ),
            # Idle replicas claim when woken (a commit, a resume), not on a timer.
            "RELAYD_RELAY__POLL_INTERVAL_S": "30",
            "RELAYD_METRICS__SAMPLE_INTERVAL_S": "0.5",
            "RELAYD_HTTP__ENABLED": "false",
            "RELAYD_LOG__LEVEL": "warning",
        }

        async def settled(event_id: str, seen: int) -> None:
            """Until the row met the 410 `seen` times, is paused, and is out of its lease."""

            async def check() -> bool:
                leased = await conn.fetchval(
                    "SELECT lease_owner IS NOT NULL FROM relayd.outbox WHERE event_id = $1",
                    event_id,
                )
                paused = await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses")
                return arrivals[event_id] == seen and paused == 1 and not leased

            await eventually(check)

        async with (
            _replica(env, tmp_path / "a.log") as a,
            _replica(env, tmp_path / "b.log") as b,
        ):

            async def both_beat() -> bool:
                beats: int = await conn.fetchval("SELECT count(*) FROM relayd.relayd_instances")
                return beats == 2

            await eventually(both_beat)

            # 1. (B frozen before the row is committed: woken by its NOTIFY, B could otherwise
            # claim it first and be frozen holding its lease.)
            with _stopped(b):
                held = await _commit(conn, "order.lost")
                await settled(held, 1)
            code, out, err = await run_relayd("status", "--json", env=env)
            assert code == 0, err
            status = json.loads(out)
            assert status["backlog"]["rows"]["paused"] == 1
            assert [pause["held_rows"] for pause in status["pauses"]] == [1]

            # 2.
            with _stopped(a):
                code, out, err = await run_relayd("resume", "--type", "order.lost", env=env)
                assert code == 0, err
                await settled(held, 2)

            # 3.
            gone = False
            code, out, err = await run_relayd(
                "resume", "--type", "order.lost", "--reason", "the endpoint is back", env=env
            )
            assert code == 0, err
            assert "idle relays woken" in out
            await receiver.wait_for(lambda r: held in r.stored, timeout_s=RESUMED_WITHIN_S)

            # 4. and 5.
            for running, frozen in ((a, b), (b, a)):
                with _stopped(frozen):
                    later = await _commit(conn, "order.lost")
                    await receiver.wait_for(
                        lambda r: later in r.stored,  # noqa: B023 - awaited in this turn
                        timeout_s=RESUMED_WITHIN_S,
                    )
                assert running.returncode is None
    assert receiver.refused == []
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NOT NULL") == 0
    actions = await conn.fetch("SELECT action FROM relayd.relayd_audit ORDER BY id")
    assert [row["action"] for row in actions] == ["pause", "resume", "pause", "resume"]
