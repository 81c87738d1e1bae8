"""What each of relayd's database roles needs, as data: the one list from which `relayd
grants` prints a role's GRANT script, `relayd check` verifies a role, and a permission error
names the privilege its statement lacked.

The roles: `relay` (`relayd run`), `operator` (`relayd status`, `dlq`, `held`, `pause`,
`resume`, `keys`, `doctor`), `migrator` (`relayd migrate`, which owns what it creates) and
`producer` (an application's `relayd.producer.append`). Each statement of relayd/store/sql/,
and each of the producer's, is listed with the privileges it needs, read from what it does; a
role needs the union over the statements of its tasks, on the configured outbox and its
schema.
The reading is checked by tests/acceptance/test_least_privilege.py, which runs every command
under roles holding exactly these grants, and by tests/integration/producer/, which appends
with every driver under the producer's.
"""

from __future__ import annotations

import enum
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relayd.core.rows import OutboxTable


class Role(enum.StrEnum):
    RELAY = "relay"
    OPERATOR = "operator"
    MIGRATOR = "migrator"
    PRODUCER = "producer"


# The role name a script grants to unless `--to` names another.
DEFAULT_GRANTEE: Mapping[Role, str] = {
    Role.RELAY: "relayd",
    Role.OPERATOR: "relayd_operator",
    Role.MIGRATOR: "relayd_migrator",
    Role.PRODUCER: "relayd_producer",
}
# The commands each role runs.
COMMANDS: Mapping[Role, str] = {
    Role.RELAY: "relayd run",
    Role.OPERATOR: "relayd status, dlq, held, pause, resume, keys, doctor and console",
    Role.MIGRATOR: "relayd migrate",
    Role.PRODUCER: "an application's appends (relayd.producer, every driver)",
}


class Kind(enum.StrEnum):
    """The kind of object a privilege is on, as GRANT and PostgreSQL's messages name it."""

    DATABASE = "database"
    SCHEMA = "schema"
    TABLE = "table"
    SEQUENCE = "sequence"
    FUNCTION = "function"


class Obj(enum.Enum):
    """The objects relayd's statements use: the outbox, its schema, and what migrations put
    beside it (shared by every outbox of the schema). Declared in the order scripts list
    them."""

    DATABASE = (Kind.DATABASE, "")
    SCHEMA = (Kind.SCHEMA, "")
    OUTBOX = (Kind.TABLE, "")
    MIGRATIONS = (Kind.TABLE, "relayd_migrations")
    PAUSES = (Kind.TABLE, "relayd_pauses")
    AUDIT = (Kind.TABLE, "relayd_audit")
    AUDIT_ID_SEQ = (Kind.SEQUENCE, "relayd_audit_id_seq")  # relayd_audit.id is a bigserial
    # Every row an action changed (migration 0012).
    AUDIT_ROWS = (Kind.TABLE, "relayd_audit_rows")
    INSTANCES = (Kind.TABLE, "relayd_instances")
    # Ordered delivery (migration 0011): each key's last number, written by producers'
    # inserts (the numbering trigger runs as the inserting role); the parked keys, written
    # by relays and operators.
    KEY_SEQS = (Kind.TABLE, "relayd_key_seqs")
    PARKED_KEYS = (Kind.TABLE, "relayd_parked_keys")
    EFFECTIVE_QUEUE = (Kind.FUNCTION, "relayd_effective_queue", "jsonb")
    HELD = (Kind.FUNCTION, "relayd_held", "jsonb, text[], text[], text[]")
    AVAILABLE_AT = (Kind.FUNCTION, "relayd_available_at", "")
    # The row checks call it: since migration 0009 a trigger, on every inserted row, every
    # change of a row's id, job or created_at, and every redrive (before 0009, a CHECK
    # constraint on every write, relayd's claims and settles included).
    CHECK_ROW = (
        Kind.FUNCTION,
        "relayd_check_row",
        "uuid, jsonb, integer, timestamptz, timestamptz, timestamptz",
    )

    @property
    def kind(self) -> Kind:
        kind: Kind = self.value[0]  # (kind, name[, a function's argument types])
        return kind

    def name_in(self, table: OutboxTable) -> str:
        """Its bare name (the outbox's own for OUTBOX, the schema's for SCHEMA)."""
        if self is Obj.OUTBOX:
            return table.name
        if self is Obj.SCHEMA:
            return table.schema_name
        return str(self.value[1])

    def display(self, table: OutboxTable) -> str:
        """As an operator reads it: `table relayd.relayd_pauses`."""
        if self is Obj.DATABASE:
            return "the database"
        if self is Obj.SCHEMA:
            return f"schema {table.schema_name}"
        return f"{self.kind.value} {table.schema_name}.{self.name_in(table)}"

    def sql(self, table: OutboxTable) -> str:
        """The object clause of a GRANT (not for DATABASE: see `_database_grant`)."""
        if self is Obj.SCHEMA:
            return f"SCHEMA {table.quoted_schema}"
        qualified = f'{table.quoted_schema}."{self.name_in(table)}"'
        if self.kind is Kind.FUNCTION:
            return f"FUNCTION {qualified}({self.value[2]})"
        return f"{self.kind.value.upper()} {qualified}"


# Privileges in the order GRANT lists them.
PRIVILEGE_ORDER = ("USAGE", "CREATE", "SELECT", "INSERT", "UPDATE", "DELETE", "EXECUTE")

Needs = Mapping[Obj, tuple[str, ...]]
_NOTHING: Needs = {}
_CLAIM: Needs = {
    Obj.OUTBOX: ("SELECT", "UPDATE"),
    Obj.CHECK_ROW: ("EXECUTE",),
    Obj.PAUSES: ("SELECT",),
    Obj.EFFECTIVE_QUEUE: ("EXECUTE",),
    Obj.HELD: ("EXECUTE",),
}
_PENDING: Needs = {  # reads of pending rows that skip paused queues and types
    Obj.OUTBOX: ("SELECT",),
    Obj.PAUSES: ("SELECT",),
    Obj.EFFECTIVE_QUEUE: ("EXECUTE",),
    Obj.HELD: ("EXECUTE",),
}
_BY_QUEUE: Needs = {Obj.OUTBOX: ("SELECT",), Obj.EFFECTIVE_QUEUE: ("EXECUTE",)}
# WHERE and RETURNING read columns too; the row written is checked.
_FENCED: Needs = {Obj.OUTBOX: ("SELECT", "UPDATE"), Obj.CHECK_ROW: ("EXECUTE",)}
# A row due again at once is stamped as a new row is, once the transaction writes.
_DUE_AGAIN: Needs = {**_FENCED, Obj.AVAILABLE_AT: ("EXECUTE",)}
_CREATE_DATABASE: Needs = {Obj.DATABASE: ("CREATE",)}

# Every statement relayd runs, by the name it fails under (a named query of
# relayd/store/sql/, or the name its method translates failures with), and the privileges it
# needs beyond USAGE on the schema, which every statement on an object in it needs.
# Catalog reads, pg_stat_* views, LISTEN and NOTIFY need nothing.
STATEMENTS: Mapping[str, Needs] = {
    # The relay's cycle.
    "claim": _CLAIM,
    "claim_ordered": {**_CLAIM, Obj.PARKED_KEYS: ("SELECT",)},
    # A head that can never be delivered parks its key: its row, and the key's park.
    "settle_parked": {**_FENCED, Obj.PARKED_KEYS: ("INSERT",)},
    "explain_claim": {**_CLAIM, Obj.PARKED_KEYS: ("SELECT",)},  # EXPLAIN checks them too
    "next_due_s": _PENDING,
    "settle_published": _FENCED,
    "settle_retry": _DUE_AGAIN,
    "settle_dead": _FENCED,
    "release": _DUE_AGAIN,
    "take_back": _DUE_AGAIN,
    "delete_published": {Obj.OUTBOX: ("SELECT", "DELETE")},
    "ping": _NOTHING,
    "connect": _NOTHING,
    "listen": _NOTHING,
    "listen_ping": _NOTHING,
    # The schema and its migrations.
    "outbox_columns": _NOTHING,  # the catalogs
    "check_ledger_exists": _NOTHING,
    "migrations_applied": {Obj.MIGRATIONS: ("SELECT",)},
    "migrations": _CREATE_DATABASE,  # the migrator's transaction, as one
    "migrations_lock": _NOTHING,
    "migrations_schema_create": _CREATE_DATABASE,  # asked for even when the schema exists
    "migrations_ledger_create": _NOTHING,  # in the schema the migrator owns
    "migrations_record": _NOTHING,
    "notify_trigger_state": _NOTHING,  # the catalogs
    "notify_trigger_create": _NOTHING,  # on the table the migrator owns
    "notify_trigger_drop": _NOTHING,
    "key_column_trigger_state": _NOTHING,  # the catalogs
    "key_column_exists": _NOTHING,
    "key_column_trigger_create": _NOTHING,  # on the table the migrator owns
    "key_column_trigger_drop": _NOTHING,
    # The backlog: the sampler, `relayd status`, `/v1/status`, the heartbeat.
    "backlog_sample": {**_PENDING, Obj.PARKED_KEYS: ("SELECT",)},
    "backlog_top": _BY_QUEUE,
    "dead_by_reason": {Obj.OUTBOX: ("SELECT",)},
    "pauses_list": {Obj.PAUSES: ("SELECT",)},
    "pauses_held": {**_BY_QUEUE, Obj.PAUSES: ("SELECT",)},
    "instances_list": {Obj.INSTANCES: ("SELECT",)},
    "parked_keys_oldest": {Obj.PARKED_KEYS: ("SELECT",)},
    "status": _NOTHING,  # its parts fail under their own names
    # An upsert with a pruning DELETE: the conflict and the WHERE read rows.
    "heartbeat": {Obj.INSTANCES: ("SELECT", "INSERT", "UPDATE", "DELETE")},
    "heartbeat_delete": {Obj.INSTANCES: ("SELECT", "DELETE")},
    # Dead letters, pauses, the audit trail.
    "operator_schema": _NOTHING,
    "operator_now": _NOTHING,
    "dlq_list": _BY_QUEUE,
    "dlq_show": _BY_QUEUE,
    "dlq_batch": _NOTHING,  # its parts fail under their own names
    "dlq_page": {Obj.OUTBOX: ("SELECT", "UPDATE"), Obj.EFFECTIVE_QUEUE: ("EXECUTE",)},
    "dlq_redrive": _FENCED,
    "dlq_discard": _FENCED,
    # A redrive's look at the later rows of an ordered dead letter's key (the filters read
    # the effective queue).
    "dlq_out_of_order": _BY_QUEUE,
    # RETURNING id reads the row; the bigserial's nextval() needs the sequence.
    "audit_insert": {
        Obj.AUDIT: ("SELECT", "INSERT"),
        Obj.AUDIT_ID_SEQ: ("USAGE",),
        Obj.AUDIT_ROWS: ("INSERT",),
    },
    "audit_note": {Obj.AUDIT: ("INSERT",), Obj.AUDIT_ID_SEQ: ("USAGE",)},  # no RETURNING
    "audit_extend": {Obj.AUDIT: ("SELECT", "UPDATE"), Obj.AUDIT_ROWS: ("INSERT",)},
    # INSERT ... ON CONFLICT DO UPDATE ... RETURNING.
    "pause_upsert": {Obj.PAUSES: ("SELECT", "INSERT", "UPDATE")},
    # INSERT ... ON CONFLICT DO NOTHING: the conflict's arbiter index is read.
    "pause_insert": {Obj.PAUSES: ("SELECT", "INSERT")},
    "pause_delete": {Obj.PAUSES: ("SELECT", "DELETE")},
    "queue_use": _BY_QUEUE,
    # Held rows: pending rows a pause holds, read and discarded with the pauses' sets.
    "held_list": _PENDING,
    "held_batch": _NOTHING,  # its parts fail under their own names
    "held_page": {**_PENDING, Obj.OUTBOX: ("SELECT", "UPDATE")},  # FOR UPDATE
    "held_discard": {**_PENDING, **_FENCED},
    "outbox_notify": _NOTHING,
    # Parked keys of ordered delivery (`relayd keys`).
    "ordering_schema": _NOTHING,  # the catalogs
    "keys_list": {Obj.OUTBOX: ("SELECT",), Obj.PARKED_KEYS: ("SELECT",)},
    "keys_act": _NOTHING,  # its parts fail under their own names
    "key_unpark": {Obj.PARKED_KEYS: ("SELECT", "DELETE")},  # DELETE ... WHERE ... RETURNING
    "key_head": {Obj.OUTBOX: ("SELECT", "UPDATE")},  # FOR UPDATE
    "key_retry": _FENCED,
    "key_skip": _FENCED,
    "console_dlq": _BY_QUEUE,  # `relayd console`'s own reads (the rest are the commands')
    "console_in_order": _NOTHING,
    "console_event": {**_BY_QUEUE, Obj.PARKED_KEYS: ("SELECT",)},
    "console_audit": {Obj.AUDIT: ("SELECT",), Obj.AUDIT_ROWS: ("SELECT",)},
    # `relayd check` and `relayd doctor`.
    "check_identity": _NOTHING,
    "check_privileges": _NOTHING,
    "check_sees_writers": _NOTHING,
    "check_listen": _NOTHING,
    "doctor_table": _NOTHING,
    "plan_as_relay": _NOTHING,
    "doctor_indexes": _NOTHING,
    "doctor_xmin_holders": _NOTHING,
    "doctor_horizon_others": _NOTHING,
}


# The producer's statements (relayd/producer/), run on the application's own connection:
# `append`'s insert, which does nothing on a taken id, and its comparison with the row
# holding that id; `enqueue` and `enqueue_many` insert alone. ON CONFLICT reads the conflict
# target (SELECT); the row checks' trigger calls relayd_check_row as the inserting role, and
# available_at's default calls relayd_available_at. A keyed row's numbering trigger upserts
# its key's last number in relayd_key_seqs as the inserting role (INSERT ... ON CONFLICT DO
# UPDATE ... RETURNING: SELECT, INSERT and UPDATE, the last checked even for a new key). The
# NOTIFY trigger's function, and the checks' and the numbering's trigger functions, need
# nothing: PostgreSQL checks a trigger function's EXECUTE when the trigger is created, not
# when it fires (and pg_notify is PUBLIC's).
PRODUCER_STATEMENTS: Mapping[str, Needs] = {
    "append_insert": {
        Obj.OUTBOX: ("SELECT", "INSERT"),
        Obj.CHECK_ROW: ("EXECUTE",),
        Obj.AVAILABLE_AT: ("EXECUTE",),
        # A keyed row is numbered by a trigger that runs as the inserting role.
        Obj.KEY_SEQS: ("SELECT", "INSERT", "UPDATE"),
    },
    "append_compare": {Obj.OUTBOX: ("SELECT",)},
}
_EVERY_STATEMENT: Mapping[str, Needs] = {**STATEMENTS, **PRODUCER_STATEMENTS}


@dataclass(frozen=True, slots=True)
class Task:
    """Something a role does, and the statements it runs (`cleanup_only`: only while
    `cleanup.enabled`)."""

    what: str
    statements: tuple[str, ...]
    cleanup_only: bool = False


_STATUS = (
    "outbox_columns",
    "check_ledger_exists",
    "migrations_applied",
    "backlog_sample",
    "backlog_top",
    "dead_by_reason",
    "pauses_list",
    "pauses_held",
    "instances_list",
    "parked_keys_oldest",
)
TASKS: Mapping[Role, tuple[Task, ...]] = {
    Role.RELAY: (
        Task("start-up: the outbox is migrated", _STATUS[:3]),
        Task(
            "claim, settle and release rows",
            (
                "claim",
                "claim_ordered",
                "next_due_s",
                "settle_published",
                "settle_retry",
                "settle_dead",
                "settle_parked",
                "release",
                "take_back",
            ),
        ),
        Task("the backlog gauges and /v1/status", _STATUS[3:]),
        Task("its heartbeat in relayd_instances", ("heartbeat", "heartbeat_delete")),
        Task(
            "the poison-storm guard's and the sink's pauses, and the pauses a rejection meets",
            ("pause_insert", "audit_note", "pauses_list"),
        ),
        Task("retention cleanup (cleanup.enabled)", ("delete_published",), cleanup_only=True),
    ),
    Role.OPERATOR: (
        Task("relayd status", _STATUS),
        Task("relayd dlq list and show", ("operator_schema", "dlq_list", "dlq_show")),
        Task(
            "relayd dlq retry and discard",
            (
                "ordering_schema",
                "dlq_page",
                "dlq_out_of_order",
                "dlq_redrive",
                "dlq_discard",
                "audit_insert",
                "audit_extend",
            ),
        ),
        Task(
            "relayd pause and resume",
            (
                "pause_upsert",
                "pause_delete",
                "pauses_list",
                "queue_use",
                "audit_note",
                "outbox_notify",
            ),
        ),
        Task(
            "relayd held list and discard",
            ("held_list", "held_page", "held_discard", "audit_insert", "audit_extend"),
        ),
        Task("relayd keys list", ("operator_schema", "ordering_schema", "keys_list")),
        Task(
            "relayd keys retry, skip and release",
            (
                "key_unpark",
                "key_head",
                "key_retry",
                "key_skip",
                "audit_insert",
                "outbox_notify",
            ),
        ),
        Task("relayd doctor: the claim's plan", ("explain_claim",)),
        Task(
            "relayd console", ("console_in_order", "console_dlq", "console_event", "console_audit")
        ),
    ),
    Role.MIGRATOR: (
        Task(
            "create the outbox's schema (PostgreSQL asks for this even when it exists)",
            ("migrations",),
        ),
    ),
    Role.PRODUCER: (
        Task(
            "insert events in the application's transaction (append, enqueue, enqueue_many): "
            "the row checks, available_at's default and a keyed row's numbering run as the "
            "inserting role",
            ("append_insert",),
        ),
        Task("compare an event appended again with the stored one (a no-op)", ("append_compare",)),
    ),
}


@dataclass(frozen=True, slots=True)
class Grant:
    """The privileges a role needs on one object, and the tasks that need them."""

    obj: Obj
    privileges: tuple[str, ...]
    why: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Privilege:
    """One privilege on one object, as `relayd check` verifies it."""

    obj: Obj
    privilege: str

    def display(self, table: OutboxTable) -> str:
        return f"{self.privilege} on {self.obj.display(table)}"


def role_grants(role: Role, *, cleanup: bool) -> list[Grant]:
    """What `role` needs, one Grant per object in script order; USAGE on the schema first
    (every statement on an object in it needs it)."""
    wanted: dict[Obj, set[str]] = {}
    why: dict[Obj, list[str]] = {}
    for task in TASKS[role]:
        if task.cleanup_only and not cleanup:
            continue
        for statement in task.statements:
            for obj, privileges in _EVERY_STATEMENT[statement].items():
                wanted.setdefault(obj, set()).update(privileges)
                if task.what not in why.setdefault(obj, []):
                    why[obj].append(task.what)
    if role is not Role.MIGRATOR:  # the migrator owns the schema it creates
        wanted[Obj.SCHEMA] = {"USAGE"}
        why[Obj.SCHEMA] = ["every statement (the outbox and relayd's tables live in it)"]
    return [
        Grant(obj, tuple(p for p in PRIVILEGE_ORDER if p in wanted[obj]), tuple(why[obj]))
        for obj in Obj
        if obj in wanted
    ]


def role_privileges(role: Role, *, cleanup: bool) -> list[Privilege]:
    """`role_grants`, one privilege at a time: what `relayd check --role` verifies."""
    return [
        Privilege(grant.obj, privilege)
        for grant in role_grants(role, cleanup=cleanup)
        for privilege in grant.privileges
    ]


# --- the GRANT script -------------------------------------------------------------------

# A role name `--to` accepts: what needs no escaping inside double quotes, or inside the
# quoted format string of the migrator's DO block.
_ROLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$-]{0,62}$")

_COMMENT_WIDTH = 92
_RECOMMENDED_WHY = (
    "Recommended, not required (a superuser runs it): relayd then sees when other roles' "
    "transactions started, and its claims start at their watermark instead of reading the "
    "whole claim index (docs/performance.md)."
)


def check_role_name(name: str) -> str:
    """`name` if a script can grant to it; ValueError says why not."""
    if not _ROLE_NAME.match(name):
        raise ValueError(
            f"expected a role name of letters, digits, _, $ or - (at most 63), got {name!r}"
        )
    return name


@dataclass(frozen=True, slots=True)
class Script:
    """A role's GRANT script for one outbox: `lines` are SQL comments and statements, one
    command per line."""

    role: Role
    table: OutboxTable
    grantee: str
    grants: list[Grant]
    statements: list[str]
    recommended: list[str]
    lines: list[str]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def as_json(self) -> dict[str, object]:
        return {
            "role": self.role.value,
            "table": str(self.table),
            "to": self.grantee,
            "grants": [
                {
                    "object": grant.obj.display(self.table),
                    "privileges": list(grant.privileges),
                    "why": list(grant.why),
                }
                for grant in self.grants
            ],
            "statements": self.statements,
            "recommended": self.recommended,
        }


def grant_script(role: Role, table: OutboxTable, grantee: str, *, cleanup: bool) -> Script:
    """The GRANT script giving `grantee` what `role` needs on `table`."""
    to = f'"{check_role_name(grantee)}"'
    grants = role_grants(role, cleanup=cleanup)
    if role is Role.MIGRATOR:
        runner = "a superuser (or the database's owner), in the outbox's database"
    else:
        runner = (
            "the outbox's owner (the role that ran relayd migrate) or a superuser, in the "
            "outbox's database; again after each upgrade"
        )
    lines = _comment(
        f"relayd grants --role {role.value}: for {COMMANDS[role]} on {table}, granted to {to}. "
        f"Run it as {runner}."
    )
    statements: list[str] = []
    for grant in grants:
        if grant.obj is Obj.DATABASE:
            statement = _database_grant(grant.privileges, to)
        else:
            statement = f"GRANT {', '.join(grant.privileges)} ON {grant.obj.sql(table)} TO {to};"
        statements.append(statement)
        lines += [*_comment("; ".join(grant.why)), statement]
    recommended: list[str] = []
    if role is Role.RELAY:
        recommended.append(f"GRANT pg_read_all_stats TO {to};")
        lines += [*_comment(_RECOMMENDED_WHY), f"-- {recommended[0]}"]
    if role is Role.MIGRATOR:
        lines += [
            *_comment(
                "The migrator owns the schema, tables and functions it creates. A schema or "
                "an outbox table that another role made must be handed over first:"
            ),
            f"-- GRANT CREATE ON SCHEMA {table.quoted_schema} TO {to};",
            f"-- ALTER TABLE {table.qualified} OWNER TO {to};",
        ]
    return Script(role, table, grantee, grants, statements, recommended, lines)


def _comment(text: str) -> list[str]:
    """`text` as SQL comment lines of a readable width."""
    return [f"-- {line}" for line in textwrap.wrap(text, width=_COMMENT_WIDTH)]


def _database_grant(privileges: Sequence[str], to: str) -> str:
    """GRANT on the database the script runs in: GRANT cannot name the current database,
    and the script must not depend on a DSN (nor print one)."""
    return (
        f"DO $$ BEGIN EXECUTE format('GRANT {', '.join(privileges)} ON DATABASE %I TO {to}', "
        "current_database()); END $$;"
    )


def hint(role: Role) -> str:
    """Where an operator finds the grants of `role`."""
    return f"`relayd grants --role {role.value}` prints the grants for {COMMANDS[role]}"
