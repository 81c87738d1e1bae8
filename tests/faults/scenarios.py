"""The fault scenarios that a negative control (tests/faults/test_mutants.py) runs again
against a deliberately broken relay: each one's steps live here, its test (named in each
docstring) runs them against a clean relay, so no test module imports another."""

from __future__ import annotations

import json
import signal
from datetime import UTC, datetime

from tests.faults.harness import Scene
from tests.support import TcpProxy
from tests.tools import library

# A sink that silently overwrites a reused id: a second POST of a published row shows in its
# ledger as an overwrite, which the checker reports as a duplicate.
OVERWRITE = ("--duplicate-mode", "overwrite")
# Debian's libfaketime (package faketime); other layouts put it elsewhere under /usr/lib.
_LIBRARIES = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


async def kill_9_at_a_step(scene: Scene, point: str) -> None:
    """test_relay_crashes.py::test_kill_9_at_a_step_of_the_cycle."""
    await scene.start_sink(*OVERWRITE)
    await scene.produce(80)
    doomed = await scene.relay("doomed", failpoints=f"{point}=exit@2", ready=False)
    assert await doomed.wait() == -signal.SIGKILL
    await scene.expire_leases()
    await scene.relay("heir")
    await scene.drained()
    await scene.check()


async def sigstop_past_the_lease(scene: Scene, point: str) -> None:
    """test_relay_crashes.py::test_sigstop_past_the_lease_then_sigcont."""
    await scene.start_sink(*OVERWRITE)
    ids = await scene.produce(30)
    # Not waited on for /healthz: the rows are there already, and a relay that stops itself
    # before its HTTP listener first answers would never answer.
    frozen = await scene.relay(
        "frozen", failpoints=f"{point}=pause@1", ready=False, RELAYD_RELAY__WORKERS="1"
    )
    await frozen.fired(point)
    assert frozen.stopped()
    # The lease runs out in real time (3 s): the frozen relay's own clock must see it too.
    await scene.relay("heir")
    await scene.drained()
    frozen.signal(signal.SIGCONT)
    assert await frozen.stop() == 0  # it finishes its cycle first: the late settle
    assert await scene.published() == len(ids)
    await scene.check()
    assert "relay.stale_settle" in frozen.log()


async def a_different_job_under_our_id(scene: Scene, batch: str) -> None:
    """test_sink_faults.py::test_409_with_a_different_job."""
    await scene.start_sink()  # the conformance behaviour: a reused id is a 409
    ids = await scene.produce(10)
    taken = ids[3]
    row = await scene.conn.fetchrow(f"SELECT job FROM {scene.sql_table} WHERE event_id = $1", taken)
    assert row is not None
    theirs = json.loads(row["job"]) | {"args": [{"someone": "else"}]}
    assert scene.sink is not None
    async with scene.http.post(
        f"{scene.sink.url}/ojs/v1/jobs",
        data=json.dumps(theirs),
        headers={"Content-Type": "application/openjobspec+json"},
    ) as answer:
        assert answer.status == 201
    await scene.relay("relay", RELAYD_SINK__BATCH=batch)
    await scene.drained()
    await scene.check()
    assert await scene.dead() == {taken: "conflict"}
    assert await scene.published() == len(ids) - 1


async def a_wall_clock_off(scene: Scene, shift_s: int) -> None:
    """test_clock.py::test_a_relay_whose_wall_clock_is_an_hour_off."""
    shifted_env = {
        "LD_PRELOAD": library("libfaketime", "faketime", _LIBRARIES),
        "FAKETIME": f"{shift_s:+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    await scene.start_sink(*OVERWRITE)
    await scene.produce(60)
    shifted = await scene.relay(
        "shifted",
        failpoints="after_claim=exit@2",
        ready=False,
        env=shifted_env,
        RELAYD_RELAY__WORKERS="1",
    )
    assert await shifted.wait() == -signal.SIGKILL
    # Its clock really was off: its log's timestamps are.
    stamp = next(
        json.loads(line)["timestamp"]
        for line in shifted.log().splitlines()
        if line.startswith("{") and '"timestamp"' in line
    )
    skew_s = (datetime.fromisoformat(stamp) - datetime.now(UTC)).total_seconds()
    assert abs(skew_s - shift_s) < 120, f"the relay's clock was {skew_s:+.0f} s off"
    held = await scene.conn.fetchval(
        f"SELECT count(*) FROM {scene.sql_table} "
        "WHERE lease_owner IS NOT NULL AND published_at IS NULL"
    )
    assert held > 0, "the shifted relay held nothing when it died"
    await scene.relay("heir")
    await scene.drained(timeout_s=20)
    assert await scene.dead() == {}
    await scene.check()


async def rows_failed_together_retried_apart(scene: Scene) -> None:
    """test_retries.py::test_rows_failed_together_are_retried_apart."""
    rows = 20
    sink = await scene.start_sink(*OVERWRITE)
    await sink.faults(
        {"action": "status", "status": 503, "path_prefix": "/ojs/v1/jobs", "times": None}
    )
    await scene.produce(rows)
    relay = await scene.relay(
        "relay", RELAYD_RELAY__WORKERS="1", RELAYD_RETRY__BASE_S="5", RELAYD_RETRY__CAP_S="5"
    )
    retried = f"""SELECT count(*) FROM {scene.sql_table}
                  WHERE last_error IS NOT NULL AND lease_owner IS NULL"""
    await scene.until(f"SELECT ({retried}) = {rows}")
    spread_s = await scene.conn.fetchval(
        "SELECT extract(epoch FROM max(available_at) - min(available_at))::float8 "
        f"FROM {scene.sql_table} WHERE last_error IS NOT NULL"
    )
    # Full jitter draws 20 delays over 0-5 s: all of them within one second of each other
    # has odds of about 1 in 10^12. Without jitter they differ only by the microseconds
    # between the rows' clock readings in one statement.
    assert spread_s > 1.0, f"{rows} rows retried within {spread_s:.3f} s, not at distinct times"
    assert await scene.dead() == {}
    await sink.clear_faults()
    # End the backoffs by hand (the checker's rule 4): only rows not yet due, since moving
    # an already due row's available_at forward is no change a relay or operator makes.
    await scene.conn.execute(
        f"UPDATE {scene.sql_table} SET available_at = now() "
        "WHERE published_at IS NULL AND dead_at IS NULL AND available_at > now()"
    )
    await scene.drained()
    assert await relay.stop() == 0
    await scene.check()


async def leases(scene: Scene) -> dict[str, str]:
    """The running leases: event id -> owner token."""
    rows = await scene.conn.fetch(
        f"SELECT event_id::text, lease_owner::text FROM {scene.sql_table} "
        "WHERE lease_owner IS NOT NULL AND published_at IS NULL AND dead_at IS NULL "
        "AND available_at > now()"
    )
    return {row["event_id"]: row["lease_owner"] for row in rows}


async def alive_but_cut_off(scene: Scene) -> None:
    """test_relay_recovery.py::test_a_live_relay_cut_off_from_the_database_keeps_its_claims.

    1. Relay A (runtime directory D, a 10 s lease) claims 20 rows, sends them, and holds them
    before its settle; 2. its every database connection is cut, and new ones refused, while
    it lives on; 3. relay B starts on D (A holds slot 0: B takes slot 1) and takes back only
    its own slot's leases: A's stay A's until their lease ends; 4. A's path comes back; B
    takes A's rows once their lease ended, and reconciles them: nothing created twice."""
    await scene.start_sink(*OVERWRITE)
    runtime = scene.base / "run"
    runtime.mkdir()
    path = TcpProxy.for_dsn(scene.dsn)
    await path.start()
    try:
        ids = await scene.produce(20)
        # 1.
        alive = await scene.relay(
            "alive",
            failpoints="before_settle=delay:4",
            RELAYD_RELAY__RUNTIME_DIR=str(runtime),
            RELAYD_RELAY__LEASE_S="10",
            RELAYD_RELAY__WORKERS="1",
            RELAYD_DATABASE__DSN=path.dsn_through(scene.dsn),
        )
        await alive.fired("before_settle")
        held = await leases(scene)
        assert len(held) == len(ids)
        # 2.
        await path.cut()
        # 3.
        starter = await scene.relay(
            "starter", RELAYD_RELAY__RUNTIME_DIR=str(runtime), RELAYD_RELAY__LEASE_S="10"
        )
        await starter.logged('"daemon.started"')
        assert '"slot": 1' in starter.log()
        taken = {i for i, owner in held.items() if (await leases(scene)).get(i) != owner}
        assert not taken, f"claims of a live relay taken from it ({len(taken)})"
        assert alive.returncode is None
        # 4.
        await path.restore()
        await scene.drained()
        await scene.check()
    finally:
        await path.close()
