"""`relayd check` says, one line per check, why a relay could not run here; `relayd doctor`
names what holds the outbox back inside PostgreSQL."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from relayd.store.migrations import load_migrations
from relayd.testing.emulator import EmulatorConfig, RunningEmulator, start_emulator
from relayd.testing.processes import free_port
from tests.support import Database, dsn_as, produce, run_relayd

TOKEN = "check-token-value"  # noqa: S105 - a test value, not a credential


def _verdicts(stdout: str) -> dict[str, tuple[str, str]]:
    """check's lines as {name: (verdict, detail)}; the last line of a name wins."""
    found: dict[str, tuple[str, str]] = {}
    for line in stdout.splitlines():
        verdict, name, detail = line[:8].strip(), line[8:20].strip(), line[20:]
        found[name] = (verdict, detail)
    return found


def _env(cli_env: dict[str, str], dsn: str, sink_url: str, **extra: str) -> dict[str, str]:
    return cli_env | {"RELAYD_DATABASE__DSN": dsn, "RELAYD_SINK__URL": sink_url} | extra


async def test_check_passes_on_a_ready_outbox(
    cli_env: dict[str, str], database: Database, emulator: RunningEmulator
) -> None:
    """Every check passes against a migrated outbox and a reachable sink: exit 0, one line
    each, in order; --json gives the same verdicts."""
    code, out, err = await run_relayd("check", env=_env(cli_env, database.dsn, emulator.url))
    assert code == 0, out + err
    verdicts = _verdicts(out)
    assert list(verdicts) == [
        "config",
        "database",
        "schema",
        "privileges",
        "listen",
        "sink",
        "clock",
        "recovery",
    ]
    assert {verdict for verdict, _ in verdicts.values()} <= {"ok", "warn"}
    latest = len(load_migrations())
    assert f"relayd.outbox is migrated (version {latest:04d})" in verdicts["schema"][1]
    code, out, _ = await run_relayd(
        "check", "--json", env=_env(cli_env, database.dsn, emulator.url)
    )
    assert code == 0
    assert [line["name"] for line in json.loads(out)] == list(verdicts)


async def test_check_says_how_a_crashed_relays_claims_are_recovered(
    cli_env: dict[str, str], database: Database, emulator: RunningEmulator, tmp_path: Path
) -> None:
    """The `recovery` line: at once with a runtime directory (the setting, or systemd's
    $RUNTIME_DIRECTORY), after a whole lease without one."""
    env = _env(cli_env, database.dsn, emulator.url)
    _, out, _ = await run_relayd("check", env=env)
    assert _verdicts(out)["recovery"] == (
        "ok",
        "no proof of life (no runtime directory (relay.runtime_dir, or systemd's "
        "RuntimeDirectory=)): a crashed relay's claims wait out relay.lease_s (30s)",
    )
    for where in ("RELAYD_RELAY__RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        _, out, _ = await run_relayd("check", env=env | {where: str(tmp_path)})
        assert _verdicts(out)["recovery"] == (
            "ok",
            f"proof of life in {tmp_path}: a relay restarted after a crash takes its "
            "predecessor's claims back at once",
        )


async def test_check_names_a_database_that_refuses_us(
    cli_env: dict[str, str], database: Database, emulator: RunningEmulator
) -> None:
    """A wrong DSN (no such database): the database line fails naming it; exit 1."""
    dsn = database.dsn.replace(database.name, "no_such_database")
    code, out, _ = await run_relayd("check", env=_env(cli_env, dsn, emulator.url))
    assert code == 1
    verdict, detail = _verdicts(out)["database"]
    assert verdict == "fail"
    assert 'database "no_such_database" does not exist' in detail
    assert _verdicts(out)["schema"][0] == "skipped"
    assert _verdicts(out)["sink"][0] == "ok"  # still checked: it does not need the database


async def test_check_names_a_missing_schema(
    cli_env: dict[str, str], empty_database: Database, emulator: RunningEmulator
) -> None:
    """No outbox table: the schema line says to run `relayd migrate`; exit 1."""
    code, out, _ = await run_relayd("check", env=_env(cli_env, empty_database.dsn, emulator.url))
    assert code == 1
    assert _verdicts(out)["schema"] == (
        "fail",
        "outbox table relayd.outbox does not exist: run `relayd migrate`",
    )
    assert _verdicts(out)["privileges"][0] == "skipped"


async def test_check_and_run_name_a_migration_still_to_apply(
    cli_env: dict[str, str], database: Database, conn: asyncpg.Connection, emulator: RunningEmulator
) -> None:
    """An outbox one migration behind this relayd: check fails the schema line, and
    `relayd run` refuses to start (exit 1) instead of failing at its first claim."""
    await conn.execute("DELETE FROM relayd.relayd_migrations WHERE version = 3")
    env = _env(cli_env, database.dsn, emulator.url, RELAYD_HTTP__ENABLED="false")
    code, out, _ = await run_relayd("check", env=env)
    assert code == 1
    assert _verdicts(out)["schema"] == (
        "fail",
        "outbox table relayd.outbox lacks migration 0003: run `relayd migrate`",
    )
    code, _, err = await run_relayd("run", env=env)
    assert code == 1
    assert err.splitlines()[-1] == (
        "relayd: outbox table relayd.outbox lacks migration 0003: run `relayd migrate`"
    )


@pytest.fixture
async def limited_role(database: Database) -> AsyncIterator[str]:
    """A login role that may read the outbox but not update it (roles are cluster-wide)."""
    role = f"relayd_check_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(database.dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute(f"GRANT USAGE ON SCHEMA relayd TO {role}")
        await admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA relayd TO {role}")
        yield role
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
    finally:
        await admin.close()


async def test_check_names_a_missing_privilege(
    cli_env: dict[str, str],
    database: Database,
    limited_role: str,
    emulator: RunningEmulator,
) -> None:
    """A role without UPDATE on the outbox: the privileges line names each one missing."""
    dsn = re.sub(r"://[^:@/]+", f"://{limited_role}", database.dsn, count=1)
    code, out, _ = await run_relayd("check", env=_env(cli_env, dsn, emulator.url))
    assert code == 1
    verdict, detail = _verdicts(out)["privileges"]
    assert verdict == "fail"
    assert "UPDATE on table relayd.outbox" in detail
    assert "SELECT on table relayd.outbox" not in detail


async def test_check_names_an_unreachable_sink(cli_env: dict[str, str], database: Database) -> None:
    """Nothing listens at sink.url: the sink line fails, saying it cannot connect."""
    url = f"http://127.0.0.1:{free_port()}"
    code, out, _ = await run_relayd("check", env=_env(cli_env, database.dsn, url))
    assert code == 1
    verdict, detail = _verdicts(out)["sink"]
    assert verdict == "fail"
    assert detail.startswith(f"{url}: unreachable: cannot connect")


async def test_check_names_a_wrong_sink_token(
    cli_env: dict[str, str], database: Database, tmp_path: Path
) -> None:
    """A token the sink refuses: the sink line says so (and never prints the token)."""
    token_file = tmp_path / "token"
    token_file.write_text("wrong-" + TOKEN)
    async with await start_emulator(EmulatorConfig(auth_token=TOKEN)) as sink:
        env = _env(cli_env, database.dsn, sink.url, RELAYD_SINK__TOKEN_FILE=str(token_file))
        code, out, err = await run_relayd("check", env=env)
    assert code == 1
    assert _verdicts(out)["sink"] == (
        "fail",
        f"{sink.url}: HTTP 403: not authorised (check sink.token_file)",
    )
    assert TOKEN not in out + err


async def test_doctor_names_a_session_holding_back_the_horizon(
    cli_env: dict[str, str], database: Database, emulator: RunningEmulator
) -> None:
    """A forgotten repeatable-read transaction is named (pid, user, application name) as
    holding back the xmin horizon; the claim is reported reading its index; --json carries
    the claim's plan as JSON."""
    holder = await asyncpg.connect(
        database.dsn, server_settings={"application_name": "forgotten-report"}
    )
    try:
        transaction = holder.transaction(isolation="repeatable_read")
        await transaction.start()
        await holder.fetchval("SELECT count(*) FROM relayd.outbox")  # takes the snapshot
        env = _env(cli_env, database.dsn, emulator.url)
        code, out, err = await run_relayd("doctor", env=env)
        json_code, as_json, _ = await run_relayd("doctor", "--json", env=env)
        await transaction.rollback()
    finally:
        await holder.close()
    assert code == 0, out + err
    assert re.search(r"session\s+pid \d+ \w+@\w+ \(forgotten-report, idle in transaction\)", out)
    assert "the claim reads its index outbox_relayd_claim" in out
    assert json_code == 0
    diagnosis = json.loads(as_json)
    assert any(h["application_name"] == "forgotten-report" for h in diagnosis["horizon"])
    assert {f["topic"] for f in diagnosis["findings"]} >= {"vacuum", "horizon", "claim", "size"}
    # The plan is PostgreSQL's EXPLAIN document as JSON, not a string holding it.
    assert diagnosis["claim_plan"][0]["Plan"]["Node Type"]


async def test_check_warns_when_writers_are_hidden_from_the_role(
    cli_env: dict[str, str], database: Database, relay_role: str, emulator: RunningEmulator
) -> None:
    """A role with every privilege relayd run needs but not pg_read_all_stats passes, with a
    warning: without it the claims cannot use their watermark (exit 0)."""
    dsn = dsn_as(database.dsn, relay_role)
    code, out, _ = await run_relayd("check", env=_env(cli_env, dsn, emulator.url))
    assert code == 0
    verdict, detail = _verdicts(out)["privileges"]
    assert verdict == "warn"
    assert "but not pg_read_all_stats" in detail


async def test_doctor_shows_the_claim_reading_its_index_once_analysed(
    cli_env: dict[str, str], database: Database, emulator: RunningEmulator, conn: asyncpg.Connection
) -> None:
    """Once the table is analysed, the claim a relay runs (unordered rows and keys' heads)
    reads its index (exit 0). What doctor says of a plan the planner only guessed, on a
    table never analysed, is tested on the plans themselves (tests/unit/operator)."""
    await conn.execute("ALTER TABLE relayd.outbox SET (autovacuum_enabled = false)")
    await produce(conn, 300)
    await conn.execute("ANALYZE relayd.outbox")
    code, out, err = await run_relayd("doctor", env=_env(cli_env, database.dsn, emulator.url))
    assert code == 0, out + err
    assert _verdicts(out)["claim"] == ("ok", "the claim reads its index outbox_relayd_claim")
