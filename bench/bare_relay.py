"""A bare relay in a process of its own: the ceiling of `lag`'s latency on this machine, what
a commit-to-receipt pipeline of the same parts costs with nothing of relayd in it.

`python -m bench.bare_relay DSN TABLE CHANNEL URL` LISTENs on the outbox's CHANNEL and, woken by a
notification, claims every due row (up to 100) with one durable UPDATE, as relayd's claim
does (lease in `available_at`, `last_attempt_at` stamped with the claim's start, committed
to disk before any request), POSTs the rows to the OJS server at URL (one job: `POST
/ojs/v1/jobs`; more: `/ojs/v1/jobs/batch`), and marks them published with one UPDATE that
does not wait for the disk, as relayd's settle. The same client libraries (asyncpg, aiohttp
with the sinks' session) on the same event loop as `relayd run`, four loops as relayd's four
workers, each woken alone (a notification wakes one idle loop; a full claim wakes another).

What it leaves out is what relayd adds: owner tokens and fencing, the watermark, pauses and
ordered keys in the claim, envelopes parsed and checked, answers classified, retries,
deadlines, metrics, logs. It never retries: any answer but 2xx, or a failed statement, ends
the process with exit 1 and the reason on stderr. It runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from bench.measure import BenchError, process_cpu_s
from relayd.core import __version__
from relayd.core.rows import OutboxTable
from relayd.sinks.http.exchange import new_session
from relayd.sinks.ojs.answers import BATCH_PATH, JOBS_PATH
from relayd.sinks.ojs.settings import OjsSettings

LOOPS = 4  # relay.workers' default
LIMIT = 100  # relay.batch_size's default
LEASE_S = 30.0  # relay.lease_s's default
MEDIA_TYPE = "application/openjobspec+json"

CLAIM = """
UPDATE {table} AS o
SET available_at = now() + make_interval(secs => $1),
    attempts = o.attempts + 1,
    last_attempt_at = now()
FROM (SELECT event_id FROM {table}
      WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()
      ORDER BY available_at, event_id
      LIMIT $2
      FOR UPDATE SKIP LOCKED) AS due
WHERE o.event_id = due.event_id
RETURNING o.event_id, convert_to(o.job::text, 'UTF8')
"""
SETTLE = "UPDATE {table} SET published_at = now() WHERE event_id = ANY($1::uuid[])"


async def _relay(dsn: str, table: str, channel: str, url: str) -> None:
    claim_sql, settle_sql = CLAIM.format(table=table), SETTLE.format(table=table)
    # The claim commits to disk, the settle does not: relayd's two settings.
    claimer = await asyncpg.create_pool(
        dsn, min_size=LOOPS, max_size=LOOPS, server_settings={"synchronous_commit": "on"}
    )
    settler = await asyncpg.create_pool(
        dsn, min_size=LOOPS, max_size=LOOPS, server_settings={"synchronous_commit": "off"}
    )
    listener = await asyncpg.connect(dsn)
    wakeups: asyncio.Queue[None] = asyncio.Queue()

    def wake(*_args: Any) -> None:
        if wakeups.empty():  # one token is enough: its loop claims every due row
            wakeups.put_nowait(None)

    await listener.add_listener(channel, wake)
    settings = OjsSettings(url=url)
    headers = {"Accept": MEDIA_TYPE, "User-Agent": f"relayd/{__version__}"}
    posted = {"Content-Type": MEDIA_TYPE}

    async def loop(http: Any) -> None:
        while True:
            await wakeups.get()
            rows = await claimer.fetch(claim_sql, LEASE_S, LIMIT)
            if not rows:
                continue
            if len(rows) == LIMIT:
                wake()  # more may be due: another loop joins in
            if len(rows) == 1:
                path, body = JOBS_PATH, rows[0][1]
            else:
                path, body = BATCH_PATH, b'{"jobs":[' + b",".join(r[1] for r in rows) + b"]}"
            async with http.post(url + path, data=body, headers=posted) as answer:
                await answer.read()
                if answer.status >= 300:
                    raise SystemExit(f"bare relay: HTTP {answer.status} for {path}")
            await settler.execute(settle_sql, [r[0] for r in rows])

    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    async with new_session(settings, headers) as http:
        loops = [asyncio.create_task(loop(http)) for _ in range(LOOPS)]
        wake()  # rows committed before the LISTEN
        print("ready", flush=True)
        stopped = asyncio.create_task(stopping.wait())
        await asyncio.wait([stopped, *loops], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        failed = [task for task in loops if task.done()]
        for task in loops:
            task.cancel()
        await asyncio.gather(stopped, *loops, return_exceptions=True)
        for task in failed:
            task.result()  # a loop's failure: exit 1 with its reason
    await listener.close()
    await claimer.close()
    await settler.close()


@dataclass
class BareRelay:
    """The running bare relay, where `lag` reads a relay's CPU and checks it is alive (as
    `bench.harness.Relays`; it has no /metrics: `members` is empty)."""

    table: OutboxTable
    process: asyncio.subprocess.Process
    log: Path
    members: list[Any] = field(default_factory=list)

    def cpu_s(self) -> float:
        return process_cpu_s(self.process.pid)

    def check_alive(self, doing: str) -> None:
        if self.process.returncode is not None:
            said = self.log.read_text(encoding="utf-8", errors="replace").strip()
            raise BenchError(f"the bare relay exited during {doing}: {said[-300:]}")

    def warnings(self) -> dict[str, int]:
        return {}


@contextlib.asynccontextmanager
async def bare_relay(dsn: str, table: OutboxTable, url: str, log: Path) -> AsyncIterator[BareRelay]:
    """The bare relay on `table`, once it listens; stopped (SIGTERM) on exit."""
    with log.open("wb") as errors:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.bare_relay",
            dsn,
            table.qualified,
            str(table),
            url,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
        )
        relay = BareRelay(table, process, log)
        try:
            assert process.stdout is not None
            async with asyncio.timeout(30):
                ready = await process.stdout.readline()
            if ready.strip() != b"ready":
                relay.check_alive("its start")
                raise BenchError(f"the bare relay said {ready!r} instead of ready")
            yield relay
        finally:
            if process.returncode is None:
                process.terminate()
            await process.wait()


def main(argv: list[str]) -> None:
    dsn, table, channel, url = argv
    try:
        import uvloop  # noqa: PLC0415 - the event loop `relayd run` uses, where installed

        run: Any = uvloop.run
    except ImportError:
        run = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        run(_relay(dsn, table, channel, url))


if __name__ == "__main__":
    main(sys.argv[1:])
