"""Retries after a sink-wide failure: spread by jitter (C5), attempts refunded, nothing
dead-lettered, everything published once when the sink is back."""

from __future__ import annotations

from tests.faults.harness import Scene

ROWS = 20


async def test_rows_failed_together_are_retried_apart(scene: Scene) -> None:
    """One batch of 20 rows meets a 503: each row's next attempt is drawn on its own (full
    jitter over 0-5 s), so they do not come back as one herd."""
    sink = await scene.start_sink("--duplicate-mode", "overwrite")
    await sink.faults(
        {"action": "status", "status": 503, "path_prefix": "/ojs/v1/jobs", "times": None}
    )
    await scene.produce(ROWS)
    relay = await scene.relay(
        "relay", RELAYD_RELAY__WORKERS="1", RELAYD_RETRY__BASE_S="5", RELAYD_RETRY__CAP_S="5"
    )
    retried = f"""SELECT count(*) FROM {scene.sql_table}
                  WHERE last_error IS NOT NULL AND lease_owner IS NULL"""
    await scene.until(f"SELECT ({retried}) = {ROWS}")
    spread_s = await scene.conn.fetchval(
        "SELECT extract(epoch FROM max(available_at) - min(available_at))::float8 "
        f"FROM {scene.sql_table} WHERE last_error IS NOT NULL"
    )
    # Full jitter draws 20 delays over 0-5 s: all of them within one second of each other
    # has odds of about 1 in 10^12. Without jitter they differ only by the microseconds
    # between the rows' clock readings in one statement.
    assert spread_s > 1.0, f"{ROWS} rows retried within {spread_s:.3f} s, not at distinct times"
    assert await scene.dead() == {}
    await sink.clear_faults()
    await scene.conn.execute(
        f"UPDATE {scene.sql_table} SET available_at = now() "
        "WHERE published_at IS NULL AND dead_at IS NULL"
    )
    await scene.drained()
    assert await relay.stop() == 0
    await scene.check()
