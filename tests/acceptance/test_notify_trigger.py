"""`outbox.notify_trigger` as an operator uses it: `relayd migrate` creates or drops the
outbox's NOTIFY trigger to match, `relayd check` says when the two differ."""

from __future__ import annotations

import json

import asyncpg

from relayd.testing.emulator import RunningEmulator
from tests.support import Database, run_relayd


async def _trigger_state(dsn: str) -> str | None:
    conn = await asyncpg.connect(dsn)
    try:
        state: str | None = await conn.fetchval(
            "SELECT tgenabled::text FROM pg_trigger "
            "WHERE tgrelid = 'relayd.outbox'::regclass AND tgname = 'relayd_notify_insert'"
        )
        return state
    finally:
        await conn.close()


def _listen_line(stdout: str) -> tuple[str, str]:
    """`relayd check`'s listen line as (verdict, detail)."""
    [line] = [line for line in stdout.splitlines() if line[8:20].strip() == "listen"]
    return line[:8].strip(), line[20:]


async def test_migrate_creates_or_drops_the_notify_trigger_as_configured(
    cli_env: dict[str, str], database: Database
) -> None:
    """1. notify_trigger = false: `relayd migrate` drops the trigger and says so; again:
    nothing to do; 2. true: it creates it again; again: nothing to do; 3. a trigger disabled
    by hand is enabled again by a migrate with true."""
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}
    off = env | {"RELAYD_OUTBOX__NOTIFY_TRIGGER": "false"}
    # 1.
    code, out, err = await run_relayd("migrate", env=off)
    assert code == 0, err
    assert "relayd.outbox: NOTIFY trigger dropped (outbox.notify_trigger = false)" in out
    assert await _trigger_state(database.dsn) is None
    code, out, err = await run_relayd("migrate", "--json", env=off)
    assert code == 0, err
    report = json.loads(out)
    assert (report["notify_trigger"], report["notify_trigger_changed"]) == (False, False)
    assert await _trigger_state(database.dsn) is None
    # 2.
    code, out, err = await run_relayd("migrate", env=env)
    assert code == 0, err
    assert "relayd.outbox: NOTIFY trigger created (outbox.notify_trigger = true)" in out
    assert await _trigger_state(database.dsn) == "O"
    code, out, err = await run_relayd("migrate", "--json", env=env)
    assert code == 0, err
    report = json.loads(out)
    assert (report["notify_trigger"], report["notify_trigger_changed"]) == (True, False)
    # 3.
    conn = await asyncpg.connect(database.dsn)
    try:
        await conn.execute("ALTER TABLE relayd.outbox DISABLE TRIGGER relayd_notify_insert")
    finally:
        await conn.close()
    code, out, err = await run_relayd("migrate", "--json", env=env)
    assert code == 0, err
    assert json.loads(out)["notify_trigger_changed"] is True
    assert await _trigger_state(database.dsn) == "O"


async def test_check_warns_when_the_trigger_differs_from_the_setting(
    cli_env: dict[str, str], database: Database, emulator: RunningEmulator
) -> None:
    """`relayd check`'s listen line: a warning (exit 0) while the outbox's NOTIFY trigger is
    not what outbox.notify_trigger says, each way; ok once `relayd migrate` made them agree."""
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn, "RELAYD_SINK__URL": emulator.url}
    off = env | {"RELAYD_OUTBOX__NOTIFY_TRIGGER": "false"}
    code, out, err = await run_relayd("check", env=off)
    assert code == 0, out + err
    verdict, detail = _listen_line(out)
    assert verdict == "warn"
    assert "still has its NOTIFY trigger" in detail
    assert "cannot PREPARE TRANSACTION" in detail
    code, _, err = await run_relayd("migrate", env=off)
    assert code == 0, err
    code, out, err = await run_relayd("check", env=off)
    assert code == 0, out + err
    assert _listen_line(out) == (
        "ok",
        "not used (outbox.notify_trigger = false, no NOTIFY trigger): relays poll every 2s",
    )
    code, out, err = await run_relayd("check", env=env)
    assert code == 0, out + err
    verdict, detail = _listen_line(out)
    assert verdict == "warn"
    assert "relayd.outbox has no NOTIFY trigger that fires" in detail
    code, _, err = await run_relayd("migrate", env=env)
    assert code == 0, err
    code, out, err = await run_relayd("check", env=env)
    assert code == 0, out + err
    assert _listen_line(out) == (
        "ok",
        "LISTEN on channel relayd.outbox works; the NOTIFY trigger is in place",
    )
