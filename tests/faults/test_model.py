"""A property-based model of the relay: Hypothesis drives random sequences of inserts, relay
cycles, sink faults, crashes, lease expiries, dead-letter redrives and late settles by old
owners against real PostgreSQL and the in-process OJS emulator (overwrite mode, so that a
second creation of a job shows as an overwrite), and the history checker
(tests/faults/checker.py) judges the outbox, the sink's ledger and every row transition
after each step.

After every step (`@invariant`): no stale-token transition (C3), nothing falsely published
(C2), nothing created twice or overwritten on the sink (C2), nothing on the sink the outbox
never had. Rows are legitimately pending mid-run, so loss (C1) is judged at teardown, once
the faults are cleared, every lease and backoff has been ended in SQL and the relays have
drained the outbox: then the whole report must be clean.

Isolation: the test function gets its own database cloned from the migrated template, and
each example starts from TRUNCATE of the outbox, the history, the audit trail and the pauses,
with a fresh emulator and fresh relays (pools, breakers, sink sessions). A database per
example would cost a CREATE DATABASE (a copy of the template and a checkpoint) and a DROP
each time, most of the time budget under a concurrent test run; TRUNCATE costs milliseconds,
keeps the schema and the history triggers, and leaves nothing of the previous example since
its connections are closed.

Hypothesis state machines are synchronous: each example owns an event loop on which every
step runs (`loop.run_until_complete`), closed in teardown. The test functions are plain
`def`s so that pytest-asyncio (asyncio_mode = auto) leaves them alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, ClassVar, TypeVar

import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from relayd.engine.claim import Claim
from relayd.store.records import RowOutcome
from tests.faults.checker import Report, assert_clean, check
from tests.faults.model_support import (
    BATCH_SIZE,
    ENVELOPE_KINDS,
    FAULT_KINDS,
    STEP_TIMEOUT_S,
    EnvelopeKind,
    FaultKind,
    World,
    dead_letters,
    expire,
    fault_rule,
    insert,
    open_world,
    pending,
    prepare_database,
    redrive,
    sink_settled,
    snapshot,
    taken_over,
)
from tests.support import PgServer

_T = TypeVar("_T")

# Teardown's drain: at most this many relay cycles (each claims up to BATCH_SIZE rows).
_DRAIN_CYCLES = 200
# How often a crash mid-publish looks whether its POST has reached the sink.
_POLL_S = 0.005

_RELAYS = st.sampled_from((0, 1))
_PICK = st.integers(min_value=0, max_value=2**16)


class RelayModel(RuleBasedStateMachine):
    """The relay's contract as a state machine; see the module docstring."""

    dsn: ClassVar[str] = ""
    # The late-settle rule also compares the rows before and after itself. The negative
    # controls turn it off, to show that the checker's invariants alone catch a broken fence.
    check_late_settle_directly: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # False while a step runs: a step that raised leaves it so, and teardown then only
        # releases the world (the step's own failure is what Hypothesis reports).
        self.healthy = True
        self.inserted = 0
        # Claims whose relay "crashed": their rows stay leased until the model expires them.
        self.abandoned: list[tuple[int, Claim]] = []
        try:
            self.world: World = self.loop.run_until_complete(open_world(self.dsn))
        except BaseException:
            _close_loop(self.loop)
            raise

    def run(self, step: Coroutine[Any, Any, _T]) -> _T:
        self.healthy = False
        result = self.loop.run_until_complete(_bounded(step))
        self.healthy = True
        return result

    # --- rules -------------------------------------------------------------------------

    @rule(kinds=st.lists(st.sampled_from(ENVELOPE_KINDS), min_size=1, max_size=10))
    def insert_rows(self, kinds: list[EnvelopeKind]) -> None:
        """A producer commits 1-10 rows, some of them poison (C6)."""
        self.inserted += len(self.run(insert(self.world, kinds, self.inserted)))

    @rule(relay=_RELAYS)
    def relay_cycle(self, relay: int) -> None:
        """One claim -> publish -> settle of one relay."""
        self.run(self._cycle(relay))

    @rule()
    def both_relays_cycle(self) -> None:
        """Both relays cycle at once: their claims must not overlap (SKIP LOCKED)."""
        self.run(self._both_cycle())

    @rule(
        kind=st.sampled_from(FAULT_KINDS),
        method=st.sampled_from(("POST", "*")),
        times=st.integers(min_value=1, max_value=3),
    )
    def sink_fault(self, kind: FaultKind, method: str, times: int) -> None:
        """The sink misbehaves for its next `times` job requests (POSTs, or GETs too)."""
        self.world.emulator.add_fault(fault_rule(kind, method, times))

    @rule(backoffs=st.booleans())
    def expire_leases(self, backoffs: bool) -> None:
        """Time passes (in SQL): every lease ends, and every backoff too if `backoffs`."""
        self.run(expire(self.world, backoffs=backoffs))

    @rule(relay=_RELAYS, limit=st.integers(min_value=1, max_value=BATCH_SIZE))
    def crash_after_claim(self, relay: int, limit: int) -> None:
        """A relay claims, then dies before it publishes or settles anything."""
        claim = self.run(self.world.relays[relay].claim(limit))
        if claim.rows:
            self.abandoned.append((relay, claim))

    @rule(relay=_RELAYS, kind=st.sampled_from(("latency", "store_then_delay")))
    def crash_mid_publish(self, relay: int, kind: FaultKind) -> None:
        """A relay dies while its POST is at the sink (which stores the job before or
        after the relay is gone), or after publishing, before it settles."""
        self.run(self._crash_mid_publish(relay, kind))

    @rule(everything=st.booleans(), pick=_PICK)
    def redrive_dead_letters(self, everything: bool, pick: int) -> None:
        """An operator redrives one dead letter, or all of them (`relayd dlq retry`)."""
        self.run(self._redrive(everything, pick))

    @precondition(lambda self: bool(self.abandoned))
    @rule(pick=_PICK)
    def late_settle_by_an_old_owner(self, pick: int) -> None:
        """A relay that crashed (or stalled) comes back and settles its old claim as
        published, after other owners took its rows over: it must change nothing (C3)."""
        relay, claim = self.abandoned[pick % len(self.abandoned)]
        self.run(self._late_settle(relay, claim))

    # --- invariants and teardown ---------------------------------------------------------

    @invariant()
    def contract_holds(self) -> None:
        """Nothing but loss is allowed mid-run: pending rows are not lost yet."""
        report = self.run(self._check())
        breaches = {
            "stale token": report.stale_token,
            "falsely published": report.falsely_published,
            "duplicated": report.duplicated,
            "unexpected": report.unexpected,
        }
        found = {kind: sorted(ids) for kind, ids in breaches.items() if ids}
        assert not found, f"contract breached mid-run: {found}\n{report.format()}"

    def teardown(self) -> None:
        try:
            if self.healthy:
                self.run(self._drain_and_check())
        finally:
            try:
                self.loop.run_until_complete(self.world.close())
            finally:
                _close_loop(self.loop)

    # --- the steps' coroutines -----------------------------------------------------------

    async def _check(self) -> Report:
        return await check(self.world.conn, self.world.emulator.ledger_json())

    async def _cycle(self, relay: int) -> None:
        await self.world.relays[relay].step()
        await sink_settled(self.world)

    async def _both_cycle(self) -> None:
        async with asyncio.TaskGroup() as both:
            for relay in self.world.relays:
                both.create_task(relay.step())
        await sink_settled(self.world)

    async def _crash_mid_publish(self, index: int, kind: FaultKind) -> None:
        relay, emulator = self.world.relays[index], self.world.emulator
        # The sink holds the next POST past the moment the relay dies (it is not a fault
        # of the next request after that: the rule fires once, here, or stays armed).
        rule_id = emulator.add_fault(fault_rule(kind, "POST"))
        claim = await relay.claim(BATCH_SIZE)
        if not claim.rows:
            return
        self.abandoned.append((index, claim))
        publishing = asyncio.ensure_future(relay.worker.publish(claim))
        # The emulator wakes its waiters only once a request is answered: poll instead.
        while not publishing.done() and emulator.fault_fired(rule_id) == 0:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        if publishing.done():
            publishing.result()  # published (or failed) before settling: dies there instead
        else:
            publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publishing
        await sink_settled(self.world)

    async def _redrive(self, everything: bool, pick: int) -> None:
        dead = await dead_letters(self.world)
        if not dead:
            return
        ids = None if everything else [dead[pick % len(dead)]]
        summary = await redrive(self.world.relays[pick % 2].store, ids)
        assert summary.counts[RowOutcome.REDRIVEN] == (len(dead) if ids is None else 1), (
            summary.as_json()
        )

    async def _late_settle(self, relay: int, claim: Claim) -> None:
        taken = await taken_over(self.world, claim)
        if not taken:
            return  # its lease still stands (expired or not): a settle would be legitimate
        before = await snapshot(self.world, taken)
        await self.world.relays[relay].late_settle(claim, taken)
        if self.check_late_settle_directly:
            after = await snapshot(self.world, taken)
            assert after == before, (
                f"a late settle by old owner {claim.owner} changed rows it no longer held "
                f"(C3):\nbefore {before}\nafter  {after}"
            )

    async def _drain_and_check(self) -> None:
        """Heal everything, drain the outbox, and require a clean report."""
        self.world.emulator.clear_faults()
        for cycle in range(_DRAIN_CYCLES):
            if await pending(self.world) == 0:
                break
            await expire(self.world, backoffs=True)
            await self._cycle(cycle % 2)
        assert_clean(await self._check())


async def _bounded(step: Coroutine[Any, Any, _T]) -> _T:
    async with asyncio.timeout(STEP_TIMEOUT_S):
        return await step


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the loop (nothing, after a clean step), then close it."""
    try:
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


def _bound(dsn: str, *, check_late_settle_directly: bool = True) -> type[RelayModel]:
    """The model bound to one test's database."""

    class BoundRelayModel(RelayModel):
        pass

    BoundRelayModel.dsn = dsn
    BoundRelayModel.check_late_settle_directly = check_late_settle_directly
    return BoundRelayModel


# Deterministic (derandomize: the same sequence of examples on every run), no example
# database (nothing written under .hypothesis/), no deadline (a step waits for a real
# database and, under a `latency` fault, for a sink answer later than the attempt deadline).
MODEL_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=20,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture
def model_dsn(pg_server: PgServer) -> Iterator[str]:
    """A database of its own, cloned from the migrated template, with the history installed;
    dropped afterwards. Sync (the test is a plain def): its statements run on their own loop."""
    name = f"relayd_model_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        admin = await asyncpg.connect(pg_server.admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_server.template}"')
        finally:
            await admin.close()
        await prepare_database(pg_server.dsn(name))

    async def drop() -> None:
        admin = await asyncpg.connect(pg_server.admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    asyncio.run(create())
    try:
        yield pg_server.dsn(name)
    finally:
        asyncio.run(drop())


@pytest.mark.slow
def test_the_relay_keeps_its_contract_under_random_faults(model_dsn: str) -> None:
    """C1, C2, C3, C6, C7 over random histories of two relays, faults, crashes and redrives."""
    run_state_machine_as_test(_bound(model_dsn), settings=MODEL_SETTINGS)
