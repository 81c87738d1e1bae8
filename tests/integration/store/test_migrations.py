"""`relayd migrate`: idempotent, serialised, adopting an outbox made with the minimal DDL
(`event_id`, `job`, `created_at`, `published_at`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from relayd.core.envelope import LOWER_UUID
from relayd.core.errors import MigrationError, SchemaError
from relayd.core.rows import OutboxTable
from relayd.producer import uuid7
from relayd.store import Store
from relayd.store.migrations import Migration, load_migrations, migrate
from tests.support import DEFAULT_TABLE, Database, produce, run_relayd

MINIMAL_DDL = """
CREATE SCHEMA legacy_app;
CREATE TABLE legacy_app.outbox (
    event_id UUID PRIMARY KEY,
    job JSONB NOT NULL CHECK (job ? 'id' AND job->>'id' = event_id::TEXT),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at TIMESTAMPTZ
);
CREATE INDEX outbox_unsent ON legacy_app.outbox (created_at, event_id)
    WHERE published_at IS NULL;
"""
MINIMAL_ROWS = [
    ("018f0000-0000-7000-8000-000000000042", '{"version":1,"order_id":42}', None),
    ("018f0000-0000-7000-8000-000000000043", '{"version":1,"order_id":43}', "now()"),
]


async def _ledger(conn: asyncpg.Connection, schema: str = "relayd") -> list[tuple[str, int]]:
    rows = await conn.fetch(
        f"SELECT outbox_table, version FROM {schema}.relayd_migrations ORDER BY 1, 2"
    )
    return [(r["outbox_table"], r["version"]) for r in rows]


async def test_migrate_twice_is_idempotent(empty_database: Database) -> None:
    """A second run applies nothing and leaves one ledger entry per migration."""
    table = OutboxTable.parse("relayd.outbox")
    store = await Store.connect(empty_database.dsn, table, max_size=2)
    try:
        first = await migrate(store)
        second = await migrate(store)
    finally:
        await store.close()
    versions = [m.version for m in load_migrations()]
    assert [m.version for m in first.applied] == versions
    assert second.applied == []
    assert [m.version for m in second.already] == versions
    conn = await asyncpg.connect(empty_database.dsn)
    try:
        assert await _ledger(conn) == [("relayd.outbox", v) for v in versions]
    finally:
        await conn.close()


async def test_concurrent_migrate_processes_serialise(
    empty_database: Database, cli_env: dict[str, str]
) -> None:
    """Two `relayd migrate` processes at once: both succeed, one schema, one ledger entry each."""
    env = cli_env | {"RELAYD_DATABASE__DSN": empty_database.dsn}
    results = await asyncio.gather(
        run_relayd("migrate", "--json", env=env), run_relayd("migrate", "--json", env=env)
    )
    assert [code for code, _, _ in results] == [0, 0], results
    reports = [json.loads(out) for _, out, _ in results]
    applied = sorted(len(report["applied"]) for report in reports)
    assert applied == [0, len(load_migrations())]
    conn = await asyncpg.connect(empty_database.dsn)
    try:
        assert await _ledger(conn) == [("relayd.outbox", m.version) for m in load_migrations()]
        tables = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'relayd'"
        )
        assert sorted(r[0] for r in tables) == [
            "outbox",
            "relayd_audit",
            "relayd_audit_rows",
            "relayd_instances",
            "relayd_key_seqs",
            "relayd_migrations",
            "relayd_parked_keys",
            "relayd_pauses",
        ]
    finally:
        await conn.close()


async def test_adopts_a_minimal_outbox_keeping_rows(empty_database: Database) -> None:
    """A table made with the minimal outbox DDL keeps its rows and gains the relay columns."""
    conn = await asyncpg.connect(empty_database.dsn)
    try:
        await conn.execute(MINIMAL_DDL)
        for event_id, args, published in MINIMAL_ROWS:
            job = json.dumps(
                {
                    "id": event_id,
                    "type": "order.fulfill",
                    "args": [json.loads(args)],
                    "queue": "gateway-jobs",
                }
            )
            await conn.execute(
                "INSERT INTO legacy_app.outbox (event_id, job, published_at) "
                f"VALUES ($1, $2, {published or 'NULL'})",
                event_id,
                job,
            )
        # A row the relay could never publish: args is an object (the table's own check allows it).
        await conn.execute(
            "INSERT INTO legacy_app.outbox (event_id, job) VALUES ($1, $2)",
            "018f0000-0000-7000-8000-000000000044",
            '{"id":"018f0000-0000-7000-8000-000000000044","type":"order.fulfill","args":{}}',
        )
        # Rows no lag can be computed for: an infinite created_at, pending (dead-lettered by
        # migrate) or already published (kept as it is).
        for n, created, published in (
            (45, "-infinity", "NULL"),
            (46, "infinity", "NULL"),
            (47, "infinity", "now()"),
        ):
            event_id = f"018f0000-0000-7000-8000-0000000000{n}"
            await conn.execute(
                "INSERT INTO legacy_app.outbox (event_id, job, created_at, published_at) "
                f"VALUES ($1, $2, '{created}', {published})",
                event_id,
                json.dumps({"id": event_id, "type": "order.fulfill", "args": []}),
            )
        before = await conn.fetch(
            "SELECT event_id, job, created_at, published_at FROM legacy_app.outbox ORDER BY 1"
        )

        table = OutboxTable.parse("legacy_app.outbox")
        store = await Store.connect(empty_database.dsn, table, max_size=2)
        try:
            report = await migrate(store)
            await store.check_schema()
        finally:
            await store.close()
        assert [m.version for m in report.applied] == [m.version for m in load_migrations()]

        after = await conn.fetch(
            "SELECT event_id, job, created_at, published_at, attempts, dead_reason "
            "FROM legacy_app.outbox ORDER BY 1"
        )
        assert [tuple(r)[:4] for r in after] == [tuple(r) for r in before]
        assert [r["attempts"] for r in after] == [0] * 6
        assert [r["dead_reason"] for r in after] == [
            None,
            None,
            "invalid_envelope",  # args is an object
            "invalid_envelope",  # created_at -infinity, pending
            "invalid_envelope",  # created_at infinity, pending
            None,  # created_at infinity, but published long ago
        ]
        assert await _ledger(conn, "legacy_app") == [
            ("legacy_app.outbox", m.version) for m in load_migrations()
        ]
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("job", "constraint"),
    [
        (
            {"id": "{id}", "type": "order.fulfill", "args": {"order_id": 1}},
            "relayd_job_args_is_array",
        ),
        (
            {"id": "018f0000-0000-7000-8000-0000000000ff", "type": "order.fulfill", "args": []},
            "relayd_job_id_matches_event_id",
        ),
        ({"id": "{id}", "type": 7, "args": []}, "relayd_job_type_is_string"),
        ({"id": "{id}", "type": "a.b", "args": [], "meta": [1]}, "relayd_job_meta_is_object"),
    ],
)
async def test_bad_outbox_row_fails_the_producer_transaction(
    conn: asyncpg.Connection, job: dict[str, object], constraint: str
) -> None:
    """A bad envelope fails the application's transaction, naming the check; nothing commits."""
    event_id = "018f0000-0000-7000-8000-000000000001"
    body = json.dumps(job).replace("{id}", event_id)
    await conn.execute("CREATE TABLE orders (id int PRIMARY KEY, paid bool)")

    async def pay_order_and_announce_it() -> None:
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES (42, true)")
            await conn.execute(
                "INSERT INTO relayd.outbox (event_id, job) VALUES ($1, $2)", event_id, body
            )

    with pytest.raises(asyncpg.CheckViolationError) as caught:
        await pay_order_and_announce_it()
    assert constraint in str(caught.value)
    assert await conn.fetchval("SELECT count(*) FROM orders") == 0
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox") == 0


@pytest.mark.parametrize("created_at", ["infinity", "-infinity"])
async def test_infinite_created_at_fails_the_producer_transaction(
    conn: asyncpg.Connection, created_at: str
) -> None:
    """A producer's infinite created_at is refused at INSERT, naming the check."""
    event_id = "018f0000-0000-7000-8000-000000000001"
    body = json.dumps({"id": event_id, "type": "order.fulfill", "args": []})
    with pytest.raises(asyncpg.CheckViolationError, match="relayd_created_at_is_finite"):
        await conn.execute(
            "INSERT INTO relayd.outbox (event_id, job, created_at) "
            f"VALUES ($1, $2, '{created_at}')",
            event_id,
            body,
        )


async def test_a_migration_edited_in_comments_only_is_still_applied(
    empty_database: Database,
) -> None:
    """An outbox migrated from an earlier text of 0001 (differing in comments only) is up to
    date; any other checksum is refused, and nothing is applied."""
    table = OutboxTable.parse("relayd.outbox")
    earlier = "083b83243a35e052565553f82639fe8db236bb39ce94c9de5389237b1ed40e65"
    store = await Store.connect(empty_database.dsn, table, max_size=2)
    conn = await asyncpg.connect(empty_database.dsn)
    try:
        await migrate(store)
        await conn.execute(
            "UPDATE relayd.relayd_migrations SET checksum = $1 WHERE version = 1", earlier
        )
        again = await migrate(store)
        assert again.applied == []
        await conn.execute(
            "UPDATE relayd.relayd_migrations SET checksum = 'edited' WHERE version = 1"
        )
        with pytest.raises(MigrationError, match=r"0001_outbox was applied .* different file"):
            await migrate(store)
    finally:
        await conn.close()
        await store.close()


async def test_a_non_v7_event_id_fails_the_producer_transaction(conn: asyncpg.Connection) -> None:
    """OJS servers accept only UUIDv7 ids: a v4 id (gen_random_uuid()) is refused at INSERT,
    naming the check; relayd_uuidv7() makes ids the check and the sink accept."""
    body = '{"id": "%s", "type": "order.fulfill", "args": []}'
    with pytest.raises(asyncpg.CheckViolationError, match="relayd_event_id_is_uuidv7"):
        await conn.execute(
            "INSERT INTO relayd.outbox (event_id, job) "
            "SELECT id, format($1, id)::jsonb FROM (SELECT gen_random_uuid() AS id) s",
            body,
        )
    ids = await conn.fetch(
        "INSERT INTO relayd.outbox (event_id, job) "
        "SELECT id, format($1, id)::jsonb "
        "FROM (SELECT relayd.relayd_uuidv7() AS id FROM generate_series(1, 50)) s "
        "RETURNING event_id::text",
        body,
    )
    assert len({r[0] for r in ids}) == 50
    assert all(LOWER_UUID.match(r[0]) and r[0][14] == "7" and r[0][19] in "89ab" for r in ids)


async def test_migrate_dead_letters_pending_non_v7_rows_of_an_adopted_outbox(
    empty_database: Database,
) -> None:
    """Adopting an outbox whose pending rows carry v4 ids: they are dead-lettered (kept), a
    published one is left as it is, and the v7 rows stay pending."""
    conn = await asyncpg.connect(empty_database.dsn)
    try:
        await conn.execute(MINIMAL_DDL)
        v4_pending, v4_published = str(uuid.uuid4()), str(uuid.uuid4())
        v7 = uuid7()
        for event_id, published in ((v4_pending, "NULL"), (v4_published, "now()"), (v7, "NULL")):
            await conn.execute(
                "INSERT INTO legacy_app.outbox (event_id, job, published_at) "
                f"VALUES ($1, $2, {published})",
                event_id,
                json.dumps({"id": event_id, "type": "order.fulfill", "args": []}),
            )
        store = await Store.connect(
            empty_database.dsn, OutboxTable.parse("legacy_app.outbox"), max_size=2
        )
        try:
            await migrate(store)
        finally:
            await store.close()
        rows = {
            r["event_id"]: (r["dead_reason"], r["published_at"] is not None)
            for r in await conn.fetch(
                "SELECT event_id::text, dead_reason, published_at FROM legacy_app.outbox"
            )
        }
    finally:
        await conn.close()
    assert rows == {
        v4_pending: ("invalid_envelope", False),
        v4_published: (None, True),
        v7: (None, False),
    }


@contextlib.asynccontextmanager
async def _just_before(
    database: Database, name: str
) -> AsyncIterator[tuple[list[Migration], Migration, asyncpg.Connection, Store]]:
    """The outbox migrated up to the migration called `name`, exclusive: every migration,
    that one, a connection and a store."""
    migrations = load_migrations()
    [step] = [m for m in migrations if m.name == name]
    conn = await asyncpg.connect(database.dsn)
    store = await Store.connect(database.dsn, DEFAULT_TABLE, max_size=2)
    try:
        await migrate(store, migrations[: step.version - 1])
        yield migrations, step, conn, store
    finally:
        await store.close()
        await conn.close()


async def test_0007_adds_redriven_at_to_an_outbox_in_use_changing_no_row(
    empty_database: Database,
) -> None:
    """An outbox migrated up to 0006 with rows in every state: the relay refuses it until
    0007 has run (one line naming the column); 0007 adds `redriven_at`, NULL for every row,
    and leaves the rest of each row as it was; running its SQL again changes nothing."""
    async with _just_before(empty_database, "redriven_at") as (migrations, step, conn, store):
        pending, attempted, dead = await produce(conn, 3)
        await conn.execute(
            "UPDATE relayd.outbox SET attempts = 2, last_attempt_at = now() WHERE event_id = $1",
            attempted,
        )
        await conn.execute(
            "UPDATE relayd.outbox SET dead_at = now(), dead_reason = 'past_window', "
            "last_attempt_at = now() WHERE event_id = $1",
            dead,
        )
        before = [tuple(r) for r in await conn.fetch(f"SELECT * FROM {DEFAULT_TABLE} ORDER BY 1")]
        with pytest.raises(SchemaError, match=r"^outbox table relayd.outbox lacks redriven_at: "):
            await store.check_schema()

        report = await migrate(store, migrations[: step.version])
        assert [m.version for m in report.applied] == [step.version]
        await store.check_schema()
        query = f"SELECT *, redriven_at IS NULL AS never FROM {DEFAULT_TABLE} ORDER BY 1"
        after = await conn.fetch(query)
        assert [tuple(r)[: len(before[0])] for r in after] == before
        assert [r["never"] for r in after] == [True, True, True]
        assert {str(r["event_id"]) for r in after} == {pending, attempted, dead}

        await conn.execute(step.sql(DEFAULT_TABLE))  # again, outside the ledger
        assert await conn.fetch(query) == after


async def test_0013_leaves_room_on_new_pages_rewriting_no_row(empty_database: Database) -> None:
    """0013 gives the outbox a fillfactor of 70 beside the vacuum settings of 0004, and
    rewrites no row: each keeps its place (ctid) and its values; running it again changes
    nothing."""
    async with _just_before(empty_database, "room_to_update") as (migrations, step, conn, store):
        await produce(conn, 3)
        query = f"SELECT ctid::text, * FROM {DEFAULT_TABLE} ORDER BY event_id"
        before = await conn.fetch(query)
        options = f"SELECT reloptions FROM pg_class WHERE oid = '{DEFAULT_TABLE}'::regclass"
        assert not any(o.startswith("fillfactor=") for o in await conn.fetchval(options))

        report = await migrate(store, migrations[: step.version])
        assert [m.version for m in report.applied] == [step.version]
        assert await conn.fetch(query) == before
        after = await conn.fetchval(options)
        assert "fillfactor=70" in after
        assert "autovacuum_vacuum_scale_factor=0.01" in after

        await conn.execute(step.sql(DEFAULT_TABLE))  # again, outside the ledger
        assert await conn.fetchval(options) == after


# Rows the checks are asked about in test_0008: every rule refused, alone or with others, and
# the states that exempt a row from some rules (dead, published).
_V7 = "018f0000-0000-7000-8000-000000000001"
_V4 = "0190c3a2-0000-4000-8000-000000000001"
_JOBS: dict[str, object] = {
    "good": {"id": "{id}", "type": "a.b", "args": []},
    "with meta": {"id": "{id}", "type": "a.b", "args": [1], "meta": {"k": 1}},
    "meta null": {"id": "{id}", "type": "a.b", "args": [], "meta": None},
    "meta array": {"id": "{id}", "type": "a.b", "args": [], "meta": []},
    "args object": {"id": "{id}", "type": "a.b", "args": {"n": 1}},
    "args missing": {"id": "{id}", "type": "a.b"},
    "type number": {"id": "{id}", "type": 7, "args": []},
    "type missing": {"id": "{id}", "args": []},
    "id other": {"id": _V4, "type": "a.b", "args": []},
    "id missing": {"type": "a.b", "args": []},
    "everything wrong": {"id": 1, "type": [], "args": "x", "meta": 2},
    "array": ["not", "an", "object"],
    "string": "just a string",
}


def _candidates() -> list[tuple[str, str, str, str, int]]:
    """(event_id, job, created_at, state, attempts) for every combination."""
    found = []
    for event_id in (_V7, _V4):
        for job in _JOBS.values():
            text = json.dumps(job).replace("{id}", event_id)
            for created_at in ("now()", "'infinity'"):
                for state in ("pending", "dead", "published"):
                    for attempts in (0, -1):
                        found.append((event_id, text, created_at, state, attempts))
    return found


async def _refusals(conn: asyncpg.Connection, table: str) -> list[str | None]:
    """For each candidate row, inserted alone and rolled back: None or the refused check's
    name (with SQLSTATE 23514)."""
    outcomes: list[str | None] = []
    for event_id, job, created_at, state, attempts in _candidates():
        stamps = {"pending": "NULL, NULL", "dead": "NULL, now()", "published": "now(), NULL"}
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute(
                f"INSERT INTO {table} (event_id, job, created_at, published_at, dead_at, "
                f"attempts) VALUES ($1, $2, {created_at}, {stamps[state]}, $3)",
                event_id,
                job,
                attempts,
            )
            outcomes.append(None)
        except asyncpg.CheckViolationError as exc:
            named = f'violates check constraint "{exc.constraint_name}"' in str(exc)
            outcomes.append(exc.constraint_name if named and exc.sqlstate == "23514" else "?")
        finally:
            await tx.rollback()
    return outcomes


async def _refusing_the_same(
    migrations: list[Migration], step: Migration, conn: asyncpg.Connection, store: Store
) -> tuple[list[tuple[str, bool]], list[str | None]]:
    """With rows in the outbox, apply `step`: it changes no row, and the 312 candidate rows
    are refused as before, under the same names. Returns the table's CHECK constraints
    after (name, validated) and the refusals."""
    await produce(conn, 3)
    before_rows = await conn.fetch(f"SELECT * FROM {DEFAULT_TABLE} ORDER BY 1")
    before = await _refusals(conn, DEFAULT_TABLE.qualified)
    report = await migrate(store, migrations[: step.version])
    assert [m.version for m in report.applied] == [step.version]
    checks = await conn.fetch(
        "SELECT conname, convalidated FROM pg_constraint "
        "WHERE conrelid = 'relayd.outbox'::regclass AND contype = 'c'"
    )
    assert await conn.fetch(f"SELECT * FROM {DEFAULT_TABLE} ORDER BY 1") == before_rows
    after = await _refusals(conn, DEFAULT_TABLE.qualified)
    assert len(after) == 312
    assert after == before
    return [(r["conname"], r["convalidated"]) for r in checks], before


async def test_0008_one_check_refuses_what_the_eight_refused(empty_database: Database) -> None:
    """An outbox at 0007 holding rows: 0008 replaces its eight CHECK constraints
    by one calling relayd_check_row, changes no row, and refuses exactly the rows the eight
    refused, naming the same check (the first by name, as PostgreSQL tried them), for 312
    rows that break each rule alone and together, in each state that exempts some; an
    UPDATE is checked too."""
    async with _just_before(empty_database, "row_checks") as (migrations, step, conn, store):
        checks, before = await _refusing_the_same(migrations, step, conn, store)
        assert checks == [("relayd_row_checks", False)]
        assert set(before) == {
            None,
            "relayd_attempts_not_negative",
            "relayd_created_at_is_finite",
            "relayd_event_id_is_uuidv7",
            "relayd_job_args_is_array",
            "relayd_job_id_matches_event_id",
            "relayd_job_is_object",
            "relayd_job_meta_is_object",
            "relayd_job_type_is_string",
        }
        with pytest.raises(asyncpg.CheckViolationError) as caught:
            await conn.execute(f"UPDATE {DEFAULT_TABLE} SET job = jsonb_set(job, '{{type}}', '7')")
        assert caught.value.constraint_name == "relayd_job_type_is_string"


async def test_0009_checks_on_write_refuse_what_the_check_refused(
    empty_database: Database,
) -> None:
    """An outbox at 0008 holding rows: 0009 moves the rules from the CHECK constraint to
    triggers on the columns they read, changes no row, and refuses exactly the rows 0008
    refused, under the same names (312 rows breaking each rule alone and together). An
    edit of a job and a redrive of a row that breaks a rule are refused; relayd's own
    updates (a claim, a settle) no longer call the rules' function, and an attempt count
    below zero is still refused."""
    async with _just_before(empty_database, "checks_on_write") as (migrations, step, conn, store):
        checks, _ = await _refusing_the_same(migrations, step, conn, store)
        assert checks == [("relayd_attempts_not_negative", False)]

        with pytest.raises(asyncpg.CheckViolationError) as caught:
            await conn.execute(f"UPDATE {DEFAULT_TABLE} SET job = jsonb_set(job, '{{type}}', '7')")
        assert caught.value.constraint_name == "relayd_job_type_is_string"
        with pytest.raises(asyncpg.CheckViolationError) as caught:
            await conn.execute(f"UPDATE {DEFAULT_TABLE} SET attempts = -1")
        assert caught.value.constraint_name == "relayd_attempts_not_negative"

        # relayd's own updates (a lease, a settle) do not call the rules' function; an
        # edit of the job does (the control that the count is read right).
        await conn.execute("SET track_functions = 'pl'")
        async with conn.transaction():
            await conn.execute(
                f"UPDATE {DEFAULT_TABLE} SET attempts = attempts + 1, last_attempt_at = now(), "
                "available_at = now() + interval '30 seconds'"
            )
            await conn.execute(
                f"UPDATE {DEFAULT_TABLE} SET published_at = now(), lease_owner = NULL "
                "WHERE dead_at IS NULL"
            )
            assert await _check_calls(conn) == 0
            await conn.execute(f"UPDATE {DEFAULT_TABLE} SET job = job")
            assert await _check_calls(conn) == 3  # the rows produce() wrote

        # A dead letter whose job breaks a rule (a dead row is exempt from the shape
        # rules): a redrive makes it pending again, and is refused.
        bad = "018f0000-0000-7000-8000-00000000000b"
        await conn.execute(
            f"INSERT INTO {DEFAULT_TABLE} (event_id, job, dead_at, dead_reason) "
            "VALUES ($1, $2, now(), 'invalid_envelope')",
            bad,
            json.dumps({"id": bad, "type": "a.b", "args": {"not": "an array"}}),
        )
        with pytest.raises(asyncpg.CheckViolationError) as caught:
            await conn.execute(
                f"UPDATE {DEFAULT_TABLE} SET dead_at = NULL, dead_reason = NULL "
                "WHERE event_id = $1",
                bad,
            )
        assert caught.value.constraint_name == "relayd_job_args_is_array"


async def _check_calls(conn: asyncpg.Connection) -> int:
    """How often this transaction called relayd_check_row (with track_functions on)."""
    calls = await conn.fetchval(
        "SELECT pg_stat_get_xact_function_calls('relayd.relayd_check_row'::regproc)"
    )
    return int(calls or 0)


async def test_0012_names_each_row_the_audit_trail_listed(empty_database: Database) -> None:
    """An outbox migrated up to 0011 with two audited actions, one listing its rows and a
    bulk one listing none: 0012 names each listed row in relayd_audit_rows (the bulk one's
    rows were never recorded, so none); running its SQL again adds nothing."""
    async with _just_before(empty_database, "audit_rows") as (migrations, step, conn, store):
        first, second = str(uuid7()), str(uuid7())
        listed = await conn.fetchval(
            "INSERT INTO relayd.relayd_audit (outbox_table, actor, action, event_ids, row_count) "
            "VALUES ('relayd.outbox', 'alice', 'dlq.retry', $1::uuid[], 2) RETURNING id",
            [first, second],
        )
        await conn.execute(
            "INSERT INTO relayd.relayd_audit (outbox_table, actor, action, row_count) "
            "VALUES ('relayd.outbox', 'bob', 'dlq.discard', 500)"
        )
        report = await migrate(store, migrations[: step.version])
        assert [m.version for m in report.applied] == [step.version]
        query = "SELECT event_id::text, audit_id FROM relayd.relayd_audit_rows ORDER BY 1"
        named = [tuple(r) for r in await conn.fetch(query)]
        assert named == sorted([(first, listed), (second, listed)])
        await conn.execute(step.sql(DEFAULT_TABLE))  # again, outside the ledger
        assert [tuple(r) for r in await conn.fetch(query)] == named
