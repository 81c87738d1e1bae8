"""The one list of what each database role needs (relayd/store/privileges.py): every statement is
in it, the scripts it prints are valid one-line commands, the docs show exactly them, and a
permission error names the privilege and the object."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relayd.config.sections import CleanupSettings, OutboxSettings
from relayd.core.rows import OutboxTable
from relayd.store.denials import explain_denial
from relayd.store.privileges import (
    DEFAULT_GRANTEE,
    STATEMENTS,
    Obj,
    Role,
    grant_script,
    role_grants,
    role_privileges,
)

ROOT = Path(__file__).resolve().parents[3]
_NAME = re.compile(r"^-- name: (\w+)\s*$", re.M)
_LABEL = re.compile(r'(?:_translated|_batch)\(\s*"(\w+)"')


def test_every_statement_is_in_the_list() -> None:
    """Each named query of relayd/store/sql/, and each name a store method reports failures
    under, says what it needs (even nothing): a new statement cannot miss the list."""
    names = {
        name
        for path in (ROOT / "relayd/store/sql").glob("*.sql")
        for name in _NAME.findall(path.read_text())
    }
    names.add("connect")  # what `_translated()` calls a failure without a statement's name
    for module in (ROOT / "relayd/store").glob("*.py"):
        names |= set(_LABEL.findall(module.read_text()))
    assert names - set(STATEMENTS) == set()
    assert set(STATEMENTS) - names == set()


def test_what_each_role_needs() -> None:
    """The relay writes pauses (the storm guard's, the sink's) and its heartbeat but never
    changes or deletes a pause; the operator writes the audit trail and pauses but never
    deletes rows or heartbeats; DELETE on the outbox only with cleanup; the migrator needs
    CREATE on the database; a producer inserts into the outbox, reads it, calls the
    functions a new row does, and numbers a keyed row in the key's counter (an upsert)."""
    relay = {(g.obj, g.privileges) for g in role_grants(Role.RELAY, cleanup=True)}
    assert (Obj.OUTBOX, ("SELECT", "UPDATE", "DELETE")) in relay
    assert (Obj.PAUSES, ("SELECT", "INSERT")) in relay
    assert (Obj.AUDIT_ID_SEQ, ("USAGE",)) in relay
    assert (Obj.PARKED_KEYS, ("SELECT", "INSERT")) in relay
    assert (Obj.SCHEMA, ("USAGE",)) in relay
    quiet = {(g.obj, g.privileges) for g in role_grants(Role.RELAY, cleanup=False)}
    assert (Obj.OUTBOX, ("SELECT", "UPDATE")) in quiet
    operator = {(g.obj, g.privileges) for g in role_grants(Role.OPERATOR, cleanup=True)}
    assert (Obj.OUTBOX, ("SELECT", "UPDATE")) in operator
    assert (Obj.INSTANCES, ("SELECT",)) in operator
    assert (Obj.PAUSES, ("SELECT", "INSERT", "UPDATE", "DELETE")) in operator
    # Parked keys: the relay parks them and reads them (the claim, the sampler); the operator
    # reads and lifts them (`relayd keys`), and never parks one.
    assert (Obj.PARKED_KEYS, ("SELECT", "DELETE")) in operator
    assert [(g.obj, g.privileges) for g in role_grants(Role.MIGRATOR, cleanup=True)] == [
        (Obj.DATABASE, ("CREATE",))
    ]
    assert len(role_privileges(Role.RELAY, cleanup=True)) == sum(len(p) for _, p in relay)
    assert [(g.obj, g.privileges) for g in role_grants(Role.PRODUCER, cleanup=True)] == [
        (Obj.SCHEMA, ("USAGE",)),
        (Obj.OUTBOX, ("SELECT", "INSERT")),
        (Obj.KEY_SEQS, ("SELECT", "INSERT", "UPDATE")),
        (Obj.AVAILABLE_AT, ("EXECUTE",)),
        (Obj.CHECK_ROW, ("EXECUTE",)),
    ]


@pytest.mark.parametrize("role", list(Role))
def test_a_script_is_one_command_per_line_with_quoted_identifiers(role: Role) -> None:
    """Every line is a comment or one complete command naming the outbox's quoted
    identifiers; a table in another schema is granted there."""
    table = OutboxTable.parse("app_events.outbox_v2")
    script = grant_script(role, table, "relayd-eu", cleanup=True)
    commands = [line for line in script.lines if not line.startswith("-- ")]
    assert commands == script.statements
    for command in commands:
        assert command.endswith(";")
        assert command.count(";") == 1 + command.count("END $$")
        assert re.match(r"^(GRANT [A-Z, ]+ ON |DO \$\$ BEGIN EXECUTE format\('GRANT )", command)
        assert '"relayd-eu"' in command
        assert '"relayd"' not in command
    if role is not Role.MIGRATOR:
        assert 'ON SCHEMA "app_events" TO' in script.text()
        assert 'TABLE "app_events"."outbox_v2" TO' in script.text()
    if role in (Role.RELAY, Role.OPERATOR):
        assert 'TABLE "app_events"."relayd_pauses" TO' in script.text()
    assert script.as_json()["statements"] == commands


@pytest.mark.parametrize("name", ["bad name", 'x"; DROP TABLE y; --', "", "a" * 64, "x%I"])
def test_a_role_name_a_script_cannot_quote_is_refused(name: str) -> None:
    """A `--to` that would need escaping is refused (the CLI says so in one line, exit 2)."""
    with pytest.raises(ValueError, match="expected a role name"):
        grant_script(Role.RELAY, OutboxTable.parse("relayd.outbox"), name, cleanup=True)


def test_the_docs_show_the_generated_scripts() -> None:
    """docs/configure.md shows each role's script exactly as `relayd grants` prints it for
    the default configuration, so the two cannot drift."""
    docs = (ROOT / "docs/configure.md").read_text()
    table = OutboxSettings().outbox_table
    for role in Role:
        marker = f"<!-- relayd grants --role {role.value} -->\n```sql\n"
        assert marker in docs, role
        shown = docs.split(marker, 1)[1].split("```", 1)[0]
        expected = grant_script(
            role, table, DEFAULT_GRANTEE[role], cleanup=CleanupSettings().enabled
        ).text()
        assert shown == expected, role


@pytest.mark.parametrize(
    ("statement", "message", "line"),
    [
        (
            "migrations_applied",
            "permission denied for table relayd_migrations",
            "permission denied: needs SELECT on table relayd_migrations",
        ),
        (
            "heartbeat",
            "permission denied for table relayd_instances",
            "permission denied: needs SELECT, INSERT, UPDATE and DELETE on table relayd_instances",
        ),
        (
            "claim",
            "permission denied for table outbox_v2",  # the outbox, whatever its name
            "permission denied: needs SELECT and UPDATE on table outbox_v2",
        ),
        (
            "audit_insert",
            "permission denied for sequence relayd_audit_id_seq",
            "permission denied: needs USAGE on sequence relayd_audit_id_seq",
        ),
        (
            "dlq_list",
            "permission denied for function relayd_effective_queue",
            "permission denied: needs EXECUTE on function relayd_effective_queue",
        ),
        (
            "check_ledger_exists",
            "permission denied for schema relayd",
            "permission denied: needs USAGE on schema relayd",
        ),
        (
            "migrations",
            "permission denied for database orders",
            "permission denied: needs CREATE on database orders",
        ),
        (
            "migrations",
            "must be owner of table outbox",
            "permission denied: only the owner of table outbox may run it",
        ),
        (
            "dlq_batch",  # a name covering several statements: what any of them needs there
            "permission denied for table relayd_audit",
            "permission denied: needs SELECT, INSERT and UPDATE on table relayd_audit",
        ),
        (
            "claim",
            "permiso denegado a la tabla outbox",  # another lc_messages: shown as it is
            "permiso denegado a la tabla outbox (SQLSTATE 42501)",
        ),
    ],
)
def test_a_permission_error_names_the_privilege_and_the_object(
    statement: str, message: str, line: str
) -> None:
    """PostgreSQL's refusal, with the privileges the statement needs on the object named."""
    assert explain_denial(statement, message) == line
