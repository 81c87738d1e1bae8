"""Least privilege: roles holding exactly the grants `relayd grants` prints run everything
they are for. The migrator (granted by a superuser) runs `relayd migrate` on an empty
database and, as the owner of what it created, runs the relay's and the operator's scripts;
`relayd run` then publishes, retries, dead-letters, pauses a poison storm, cleans up and
keeps its heartbeat as the relay role, and every operator command runs as the operator,
without access to the sink's secret files. `relayd check` fails, naming the privilege, for
each grant taken away."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from relayd.operator.check import CheckLine, Verdict, failed, run_checks
from relayd.settings import to_toml
from relayd.store.privileges import Kind, Privilege, Role, role_privileges
from relayd.testing.emulator import RunningEmulator
from relayd.testing.processes import free_port
from tests.faults.harness import Scene, await_ok
from tests.support import (
    DEFAULT_TABLE,
    Database,
    dsn_as,
    park_key,
    relay_settings,
    rows_in_every_state,
    run_relayd,
    start_relayd,
)


@dataclass(frozen=True)
class Roles:
    """Three login roles on one test database, each holding what its script grants."""

    database: Database
    names: dict[Role, str]

    def dsn(self, role: Role) -> str:
        return dsn_as(self.database.dsn, self.names[role])

    def env(self, cli_env: dict[str, str], role: Role, sink_url: str) -> dict[str, str]:
        return cli_env | {"RELAYD_DATABASE__DSN": self.dsn(role), "RELAYD_SINK__URL": sink_url}


async def _script(cli_env: dict[str, str], role: Role, to: str) -> str:
    """The output of `relayd grants --role ROLE --to TO`: what an operator copies."""
    code, out, err = await run_relayd("grants", "--role", role.value, "--to", to, env=cli_env)
    assert code == 0, err
    return out


@pytest.fixture
async def roles(cli_env: dict[str, str], empty_database: Database) -> AsyncIterator[Roles]:
    """An empty database migrated by a migrator role, with a relay and an operator role
    granted by the migrator's running their scripts verbatim; every role dropped after."""
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"lp_{role.value}_{suffix}" for role in Role}
    setup = Roles(empty_database, names)
    admin = await asyncpg.connect(empty_database.dsn)
    created: list[str] = []
    try:
        for name in names.values():
            await admin.execute(f'CREATE ROLE "{name}" LOGIN')
            created.append(name)
        await admin.execute(await _script(cli_env, Role.MIGRATOR, names[Role.MIGRATOR]))
        env = cli_env | {"RELAYD_DATABASE__DSN": setup.dsn(Role.MIGRATOR)}
        code, out, err = await run_relayd("migrate", env=env)
        assert code == 0, out + err
        owner = await asyncpg.connect(setup.dsn(Role.MIGRATOR))
        try:
            for role in (Role.RELAY, Role.OPERATOR):
                await owner.execute(await _script(cli_env, role, names[role]))
        finally:
            await owner.close()
        yield setup
    finally:
        for name in created:
            await admin.execute(f'DROP OWNED BY "{name}"')
            await admin.execute(f'DROP ROLE "{name}"')
        await admin.close()


async def test_the_migrator_role_migrates_and_owns_the_outbox(
    cli_env: dict[str, str], roles: Roles
) -> None:
    """Under exactly `relayd grants --role migrator` (the fixture's first migrate created
    everything): a second `relayd migrate` finds every migration applied, exit 0; the
    migrator owns the outbox and relayd's tables."""
    env = cli_env | {"RELAYD_DATABASE__DSN": roles.dsn(Role.MIGRATOR)}
    code, out, err = await run_relayd("migrate", "--json", env=env)
    assert code == 0, out + err
    assert json.loads(out)["applied"] == []
    admin = await asyncpg.connect(roles.database.dsn)
    try:
        owners = await admin.fetch(
            "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'relayd'"
        )
    finally:
        await admin.close()
    assert [row["tableowner"] for row in owners] == [roles.names[Role.MIGRATOR]]


async def test_the_relay_role_runs_relayd_run(
    cli_env: dict[str, str], roles: Roles, tmp_path: Path
) -> None:
    """Under exactly `relayd grants --role relay`: check passes (warning only without
    pg_read_all_stats); a relay publishes, retries a 503, dead-letters a 422, deletes what it
    published (cleanup), keeps its heartbeat, serves /v1/status, pauses a poison storm with
    its audit row, and stops cleanly, removing its heartbeat."""
    admin = await asyncpg.connect(roles.database.dsn)
    try:
        async with aiohttp.ClientSession() as http:
            scene = Scene(base=tmp_path, dsn=roles.dsn(Role.RELAY), conn=admin, http=http)
            try:
                await _relay_scenario(scene, roles, cli_env)
            finally:
                await scene.close()
    finally:
        await admin.close()


async def _relay_scenario(scene: Scene, roles: Roles, cli_env: dict[str, str]) -> None:
    sink = await scene.start_sink()
    # 1. check
    code, out, err = await run_relayd("check", env=roles.env(cli_env, Role.RELAY, sink.url))
    assert code == 0, out + err
    count = len(role_privileges(Role.RELAY, cleanup=True))
    assert f"warn    privileges  the {count} privileges of the relay role" in out, out
    # 2. publish, retry, dead-letter, cleanup, heartbeat
    ids = await scene.produce(20)
    retried, poison = ids[3], ids[7]
    await sink.faults(
        {"action": "status", "status": 503, "method": "POST", "job_id": retried},
        {"action": "status", "status": 422, "method": "POST", "job_id": poison, "times": None},
    )
    listen = f"127.0.0.1:{free_port()}"
    relay = await scene.relay(
        "relay",
        ready=False,  # it listens where this test says, not where the scene would
        RELAYD_HTTP__LISTEN=listen,
        RELAYD_SINK__BATCH="off",  # one job per POST: the faults name jobs
        RELAYD_RELAY__STORM_WINDOW="10",
        RELAYD_CLEANUP__ENABLED="true",
        RELAYD_CLEANUP__PUBLISHED_RETENTION_S="0",
        RELAYD_CLEANUP__INTERVAL_S="0.2",
    )
    await await_ok(scene.http, f"http://{listen}/healthz", relay)
    await scene.until(
        "SELECT count(*) = 1 AND bool_and(dead_reason = 'sink_unprocessable') "
        "FROM relayd.outbox"  # the others published, then deleted by cleanup
    )
    ledger = (await sink.ledger())["jobs"]
    assert all(ledger[i]["created"] == 1 for i in ids if i != poison)
    assert ledger[retried]["post_statuses"] == [503, 201]
    await scene.until("SELECT count(*) = 1 FROM relayd.relayd_instances")
    async with scene.http.get(f"http://{listen}/v1/status") as answer:
        assert answer.status == 200, await answer.text()
        assert len((await answer.json())["instances"]) == 1
    # 3. a poison storm: the relay writes its pause and the audit row
    await sink.faults({"action": "status", "status": 400, "method": "POST", "times": None})
    await scene.produce(30)
    await scene.until(
        "SELECT EXISTS (SELECT 1 FROM relayd.relayd_pauses WHERE reason LIKE 'poison storm%') "
        "AND EXISTS (SELECT 1 FROM relayd.relayd_audit WHERE action = 'pause')"
    )
    assert relay.returncode is None
    # 4. a clean stop removes the heartbeat
    assert await relay.stop() == 0
    assert await scene.conn.fetchval("SELECT count(*) FROM relayd.relayd_instances") == 0
    log = relay.log()
    for trouble in ("permission denied", "task_crashed", "pause_failed", "Traceback"):
        assert trouble not in log, log[-4000:]


async def test_the_operator_role_runs_every_operator_command(
    cli_env: dict[str, str], roles: Roles, emulator: RunningEmulator
) -> None:
    """Under exactly `relayd grants --role operator`: check --role operator, status (text
    and JSON), dlq list, show, retry (dry run, by id) and discard (in batches, the audit row
    extended), pause (new, then again, a queue and type), held list and discard (dry run,
    then in batches), resume, keys list, retry (dry run, then for real), skip and release:
    each exits 0; doctor runs every part."""
    admin = await asyncpg.connect(roles.database.dsn)
    try:
        ids = await rows_in_every_state(admin)
        for key in ("order-1", "order-2", "order-3"):
            await park_key(admin, key, 2)
    finally:
        await admin.close()
    env = roles.env(cli_env, Role.OPERATOR, emulator.url)
    [conflict, rejected] = ids["dead"]
    commands = [
        ("check", "--role", "operator"),
        ("status",),
        ("status", "--json"),
        ("dlq", "list"),
        ("dlq", "list", "--json", "--queue", "orders"),
        ("dlq", "show", conflict),
        ("dlq", "retry", "--all", "--dry-run"),
        ("dlq", "discard", "--all", "--batch-size", "1", "--reason", "least privilege"),
        ("dlq", "retry", rejected),
        ("pause", "--queue", "orders", "--reason", "a first reason"),
        ("pause", "--queue", "orders", "--reason", "a second reason"),
        ("pause", "--reason", "everything"),
        ("pause", "--queue", "mail", "--type", "mail.send", "--reason", "one type"),
        ("held", "list"),
        ("held", "list", "--json", "--queue", "mail", "--type", "mail.send"),
        ("held", "discard", "--all", "--type", "mail.send", "--dry-run", "--reason", "dry"),
        ("held", "discard", "--all", "--type", "mail.send", "--batch-size", "1", "--reason", "r"),
        ("resume", "--queue", "mail", "--type", "mail.send"),
        ("resume", "--queue", "orders"),
        ("resume",),
        ("keys", "list"),
        ("keys", "list", "--parked", "--json", "--route", "order.fulfill"),
        ("keys", "retry", "order-1", "--dry-run"),
        ("keys", "retry", "order-1", "--reason", "the sink is back"),
        ("keys", "skip", "order-2", "--reason", "least privilege"),
        ("keys", "release", "order-3", "--json"),
    ]
    for command in commands:
        code, out, err = await run_relayd(*command, env=env)
        assert (code, err) == (0, ""), f"relayd {' '.join(command)}: {out}{err}"
    # doctor's verdict on the claim's plan for a table this small is the planner's (it may
    # prefer a sequential scan and exit 1), not about privileges: every part ran.
    code, out, err = await run_relayd("doctor", "--json", env=env)
    assert (code in (0, 1), err) == (True, ""), out + err
    topics = {finding["topic"] for finding in json.loads(out)["findings"]}
    assert topics >= {"vacuum", "horizon", "claim", "size"}
    code, out, _ = await run_relayd("check", "--role", "operator", "--json", env=env)
    privileges = next(line for line in json.loads(out) if line["name"] == "privileges")
    assert privileges["verdict"] == "ok", privileges
    audit = await _audit(roles)
    assert audit == [
        ("dlq.discard", 2),
        ("dlq.retry", 1),
        ("pause", 1),
        ("pause", 1),
        ("pause", 1),
        ("pause", 1),
        ("held.discard", 2),
        ("resume", 1),
        ("resume", 1),
        ("resume", 1),
        ("keys.retry", 1),
        ("keys.skip", 1),
        ("keys.release", 1),
    ]


async def test_the_operator_role_serves_the_console(
    cli_env: dict[str, str], roles: Roles, emulator: RunningEmulator
) -> None:
    """Under exactly `relayd grants --role operator`, `relayd console` serves every page:
    the overview, the dead letters (filtered), one dead letter, an event, the pauses and the
    parked keys."""
    admin = await asyncpg.connect(roles.database.dsn)
    try:
        ids = await rows_in_every_state(admin)
        await park_key(admin, "order-9", 2)
    finally:
        await admin.close()
    port = free_port()
    env = roles.env(cli_env, Role.OPERATOR, emulator.url) | {
        "RELAYD_CONSOLE__LISTEN": f"127.0.0.1:{port}"
    }
    process = await start_relayd("console", env=env)
    assert process.stderr is not None
    try:
        async with asyncio.timeout(30):
            line = (await process.stderr.readline()).decode()
        assert "(read-only)" in line, line
        async with aiohttp.ClientSession() as http:
            for path in (
                "/",
                "/dead-letters?dead_reason=conflict&text=x",
                f"/dead-letters/{ids['dead'][0]}",
                f"/events/{ids['ready'][0]}",
                "/pauses",
                "/keys",
            ):
                async with http.get(f"http://127.0.0.1:{port}{path}") as response:
                    assert response.status == 200, (path, await response.text())
    finally:
        process.terminate()
        async with asyncio.timeout(30):
            await process.wait()


# Each kind's [sink] with every file it can read: credentials and a CA bundle.
_SINKS: dict[str, dict[str, object]] = {
    "ojs": {"url": "http://127.0.0.1:9", "token_file": "ojs-token"},
    "nats": {
        "servers": ["nats://127.0.0.1:9"],
        "stream": "EVENTS",
        "routes": [{"type": "order.fulfill", "subject": "events.orders"}],
        "creds_file": "nats.creds",
    },
    "webhook": {"url": "http://127.0.0.1:9/hooks", "secret_file": "webhook-secret"},
}
_FILE_KEYS = {"ojs": "token_file", "nats": "creds_file", "webhook": "secret_file"}
_ABSENT = "No such file or directory"


@pytest.mark.parametrize("kind", list(_SINKS))
async def test_the_operator_needs_no_access_to_the_sinks_secrets(
    cli_env: dict[str, str], roles: Roles, tmp_path: Path, kind: str
) -> None:
    """The relay's configuration, with its sink's credentials and CA bundle in files the
    operator cannot read (here: absent, which no reader gets past, even root): under the
    operator role, status, dlq, held, pause, resume, keys, doctor, grants and config show exit 0
    and say nothing about them; check and run, which talk to the sink, read them and exit 2
    naming the key."""
    secrets = tmp_path / "secrets-of-the-relay"  # never created
    sink = {
        key: str(secrets / str(value)) if key.endswith("_file") else value
        for key, value in _SINKS[kind].items()
    }
    sink |= {"kind": kind, "ca_file": str(secrets / "ca.pem")}
    config = tmp_path / "relayd.toml"
    config.write_text(to_toml({"outbox": {"table": "relayd.outbox"}, "sink": sink}))
    env = cli_env | {"RELAYD_CONFIG": str(config), "RELAYD_DATABASE__DSN": roles.dsn(Role.OPERATOR)}
    admin = await asyncpg.connect(roles.database.dsn)
    try:
        ids = await rows_in_every_state(admin)
    finally:
        await admin.close()
    for command in [
        ("status",),
        ("status", "--json"),
        ("dlq", "list"),
        ("dlq", "show", ids["dead"][0]),
        ("dlq", "retry", ids["dead"][0], "--reason", "the operator's"),
        ("pause", "--queue", "orders", "--reason", "maintenance"),
        ("held", "list"),
        ("held", "discard", "--all", "--dry-run", "--reason", "checked"),
        ("resume", "--queue", "orders"),
        ("keys", "list"),
        ("doctor", "--json"),
        ("grants", "--role", "operator"),
        ("config", "show"),
    ]:
        code, out, err = await run_relayd(*command, env=env)
        ok = (0, 1) if command[0] == "doctor" else (0,)  # the plan is the planner's
        assert (code in ok, err) == (True, ""), f"relayd {' '.join(command)}: {out}{err}"
    key = _FILE_KEYS[kind]
    for command in [("check",), ("run",)]:
        code, out, err = await run_relayd(*command, env=env)
        assert (code, out) == (2, ""), f"relayd {' '.join(command)}: {err}"
        assert err == f"relayd: config error: sink.{key}: cannot read {sink[key]}: {_ABSENT}\n"


async def _audit(roles: Roles) -> list[tuple[str, int]]:
    admin = await asyncpg.connect(roles.database.dsn)
    try:
        rows = await admin.fetch("SELECT action, row_count FROM relayd.relayd_audit ORDER BY id")
    finally:
        await admin.close()
    return [(row["action"], row["row_count"]) for row in rows]


@pytest.mark.parametrize("role", [Role.RELAY, Role.OPERATOR])
async def test_check_names_each_grant_taken_away(
    cli_env: dict[str, str], roles: Roles, emulator: RunningEmulator, role: Role
) -> None:
    """For each privilege of the role's list in turn: taken away (from PUBLIC too, which
    holds EXECUTE on functions by default), `relayd check --role` fails naming it; granted
    back, it passes again."""
    owner = await asyncpg.connect(roles.dsn(Role.MIGRATOR))
    try:
        for wanted in role_privileges(role, cleanup=True):
            grant = _grant(wanted, roles.names[role])
            await owner.execute(grant.replace("GRANT", "REVOKE", 1).replace(" TO ", " FROM "))
            if wanted.obj.kind is Kind.FUNCTION:
                await owner.execute(
                    f"REVOKE EXECUTE ON {wanted.obj.sql(DEFAULT_TABLE)} FROM PUBLIC"
                )
            lines = {line.name: line for line in await _check(roles, role, emulator.url)}
            assert lines["privileges"].verdict is Verdict.FAIL, (wanted, lines)
            assert wanted.display(DEFAULT_TABLE) in lines["privileges"].detail, (wanted, lines)
            await owner.execute(grant)
            assert not failed(await _check(roles, role, emulator.url)), wanted
    finally:
        await owner.close()
    # The command itself: exit 1, the privilege named on the privileges line.
    owner = await asyncpg.connect(roles.dsn(Role.MIGRATOR))
    try:
        await owner.execute(f'REVOKE INSERT ON relayd.relayd_pauses FROM "{roles.names[role]}"')
    finally:
        await owner.close()
    env = roles.env(cli_env, role, emulator.url)
    code, out, _ = await run_relayd("check", "--role", role.value, env=env)
    assert code == 1
    [line] = [line for line in out.splitlines() if line.startswith("fail")]
    assert "privileges" in line
    assert "INSERT on table relayd.relayd_pauses" in line


async def _check(roles: Roles, role: Role, sink_url: str) -> list[CheckLine]:
    """`relayd check --role ROLE`'s lines, run in this process (the same checks, faster)."""
    settings = relay_settings(roles.dsn(role), sink_url, cleanup={"enabled": True})
    return await run_checks(settings, "test", role)


def _grant(wanted: Privilege, to: str) -> str:
    return f'GRANT {wanted.privilege} ON {wanted.obj.sql(DEFAULT_TABLE)} TO "{to}"'
