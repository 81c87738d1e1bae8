"""The world of the stateful relay model (tests/faults/test_model.py): two in-process relays
(each with its own pool, breaker, sink session and worker: two relay processes' worth of
state) over one real outbox, an in-process OJS emulator that overwrites a reused id, the
SQL the model moves time with, and the dead-letter redrive as `relayd dlq retry` runs it.

Nothing here is mocked: the relays run relayd's own `RelayWorker` steps against PostgreSQL
and the emulator over loopback. Every function is a coroutine for the model's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import asyncpg

from relayd.core.outcomes import Published
from relayd.daemon.lifecycle import Daemon
from relayd.engine.claim import Claim
from relayd.engine.relay import RelayContext, RelayWorker
from relayd.operator.dlq_actions import ActionSummary, DlqRequest, Selection, act, walk_end
from relayd.producer import enqueue_many, new_job
from relayd.settings import Settings
from relayd.sinks import SendWindow
from relayd.store import Store
from relayd.store.records import AuditEntry, DeadLetterFilter, DlqAction
from relayd.telemetry.metrics import RelayMetrics
from relayd.testing.emulator import (
    Emulator,
    EmulatorConfig,
    FaultRule,
    RunningEmulator,
    start_emulator,
)
from tests.faults.checker import install_history
from tests.support import relay_settings

# Leases far longer than any step (the model expires them in SQL, never by waiting), an
# attempt deadline short enough for "later than the deadline" to cost little time, and
# lease_s > 2 x timeout_s as the configuration demands.
LEASE_S = 10.0
TIMEOUT_S = 0.25
# A sink that answers (`store_then_delay`) or stores (`latency`) this late: past TIMEOUT_S.
LATE_MS = 350
BATCH_SIZE = 8
MAX_ENVELOPE_BYTES = 2048
# No step of the model takes this long unless something hangs.
STEP_TIMEOUT_S = 20.0

JOBS_PREFIX = "/ojs/v1/jobs"

EnvelopeKind = Literal["ok", "sink_rejects", "too_large", "bad_type"]
# Mostly good rows; the poison kinds each dead-letter a row with its own reason (C6):
# `sink_rejects` the sink answers 400 (sink_rejected), `too_large` is over
# sink.max_envelope_bytes (too_large, never sent), `bad_type` fails relayd's envelope check
# but not the table's (invalid_envelope, never sent).
ENVELOPE_KINDS: tuple[EnvelopeKind, ...] = (
    "ok",
    "ok",
    "ok",
    "ok",
    "sink_rejects",
    "too_large",
    "bad_type",
)

FaultKind = Literal[
    "status_503", "drop", "store_then_drop", "store_then_500", "latency", "store_then_delay"
]
FAULT_KINDS: tuple[FaultKind, ...] = (
    "status_503",
    "drop",
    "store_then_drop",
    "store_then_500",
    "latency",
    "store_then_delay",
)

_TRUNCATE = """
TRUNCATE relayd.outbox, relayd.relayd_audit, relayd.relayd_audit_rows, relayd.relayd_pauses,
    relayd_test.transitions
RESTART IDENTITY
"""
# A lease (or, with `lease_owner IS NULL`, a backoff) ended by hand: only available_at
# moves, back to now(), on a pending row (the checker's rule 4).
_EXPIRE = """
UPDATE relayd.outbox SET available_at = now()
WHERE published_at IS NULL AND dead_at IS NULL AND available_at > now()
  AND (lease_owner IS NOT NULL OR $1)
"""
_PENDING = "SELECT count(*) FROM relayd.outbox WHERE published_at IS NULL AND dead_at IS NULL"
_DEAD = """
SELECT event_id::text FROM relayd.outbox
WHERE dead_at IS NOT NULL AND published_at IS NULL AND discarded_at IS NULL
ORDER BY event_id
"""
_LEASES = """
SELECT event_id::text AS event_id, lease_owner FROM relayd.outbox
WHERE event_id = ANY($1::uuid[])
"""
_SNAPSHOT = """
SELECT event_id::text, lease_owner, attempts, available_at, last_attempt_at, published_at,
       sink_state, dead_at, dead_reason, last_error
FROM relayd.outbox WHERE event_id = ANY($1::uuid[]) ORDER BY event_id
"""


def model_settings(dsn: str, sink_url: str) -> Settings:
    """The relays' settings: tests/support.py's FAST, with the model's timings.

    The poison-storm guard is out of reach (a window it never fills): the model inserts
    poison rows by design, and a storm's pause would be an operator's to lift.
    """
    return relay_settings(
        dsn,
        sink_url,
        relay={
            "workers": 1,
            "batch_size": BATCH_SIZE,
            "lease_s": LEASE_S,
            "listen": False,
            "full_scan_interval_s": 0.5,
            "storm_threshold": 1.0,
            "storm_window": 100_000,
        },
        sink={
            "timeout_s": TIMEOUT_S,
            "connect_timeout_s": TIMEOUT_S,
            "concurrency": 8,
            "batch": "auto",
            "max_envelope_bytes": MAX_ENVELOPE_BYTES,
        },
        retry={
            "base_s": 0.01,
            "cap_s": 0.05,
            "max_attempts": 3,
            "breaker_threshold": 3,
            "breaker_cooldown_s": 0.02,
        },
        log={"level": "error"},
    )


@dataclass
class Relay:
    """One relay process's worth of state: a pool, a breaker, a sink session, a worker."""

    store: Store
    ctx: RelayContext
    worker: RelayWorker

    @classmethod
    async def open(cls, name: str, dsn: str, sink_url: str, seed: int) -> Relay:
        settings = model_settings(dsn, sink_url)
        store = await Store.connect(dsn, settings.outbox.outbox_table, max_size=4, daemon=True)
        try:
            daemon = Daemon(settings, metrics=RelayMetrics(), rng=random.Random(seed))
            ctx = daemon.make_context(store)
            await ctx.sink.start()
        except BaseException:
            await store.close()
            raise
        return cls(store, ctx, RelayWorker(ctx, name))

    async def close(self) -> None:
        await self.ctx.sink.close()
        await self.store.close()

    async def step(self) -> None:
        """One claim -> publish -> settle, once the breaker allows a claim (an open breaker
        waits out its cooldown, then the cycle is its probe)."""
        permit = await self.ctx.gate.acquire()
        assert permit is not None
        await self.worker.cycle(permit)

    async def claim(self, limit: int) -> Claim:
        return await self.worker.claim(limit)

    async def late_settle(self, old: Claim, taken: Sequence[str]) -> None:
        """The old owner settles `taken` (rows of its claim that another owner has taken
        since) as published: a relay that was slow past its lease (C3). The loop-time bounds
        are renewed so that the settle is really sent, not given up as too late."""
        now = asyncio.get_running_loop().time()
        rows = [row for row in old.rows if row.event_id in set(taken)]
        late = Claim(
            owner=old.owner,
            rows=rows,
            sent_at=now,
            window=SendWindow(now + LEASE_S),
            lease_ends=now + LEASE_S,
            answered_at=now,
        )
        await self.worker.settle(late, {row.event_id: Published("available") for row in rows}, {})


@dataclass
class World:
    """Everything one example of the model acts on; `close()` releases it all."""

    conn: asyncpg.Connection
    sink: RunningEmulator
    relays: tuple[Relay, Relay]
    _stack: contextlib.AsyncExitStack = field(repr=False)

    @property
    def emulator(self) -> Emulator:
        return self.sink.emulator

    async def close(self) -> None:
        await self._stack.aclose()


async def prepare_database(dsn: str) -> None:
    """Install the checker's transition history once per database (the triggers stay)."""
    conn = await asyncpg.connect(dsn)
    try:
        await install_history(conn)
    finally:
        await conn.close()


async def open_world(dsn: str) -> World:
    """An empty outbox and history (TRUNCATE: the schema stays), a fresh emulator in
    overwrite mode, and two relays."""
    async with contextlib.AsyncExitStack() as stack:
        conn = await asyncpg.connect(dsn)
        stack.push_async_callback(conn.close)
        await conn.execute(_TRUNCATE)
        sink = await start_emulator(EmulatorConfig(duplicate_mode="overwrite"))
        stack.push_async_callback(sink.stop)
        first = await Relay.open("relay-a", dsn, sink.url, seed=1)
        stack.push_async_callback(first.close)
        second = await Relay.open("relay-b", dsn, sink.url, seed=2)
        stack.push_async_callback(second.close)
        return World(conn, sink, (first, second), stack.pop_all())
    raise AssertionError("unreachable")  # pragma: no cover - the stack re-raises


def envelope(kind: EnvelopeKind, n: int) -> dict[str, Any]:
    if kind == "too_large":
        return new_job("model.echo", ["x" * (MAX_ENVELOPE_BYTES + 512)])
    if kind == "bad_type":
        return new_job("Not A Type!", [n])
    return new_job("model.echo", [{"n": n}])


async def insert(world: World, kinds: Sequence[EnvelopeKind], first_n: int) -> list[str]:
    """Commit one row per kind in one transaction; the sink refuses `sink_rejects` rows
    with a 400 from now on (every POST that carries one)."""
    jobs = [envelope(kind, first_n + i) for i, kind in enumerate(kinds)]
    for kind, job in zip(kinds, jobs, strict=True):
        if kind == "sink_rejects":
            world.emulator.add_fault(
                FaultRule(
                    action="status",
                    status=400,
                    code="invalid_request",
                    method="POST",
                    path_prefix=JOBS_PREFIX,
                    job_id=str(job["id"]),
                    times=None,
                )
            )
    async with world.conn.transaction():
        await enqueue_many(world.conn, jobs)
    return [str(job["id"]) for job in jobs]


def fault_rule(kind: FaultKind, method: str, times: int | None = 1) -> FaultRule:
    """A misbehaviour of the sink's next `times` matching requests."""
    common: dict[str, Any] = {"method": method, "path_prefix": JOBS_PREFIX, "times": times}
    if kind == "status_503":
        return FaultRule(action="status", status=503, **common)
    if kind == "store_then_500":
        return FaultRule(action="store_then_status", status=500, **common)
    if kind in ("latency", "store_then_delay"):
        return FaultRule(action=kind, delay_ms=LATE_MS, **common)
    return FaultRule(action=kind, **common)


def _sink_quiet(emulator: Emulator) -> bool:
    """Every POST the sink received has been answered (or dropped)."""
    return all(len(entry.post_statuses) == entry.posts for entry in emulator.ledger().values())


async def sink_settled(world: World) -> None:
    """Let the sink finish the POSTs it is still processing (a `latency` rule stores a job
    after relayd gave up on the request).

    Without this a POST held past the attempt deadline could store its job after another
    attempt's GET found nothing and POSTed again: on a sink that overwrites a reused id
    that is a second creation, the window docs/contract.md#c4 says no client can close.
    The model lets the network deliver late requests before the next step, so it reports
    only what relayd could have prevented.
    """
    async with asyncio.timeout(5.0):
        await world.emulator.wait_until(_sink_quiet)


async def expire(world: World, *, backoffs: bool) -> int:
    """End every lease (and every backoff too, if asked) in SQL; how many rows moved."""
    status: str = await world.conn.execute(_EXPIRE, backoffs)
    return int(status.rsplit(" ", 1)[-1])


async def pending(world: World) -> int:
    value: int = await world.conn.fetchval(_PENDING)
    return value


async def dead_letters(world: World) -> list[str]:
    return [r["event_id"] for r in await world.conn.fetch(_DEAD)]


async def taken_over(world: World, claim: Claim) -> list[str]:
    """The rows of `claim` whose lease is no longer its owner's: expired and claimed by
    someone else since, or settled by someone else."""
    ids = [row.event_id for row in claim.rows]
    records = await world.conn.fetch(_LEASES, ids)
    return sorted(r["event_id"] for r in records if r["lease_owner"] != claim.owner)


async def snapshot(world: World, ids: Sequence[str]) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await world.conn.fetch(_SNAPSHOT, list(ids))]


async def redrive(store: Store, ids: list[str] | None) -> ActionSummary:
    """`relayd dlq retry ID...` (ids) or `relayd dlq retry --all` (None), as the CLI runs it:
    the walk ends at the database's now, audited."""
    filters = DeadLetterFilter()
    selection = Selection(ids, filters, walk_end(filters, await store.operator_now()))
    audit = AuditEntry(actor="model", action=DlqAction.REDRIVE.value, keep_all_ids=ids is not None)
    return await act(store, DlqRequest(DlqAction.REDRIVE, selection, audit))
