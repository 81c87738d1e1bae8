"""A missing privilege is one line on stderr naming the privilege and the object, exit 1, in
every command that meets it (docs/run.md, exit codes): never a traceback."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

from relayd.store.privileges import Obj, Role, grant_script
from tests.support import DEFAULT_TABLE, Database, dsn_as, rows_in_every_state, run_relayd

# Make a login role holding `role`'s grants except one privilege on one object; its name.
MakeRole = Callable[[Role, Obj, str], Awaitable[str]]


@pytest.fixture
async def role_without(database: Database) -> AsyncIterator[MakeRole]:
    """Roles with one privilege of their list withheld (from PUBLIC too, for a function's
    EXECUTE); dropped after the test."""
    admin = await asyncpg.connect(database.dsn)
    made: list[str] = []

    async def make(role: Role, obj: Obj, privilege: str) -> str:
        name = f"pe_{role.value}_{uuid.uuid4().hex[:8]}"
        await admin.execute(f'CREATE ROLE "{name}" LOGIN')
        made.append(name)
        for grant in grant_script(role, DEFAULT_TABLE, name, cleanup=True).statements:
            await admin.execute(grant)
        target = obj.sql(DEFAULT_TABLE)
        await admin.execute(f'REVOKE {privilege} ON {target} FROM "{name}"')
        if obj is Obj.EFFECTIVE_QUEUE:
            await admin.execute(f"REVOKE EXECUTE ON {target} FROM PUBLIC")
        return name

    try:
        yield make
    finally:
        for name in made:
            await admin.execute(f'DROP OWNED BY "{name}"')
            await admin.execute(f'DROP ROLE "{name}"')
        await admin.close()


def _env(cli_env: dict[str, str], dsn: str) -> dict[str, str]:
    return cli_env | {
        "RELAYD_DATABASE__DSN": dsn,
        "RELAYD_SINK__URL": "http://127.0.0.1:9",
        "RELAYD_HTTP__ENABLED": "false",
        "RELAYD_LOG__FORMAT": "json",
    }


def _one_line(stderr: str) -> str:
    """The one line a command wrote on stderr besides its JSON log events."""
    assert "Traceback" not in stderr, stderr
    [line] = [text for text in stderr.splitlines() if not text.startswith("{")]
    return line


async def test_run_names_the_missing_privilege_at_start_up(
    cli_env: dict[str, str], database: Database, role_without: MakeRole
) -> None:
    """`relayd run` under a role without SELECT on the migration ledger: exit 1 at start-up,
    one line naming SELECT and relayd_migrations, and where to find the grants."""
    role = await role_without(Role.RELAY, Obj.MIGRATIONS, "SELECT")
    code, _out, err = await run_relayd("run", env=_env(cli_env, dsn_as(database.dsn, role)))
    assert code == 1
    assert _one_line(err) == (
        "relayd: migrations_applied: permission denied: needs SELECT on table "
        "relayd_migrations; `relayd grants --role relay` prints the grants for relayd run"
    )


@pytest.mark.parametrize(
    ("command", "obj", "privilege", "said"),
    [
        (("status",), Obj.INSTANCES, "SELECT", "needs SELECT on table relayd_instances"),
        (("status",), Obj.SCHEMA, "USAGE", "needs USAGE on schema relayd"),
        (
            ("pause", "--reason", "r"),
            Obj.PAUSES,
            "INSERT",
            "needs SELECT, INSERT and UPDATE on table relayd_pauses",
        ),
        (
            ("dlq", "list"),
            Obj.EFFECTIVE_QUEUE,
            "EXECUTE",
            "needs EXECUTE on function relayd_effective_queue",
        ),
        (
            ("dlq", "retry", "--all"),
            Obj.AUDIT_ID_SEQ,
            "USAGE",
            "needs USAGE on sequence relayd_audit_id_seq",
        ),
        (
            ("keys", "list"),
            Obj.PARKED_KEYS,
            "SELECT",
            "needs SELECT on table relayd_parked_keys",
        ),
        (
            ("keys", "retry", "order-1"),
            Obj.PARKED_KEYS,
            "DELETE",
            "needs SELECT and DELETE on table relayd_parked_keys",
        ),
    ],
)
async def test_operator_commands_name_the_missing_privilege(  # noqa: PLR0913 - the table's columns
    cli_env: dict[str, str],
    database: Database,
    role_without: MakeRole,
    command: tuple[str, ...],
    obj: Obj,
    privilege: str,
    said: str,
) -> None:
    """An operator command under a role missing one privilege: exit 1, stderr is one line
    naming the privileges the statement needs and the object."""
    conn = await asyncpg.connect(database.dsn)
    try:
        await rows_in_every_state(conn)  # dead letters among them, for dlq retry
    finally:
        await conn.close()
    role = await role_without(Role.OPERATOR, obj, privilege)
    code, _out, err = await run_relayd(*command, env=_env(cli_env, dsn_as(database.dsn, role)))
    assert code == 1
    line = _one_line(err)
    assert said in line, line
    assert line.endswith(
        "`relayd grants --role operator` prints the grants for relayd status, "
        "dlq, held, pause, resume, keys, doctor and console"
    ), line


async def test_migrate_names_the_missing_privilege(
    cli_env: dict[str, str], empty_database: Database
) -> None:
    """`relayd migrate` under a role that may not create the schema: exit 1, one line naming
    CREATE on the database and the migrator's grants."""
    name = f"pe_migrator_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(empty_database.dsn)
    try:
        await admin.execute(f'CREATE ROLE "{name}" LOGIN')
        env = _env(cli_env, dsn_as(empty_database.dsn, name))
        code, _out, err = await run_relayd("migrate", env=env)
    finally:
        await admin.execute(f'DROP ROLE "{name}"')
        await admin.close()
    assert code == 1
    assert _one_line(err) == (
        f"relayd: migrations: permission denied: needs CREATE on database "
        f"{empty_database.name}; `relayd grants --role migrator` prints the grants for "
        "relayd migrate"
    )
