"""Dead letters on real PostgreSQL: listing by each filter, redrive (reconciled with a GET
before any POST), discard (kept), rows the table's checks refuse, bounded batches, dry runs
and the audit trail."""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import asyncpg
import pytest

from relayd.core.rows import ClaimedRow
from relayd.operator.dlq_actions import DlqRequest, Selection, act, walk_end
from relayd.operator.dlq_filters import FilterArgs, parse_when
from relayd.producer import enqueue_many, uuid7
from relayd.store import Store
from relayd.store.records import AuditEntry, DeadLetterFilter, DlqAction, RowOutcome
from relayd.testing.emulator import EmulatorConfig, start_emulator
from tests.support import Database, produce, relay_settings, run_relayd, run_until_idle

ACTOR = AuditEntry(actor="test-operator", action=DlqAction.REDRIVE.value)


async def _kill(
    conn: asyncpg.Connection,
    ids: list[str],
    *,
    reason: str = "max_attempts",
    error: str = "503 Service Unavailable",
    minutes_ago: float = 1.0,
) -> None:
    """Dead-letter rows the way the relay does, after five attempts."""
    await conn.execute(
        """
        UPDATE relayd.outbox
        SET dead_at = now() - make_interval(secs => $2 * 60), dead_reason = $3,
            last_error = $4, attempts = 5, last_attempt_at = now() - interval '2 hours'
        WHERE event_id = ANY($1::uuid[])
        """,
        ids,
        minutes_ago,
        reason,
        error,
    )


async def _insert_dead(conn: asyncpg.Connection, event_id: str, job: Any, **columns: str) -> None:
    """A dead row the checks would refuse as a pending one (they exempt dead rows)."""
    names = ", ".join(["event_id", "job", "dead_at", "dead_reason", "last_error", *columns])
    values = ", ".join(
        ["$1", "$2::jsonb", "now()", "'invalid_envelope'", "'bad'", *columns.values()]
    )
    await conn.execute(
        f"INSERT INTO relayd.outbox ({names}) VALUES ({values})", event_id, json.dumps(job)
    )


async def _row(conn: asyncpg.Connection, event_id: str) -> asyncpg.Record:
    row = await conn.fetchrow("SELECT * FROM relayd.outbox WHERE event_id = $1", event_id)
    assert row is not None
    return row


async def _audit(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await conn.fetch(
        "SELECT actor, action, filters, event_ids, row_count, reason FROM relayd.relayd_audit"
        " ORDER BY id"
    )
    return rows


async def _snapshot(conn: asyncpg.Connection) -> list[tuple[Any, ...]]:
    rows = await conn.fetch("SELECT * FROM relayd.outbox ORDER BY event_id")
    return [tuple(r.values()) for r in rows]


async def _redrive_all(
    store: Store,
    *,
    batch_size: int = 500,
    dry_run: bool = False,
    filters: DeadLetterFilter | None = None,
) -> Any:
    now = await store.operator_now()
    wanted = filters or DeadLetterFilter()
    selection = Selection(None, wanted, walk_end(wanted, now))
    request = DlqRequest(DlqAction.REDRIVE, selection, ACTOR, batch_size, dry_run=dry_run)
    return await act(store, request)


async def test_list_narrows_by_each_filter(conn: asyncpg.Connection, store: Store) -> None:
    """`dlq list` selects by effective queue, type, dead reason, dead_at window, last_error
    text and discarded state, newest first, at most `limit` rows."""
    [a1] = await produce(conn, 1, queue="alpha")
    [a2] = await produce(conn, 1, queue="alpha", job_type="mail.send")
    [d1] = await produce(conn, 1)  # the default queue
    gateway = {"id": uuid7(), "type": "test.echo", "args": [], "queue": "beta"}
    await enqueue_many(conn, [gateway])
    g1 = str(gateway["id"])
    [gone] = await produce(conn, 1)
    await produce(conn, 1)  # pending: never a dead letter
    await _kill(conn, [a1], error="503 Upstream down", minutes_ago=180)
    await _kill(conn, [a2], reason="sink_rejected", error="400 invalid_request", minutes_ago=90)
    await _kill(conn, [d1], reason="sink_unprocessable", error="422", minutes_ago=10)
    await _kill(conn, [g1], reason="conflict", error="differs: args", minutes_ago=5)
    await _kill(conn, [gone], minutes_ago=1)
    await conn.execute(
        "UPDATE relayd.outbox SET discarded_at = now(), discard_reason = 'x' WHERE event_id = $1",
        gone,
    )
    now = await store.operator_now()
    hundred_minutes_ago = (await conn.fetchval("SELECT now() - interval '100 minutes'")).isoformat()

    async def listed(limit: int = 50, include_discarded: bool = False, **given: Any) -> list[str]:
        wanted = FilterArgs(**given).resolve(now)
        rows = await store.list_dead_letters(
            wanted, limit=limit, include_discarded=include_discarded
        )
        return [r.event_id for r in rows]

    assert await listed() == [g1, d1, a2, a1]
    assert await listed(limit=2) == [g1, d1]
    assert await listed(include_discarded=True) == [gone, g1, d1, a2, a1]
    assert await listed(queue="alpha") == [a2, a1]
    assert await listed(queue="beta") == [g1]  # a top-level queue (the gateway variant)
    assert await listed(queue="default") == [d1]
    assert await listed(type="mail.send") == [a2]
    assert await listed(dead_reason="sink_rejected") == [a2]
    assert await listed(since=parse_when("2h", "--since")) == [g1, d1, a2]
    assert await listed(until=parse_when("2h", "--until")) == [a1]
    assert await listed(since=parse_when(hundred_minutes_ago, "--since")) == [g1, d1, a2]
    assert await listed(
        since=parse_when("4h", "--since"), until=parse_when(hundred_minutes_ago, "--until")
    ) == [a1]
    assert await listed(error_contains="UPSTREAM") == [a1]
    assert await listed(queue="alpha", dead_reason="max_attempts") == [a1]


@pytest.mark.parametrize("clear_last_attempt", [False, True], ids=["redrive", "control"])
async def test_redrive_of_a_row_the_sink_holds_creates_no_second_job(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str], clear_last_attempt: bool
) -> None:
    """Redriving a dead row that the sink already holds creates no second job on a sink that
    overwrites a reused id; an audit row records it. (Control: with last_attempt_at cleared
    by hand, the same row is POSTed and overwrites the job.)"""
    [event_id] = await produce(conn, 1)
    job = json.loads(await conn.fetchval("SELECT job::text FROM relayd.outbox"))
    async with await start_emulator(EmulatorConfig(duplicate_mode="overwrite")) as sink:
        # The relay's POST was stored, but its answer lost, every time: dead after 5.
        async with aiohttp.ClientSession() as http:
            response = await http.post(f"{sink.url}/ojs/v1/jobs", json=job)
            assert response.status == 201
        await _kill(conn, [event_id], error="no answer within the attempt deadline (2.0s)")
        attempted_at = await conn.fetchval("SELECT last_attempt_at FROM relayd.outbox")
        code, out, err = await run_relayd(
            "dlq",
            "retry",
            event_id,
            "--actor",
            "alice",
            env=cli_env | {"RELAYD_DATABASE__DSN": database.dsn},
        )
        assert (code, err) == (0, "")
        assert out.startswith("redrove 1 dead letter in 1 batch; audit #1 by alice\n")
        row = await _row(conn, event_id)
        assert row["dead_at"] is None
        assert row["dead_reason"] is None
        assert row["attempts"] == 0
        assert row["last_attempt_at"] == attempted_at  # kept: the next claim GETs first
        if clear_last_attempt:
            await conn.execute("UPDATE relayd.outbox SET last_attempt_at = NULL")
        daemon = await run_until_idle(relay_settings(database.dsn, sink.url))
        ledger = sink.emulator.ledger()
    entry = ledger[event_id]
    published = await conn.fetchval("SELECT published_at IS NOT NULL FROM relayd.outbox")
    assert published
    reconciled = daemon.metrics.registry.get_sample_value(
        "relayd_outcomes_total", {"outcome": "reconciled"}
    )
    if clear_last_attempt:
        assert (entry.created, entry.overwrites) == (2, 1)
        return
    assert (entry.created, entry.overwrites) == (1, 0)
    assert reconciled == 1
    assert [tuple(r.values()) for r in await _audit(conn)] == [
        ("alice", "dlq.retry", '{"named_ids": 1}', [uuid.UUID(event_id)], 1, None)
    ]


async def test_redrive_skips_rows_the_checks_refuse_and_reports_each(
    conn: asyncpg.Connection, store: Store
) -> None:
    """A row the table's checks would refuse as pending is skipped with the check's name;
    the other rows of its batch are redriven."""
    good = await produce(conn, 3)
    await _kill(conn, good)
    not_v7 = "0190c3a2-0000-4000-8000-000000000001"
    await _insert_dead(conn, not_v7, {"id": not_v7, "type": "t.x", "args": []})
    bad: dict[str, Any] = {
        "relayd_job_is_object": ["not", "an", "object"],
        "relayd_job_args_is_array": {"type": "t.x", "args": {"n": 1}},
        "relayd_job_type_is_string": {"type": 7, "args": []},
        "relayd_job_meta_is_object": {"type": "t.x", "args": [], "meta": []},
    }
    ids = {"relayd_event_id_is_uuidv7": not_v7}
    for check, job in bad.items():
        event_id = uuid7()
        if isinstance(job, dict):
            job["id"] = event_id
        await _insert_dead(conn, event_id, job)
        ids[check] = event_id
    infinite = uuid7()
    await _insert_dead(
        conn, infinite, {"id": infinite, "type": "t.x", "args": []}, created_at="'infinity'"
    )
    ids["relayd_created_at_is_finite"] = infinite

    summary = await _redrive_all(store)

    assert summary.batches == 1
    assert summary.counts == {RowOutcome.REDRIVEN: 3, RowOutcome.REFUSED: len(ids)}
    refused = {r.event_id: r.detail for r in summary.skipped}
    assert set(refused) == set(ids.values())
    for check, event_id in ids.items():
        assert f"(check {check})" in str(refused[event_id])
    pending = await conn.fetch(
        "SELECT event_id::text FROM relayd.outbox WHERE dead_at IS NULL ORDER BY 1"
    )
    assert [r[0] for r in pending] == sorted(good)


async def test_a_check_redrive_does_not_know_refuses_its_row_not_the_batch(
    conn: asyncpg.Connection, store: Store
) -> None:
    """A check added by the table's owner that refuses one row: that row is skipped, named
    by the check; the rest of the batch is redriven."""
    good = await produce(conn, 3)
    [forbidden] = await produce(conn, 1, job_type="test.forbidden")
    await _kill(conn, [*good, forbidden])
    await conn.execute(
        "ALTER TABLE relayd.outbox ADD CONSTRAINT site_no_forbidden_jobs "
        "CHECK (dead_at IS NOT NULL OR job->>'type' <> 'test.forbidden')"
    )
    summary = await _redrive_all(store)
    assert summary.counts == {RowOutcome.REDRIVEN: 3, RowOutcome.REFUSED: 1}
    [skipped] = summary.skipped
    assert skipped.event_id == forbidden
    assert "site_no_forbidden_jobs" in str(skipped.detail)
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NULL") == 3


async def test_bulk_actions_run_in_bounded_batches_of_their_own_transactions(
    conn: asyncpg.Connection, store: Store
) -> None:
    """1,200 dead rows with a batch of 500: three transactions of at most 500 rows each,
    every row redriven once, one audit row counting 1,200 (too many to list there) and one
    row of relayd_audit_rows per row redriven, each naming that audit row."""
    ids = await produce(conn, 1200)
    # Dead-letter times spread out and tied in pairs: the keyset cursor orders by
    # (dead_at, event_id), so ties are walked without a row missed or met twice.
    await conn.execute(
        """
        UPDATE relayd.outbox AS o
        SET dead_at = now() - make_interval(secs => (n / 2)::float8), dead_reason = 'max_attempts',
            last_attempt_at = now()
        FROM (SELECT event_id, row_number() OVER (ORDER BY event_id) AS n FROM relayd.outbox) AS r
        WHERE o.event_id = r.event_id
        """
    )
    await conn.execute(
        """
        CREATE TABLE batch_log (txid bigint NOT NULL, event_id uuid NOT NULL);
        CREATE FUNCTION log_batch() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO batch_log VALUES (txid_current(), NEW.event_id);
            RETURN NULL;
        END $$;
        CREATE TRIGGER log_batch AFTER UPDATE ON relayd.outbox
            FOR EACH ROW EXECUTE FUNCTION log_batch();
        """
    )
    dry = await _redrive_all(store, batch_size=500, dry_run=True)
    assert await conn.fetchval("SELECT count(*) FROM batch_log") == 0  # rolled back
    summary = await _redrive_all(store, batch_size=500)

    assert (dry.counts, dry.batches) == (summary.counts, summary.batches)
    assert summary.counts == {RowOutcome.REDRIVEN: 1200}
    assert summary.batches == 3
    sizes = await conn.fetch("SELECT count(*) AS n FROM batch_log GROUP BY txid ORDER BY n DESC")
    assert [r["n"] for r in sizes] == [500, 500, 200]
    logged = await conn.fetch("SELECT DISTINCT event_id::text FROM batch_log")
    assert {r[0] for r in logged} == set(ids)
    assert await conn.fetchval("SELECT count(*) FROM relayd.outbox WHERE dead_at IS NULL") == 1200
    [audit] = await _audit(conn)
    assert (audit["action"], audit["row_count"], audit["event_ids"]) == ("dlq.retry", 1200, None)
    named = await conn.fetch("SELECT event_id::text, audit_id FROM relayd.relayd_audit_rows")
    assert sorted(r["event_id"] for r in named) == sorted(ids)
    assert {r["audit_id"] for r in named} == {
        await conn.fetchval("SELECT id FROM relayd.relayd_audit")
    }


async def test_a_filtered_walk_reads_the_index_in_bounded_windows(
    conn: asyncpg.Connection, store: Store
) -> None:
    """With filters, each batch still reads at most `batch_size` index entries, from
    `--since` on, and acts on those the filters select; the walk misses none of them."""
    ids = await produce(conn, 60) + await produce(conn, 60, job_type="mail.send")
    # Alternate the two types along dead_at, one row a second (n = 1 to 120).
    await conn.execute(
        """
        UPDATE relayd.outbox AS o
        SET dead_at = '2025-01-01T00:00:00Z'::timestamptz + make_interval(secs => r.n),
            dead_reason = 'max_attempts'
        FROM (SELECT event_id,
                     row_number() OVER (PARTITION BY job->>'type' ORDER BY event_id) * 2
                     - (job->>'type' = 'mail.send')::int AS n
              FROM relayd.outbox) AS r
        WHERE o.event_id = r.event_id
        """
    )
    assert len(ids) == 120
    since = parse_when("2025-01-01T00:00:31Z", "--since")
    wanted = FilterArgs(type="mail.send", since=since).resolve(await store.operator_now())
    summary = await _redrive_all(store, batch_size=20, filters=wanted)
    # From n = 31: 90 rows in dead_at order, half of them mail.send, in windows of 20.
    assert summary.counts == {RowOutcome.REDRIVEN: 45}
    assert summary.batches == 5
    redriven = await conn.fetch(
        "SELECT DISTINCT job->>'type' AS type FROM relayd.outbox WHERE dead_at IS NULL"
    )
    assert [r["type"] for r in redriven] == ["mail.send"]


async def test_a_bulk_action_leaves_rows_dead_lettered_after_it_started(
    conn: asyncpg.Connection, store: Store
) -> None:
    """`--all` acts on the dead letters as they were when the command started: a row dead
    after that (here, stamped in the future) is left for the next run."""
    before, later = await produce(conn, 2)
    await _kill(conn, [before])
    await _kill(conn, [later], minutes_ago=-5)
    summary = await _redrive_all(store)
    assert summary.counts == {RowOutcome.REDRIVEN: 1}
    assert await conn.fetchval(
        "SELECT dead_at IS NOT NULL FROM relayd.outbox WHERE event_id = $1", later
    )


async def test_a_redrive_lasts_until_an_attempt_may_have_sent_the_row(
    conn: asyncpg.Connection, store: Store
) -> None:
    """The claim reports a redriven row as redriven, and still as claimed before (so the OJS
    sink reconciles it first), until an attempt may have sent it: a claim handed back
    unstarted (release) keeps the redrive, a settled attempt uses it up. A row attempted
    before and never redriven is never reported so."""
    redriven, plain = await produce(conn, 2)
    await _kill(conn, [redriven])
    await conn.execute(
        "UPDATE relayd.outbox SET attempts = 1, last_attempt_at = now() - interval '1 hour' "
        "WHERE event_id = $1",
        plain,
    )
    now = await store.operator_now()
    selection = Selection([redriven], DeadLetterFilter(), now)
    assert (await act(store, DlqRequest(DlqAction.REDRIVE, selection, ACTOR, 500))).changed == 1

    async def claim() -> tuple[uuid.UUID, list[ClaimedRow], dict[str, tuple[bool, bool]]]:
        """A claim: its owner, its rows, and (redriven, claimed before) by id."""
        owner = uuid.uuid4()
        rows = await store.claim(10, owner, 30.0)
        return owner, rows, {row.event_id: (row.redriven, row.claimed_before) for row in rows}

    owner, rows, seen = await claim()
    assert seen == {redriven: (True, True), plain: (False, True)}
    await store.release(owner, [r.event_id for r in rows], [r.previous_attempt_at for r in rows])
    owner, rows, seen = await claim()
    assert seen == {redriven: (True, True), plain: (False, True)}
    await store.settle_retry(
        owner,
        [r.event_id for r in rows],
        [0.0, 0.0],
        ["timeout", "timeout"],
        [0, 0],
        [True, True],
        [r.previous_attempt_at for r in rows],
    )
    _, _, seen = await claim()
    assert seen == {redriven: (False, True), plain: (False, True)}


async def test_discard_keeps_rows_and_takes_them_out_of_the_dead_letter_queue(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str], store: Store
) -> None:
    """Discarded rows stay in the table, marked; `dlq list` and `retry --all` pass them by;
    `dlq list --include-discarded` shows them; a retry naming one redrives it, its
    `--reason` recorded in the audit trail as the discard's is."""
    kept, dropped = await produce(conn, 2)
    await _kill(conn, [kept, dropped])
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}
    code, out, err = await run_relayd(
        "dlq", "discard", dropped, "--reason", "re-sent as a new job", "--actor", "bob", env=env
    )
    assert (code, err) == (0, "")
    assert out.startswith("discarded 1 dead letter in 1 batch; audit #1 by bob\n")
    row = await _row(conn, dropped)
    assert row["dead_at"] is not None
    assert row["discarded_at"] is not None
    assert row["discard_reason"] == "re-sent as a new job"

    listed = await store.list_dead_letters(DeadLetterFilter(), limit=50, include_discarded=False)
    assert [r.event_id for r in listed] == [kept]
    everything = await store.list_dead_letters(DeadLetterFilter(), limit=50, include_discarded=True)
    assert {r.event_id for r in everything} == {kept, dropped}

    summary = await _redrive_all(store)
    assert summary.counts == {RowOutcome.REDRIVEN: 1}  # the kept one only
    code, out, err = await run_relayd(
        "dlq", "retry", dropped, "--actor", "carol", "--reason", "discarded by mistake", env=env
    )
    assert code == 0, out + err
    row = await _row(conn, dropped)
    assert (row["dead_at"], row["discarded_at"], row["discard_reason"]) == (None, None, None)
    actions = [(r["actor"], r["action"], r["row_count"], r["reason"]) for r in await _audit(conn)]
    assert actions == [
        ("bob", "dlq.discard", 1, "re-sent as a new job"),
        ("test-operator", "dlq.retry", 1, None),
        ("carol", "dlq.retry", 1, "discarded by mistake"),
    ]


async def test_retry_all_selects_by_dead_reason_and_records_its_own_reason(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    """`dlq retry --all --dead-reason R --reason TEXT`: the filter picks the rows dead for
    R, and TEXT is the note in the audit row, beside the filter it applied."""
    exhausted, refused = await produce(conn, 2)
    await _kill(conn, [exhausted])
    await _kill(conn, [refused], reason="sink_rejected")
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}
    code, out, err = await run_relayd(
        "dlq", "retry", "--all", "--dead-reason", "max_attempts", "--reason", "sink fixed",
        "--actor", "dana", "--json", env=env,
    )  # fmt: skip
    assert (code, err) == (0, ""), out
    assert json.loads(out)["counts"] == {"redriven": 1}
    assert (await _row(conn, exhausted))["dead_at"] is None
    assert (await _row(conn, refused))["dead_reason"] == "sink_rejected"
    [audit] = await _audit(conn)
    assert (audit["actor"], audit["action"], audit["reason"]) == ("dana", "dlq.retry", "sink fixed")
    assert json.loads(audit["filters"])["dead_reason"] == "max_attempts"


async def test_retry_all_dry_run_changes_nothing_and_prints_what_it_would_do(
    database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    """`relayd dlq retry --all --dry-run` changes nothing and prints what it would do: the
    same counts and skipped rows as the real run that follows."""
    ids = await produce(conn, 5)
    await _kill(conn, ids)
    not_v7 = "0190c3a2-0000-4000-8000-000000000001"
    await _insert_dead(conn, not_v7, {"id": not_v7, "type": "t.x", "args": []})
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn}
    before = await _snapshot(conn)

    code, out, err = await run_relayd("dlq", "retry", "--all", "--dry-run", env=env)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        "dry run, nothing changed: would redrive 5 dead letters in 1 batch, would skip 1"
    )
    assert lines[1].startswith("  would redrive: ")
    assert set(lines[1].removeprefix("  would redrive: ").split(", ")) == set(ids)
    assert lines[2] == (
        f"  would skip {not_v7}: event_id is not a UUIDv7 (check relayd_event_id_is_uuidv7)"
    )
    code, dry_json, _ = await run_relayd("dlq", "retry", "--all", "--dry-run", "--json", env=env)
    assert code == 0
    assert await _snapshot(conn) == before
    assert await _audit(conn) == []

    code, real_json, _ = await run_relayd("dlq", "retry", "--all", "--json", env=env)
    assert code == 0
    dry, real = json.loads(dry_json), json.loads(real_json)
    assert dry["dry_run"] is True
    assert real["dry_run"] is False
    for key in ("matched", "counts", "skipped", "batches"):
        assert dry[key] == real[key], key
    assert set(dry["changed_ids"]) == set(real["changed_ids"]) == set(ids)
    assert (dry["audit_id"], real["audit_id"]) == (None, 1)
    assert len(await _audit(conn)) == 1
