"""`relayd dlq`, `relayd pause` and `relayd resume` as an operator meets them: what they
print, and one line with the documented exit code for every bad input."""

from __future__ import annotations

import json

import asyncpg
import pytest

from relayd.core.outcomes import DeadReason
from relayd.producer import uuid7
from tests.support import Database, produce, run_relayd_blocking

NOT_V7 = "0190c3a2-0000-4000-8000-000000000001"


async def _kill(conn: asyncpg.Connection, event_id: str, reason: str, error: str, age: str) -> None:
    await conn.execute(
        """
        UPDATE relayd.outbox
        SET dead_at = now() - $2::text::interval, dead_reason = $3, last_error = $4, attempts = 3,
            last_attempt_at = now() - $2::text::interval
        WHERE event_id = $1
        """,
        event_id,
        age,
        reason,
        error,
    )


@pytest.fixture
def env(cli_env: dict[str, str], database: Database) -> dict[str, str]:
    return cli_env | {"RELAYD_DATABASE__DSN": database.dsn}


async def test_dlq_list_prints_a_table_newest_first_and_json_for_scripts(
    conn: asyncpg.Connection, env: dict[str, str]
) -> None:
    """`dlq list`: one line per dead letter (reason, queue, type, attempts, and last_error
    whole, its cause at the end included), newest first, filtered; `--json` gives every
    field."""
    [old] = await produce(conn, 1, queue="orders", job_type="order.fulfill")
    [new] = await produce(conn, 1)
    cause = "connect to inventory-db:5432 refused"
    unavailable = "503 Service Unavailable: upstream timed out " + "x" * 100 + ": " + cause
    await _kill(conn, old, "max_attempts", unavailable, "2 hours")
    await _kill(conn, new, "sink_rejected", "400 invalid_request:\nargs must be strings", "1 min")

    result = run_relayd_blocking("dlq", "list", env=env)
    assert (result.returncode, result.stderr) == (0, "")
    header, first, second, footer = result.stdout.splitlines()
    assert header.split() == [
        "EVENT_ID",
        "DEAD_AT",
        "REASON",
        "QUEUE",
        "TYPE",
        "ATTEMPTS",
        "LAST_ERROR",
    ]
    assert first.split()[0] == new
    assert first.split()[2:6] == ["sink_rejected", "default", "test.echo", "3"]
    assert first.endswith("400 invalid_request: args must be strings")  # no line break
    assert second.split()[0] == old
    assert second.split()[2:6] == ["max_attempts", "orders", "order.fulfill", "3"]
    assert second.endswith(f"  {unavailable}")
    assert footer == "2 dead letters, newest first"

    result = run_relayd_blocking(
        "dlq", "list", "--queue", "orders", "--since", "3h", "--json", env=env
    )
    assert result.returncode == 0
    [row] = json.loads(result.stdout)["dead_letters"]
    assert row["event_id"] == old
    assert row["queue"] == "orders"
    assert row["state"] == "dead"
    assert row["last_error"] == unavailable
    assert row["dead_at"].endswith("+00:00")  # a time in JSON: as in every --json

    result = run_relayd_blocking("dlq", "list", "--dead-reason", "conflict", env=env)
    assert (result.returncode, result.stdout) == (0, "no dead letters match\n")


async def test_dlq_show_prints_the_envelope_and_refuses_other_rows(
    conn: asyncpg.Connection, env: dict[str, str]
) -> None:
    """`dlq show ID`: the fields and the envelope pretty-printed; exit 1 in one line for a
    pending row or an unknown id."""
    [dead, waiting] = await produce(conn, 2, queue="orders")
    await _kill(conn, dead, "sink_unprocessable", "422 validation_error", "5 min")

    result = run_relayd_blocking("dlq", "show", dead, env=env)
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    fields = dict(line.split(None, 1) for line in lines[: lines.index("envelope:")])
    assert fields["event_id"] == dead
    assert fields["state"] == "dead letter"
    assert fields["dead_reason"] == "sink_unprocessable"
    assert fields["last_error"] == "422 validation_error"
    assert fields["attempts"] == "3"
    assert fields["discarded_at"] == "-"
    for name in ("created_at", "last_attempt_at", "dead_at"):
        assert fields[name].endswith("Z")
    envelope = "\n".join(lines[lines.index("envelope:") + 1 :])
    assert json.loads(envelope)["id"] == dead
    assert '\n  "id": ' in result.stdout  # indented

    result = run_relayd_blocking("dlq", "show", dead, "--json", env=env)
    assert json.loads(result.stdout)["job"]["options"] == {"queue": "orders"}

    result = run_relayd_blocking("dlq", "show", waiting, env=env)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"relayd: dlq show: {waiting} is not a dead letter: it is pending\n"
    missing = uuid7()
    result = run_relayd_blocking("dlq", "show", missing, env=env)
    assert result.returncode == 1
    assert result.stderr == (
        f"relayd: dlq show: {missing} is not a dead letter: no such row in relayd.outbox\n"
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["dlq", "list", "--since", "yesterday"],
            "dlq list: --since: expected an ISO 8601 time (2025-01-31, 2025-01-31T12:00:00Z, "
            "2025-01-31T13:00+01:00) or a duration before now (30m, 2h, 7d, 1h30m); got "
            "'yesterday'",
        ),
        (["dlq", "list", "--until", "2 hours"], "dlq list: --until: expected an ISO 8601"),
        (["dlq", "list", "--since", "9" * 5000 + "d"], "dlq list: --since: '99999"),
        (["dlq", "list", "--limit", "0"], "dlq list: --limit: must be from 1 to 10000, got 0"),
        (["dlq", "list", "--limit", "ten"], "dlq list: --limit: expected a whole number"),
        (
            ["dlq", "list", "--dead-reason", "max_attempt"],
            "dlq list: --dead-reason: 'max_attempt' is not a dead reason "
            f"({', '.join(reason.value for reason in DeadReason)})",
        ),
        (
            ["dlq", "list", "--reason", "max_attempts"],
            "dlq list: --reason: dlq list records nothing; filter with --dead-reason REASON",
        ),
        (
            ["dlq", "retry", "--all", "--reason", "max_attempts"],
            "dlq retry: --reason: 'max_attempts' names a dead reason, but --reason is the note "
            "the retry records; to select those rows, use --dead-reason max_attempts",
        ),
        (["dlq", "retry", "--all", "--reason", " "], "dlq retry: --reason: must not be empty"),
        (["dlq", "list", "--queue", ""], "dlq list: --queue: must not be empty"),
        (["dlq", "show", "not-a-uuid"], "dlq show: ID: not a UUID: 'not-a-uuid'"),
        (
            ["dlq", "retry"],
            "dlq retry: name the dead letters: IDs, or --all (narrowed by filters)",
        ),
        (["dlq", "retry", "--all", NOT_V7], "dlq retry: give IDs or --all, not both"),
        (
            ["dlq", "retry", NOT_V7, "--queue", "orders"],
            "dlq retry: filters select rows for --all only; with IDs, name every row",
        ),
        (["dlq", "retry", "--all", "--batch-size", "0"], "dlq retry: --batch-size: must be"),
        (["dlq", "retry", "--all", "--actor", " "], "dlq retry: --actor: must not be empty"),
        (
            ["dlq", "discard", "--all"],
            "dlq discard: --reason: required: say why these rows are discarded",
        ),
        (
            ["dlq", "discard", "--all", "--reason", "x", "--dead-reason", "nope"],
            "dlq discard: --dead-reason: 'nope' is not a dead reason",
        ),
        (
            ["pause"],
            "pause: --reason: required: say why, for the audit trail and the other operators",
        ),
        (
            ["pause", "--queue", "*", "--reason", "x"],
            "pause: --queue: leave it out to act on every queue",
        ),
        (["resume", "--queue", "Orders"], "resume: --queue: 'Orders' is not a queue name"),
    ],
)
def test_a_bad_value_exits_2_in_one_line(
    cli_env: dict[str, str], args: list[str], line: str
) -> None:
    """A value the command cannot use: exit 2, one stderr line naming the option, before
    any database is needed."""
    result = run_relayd_blocking(*args, env=cli_env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"relayd: {line}")
    assert result.stderr.count("\n") == 1
    assert result.stderr.endswith("\n")


def test_a_window_that_ends_before_it_starts_exits_2(env: dict[str, str]) -> None:
    """`--since` after `--until` (resolved on the database's clock): exit 2 in one line."""
    result = run_relayd_blocking("dlq", "list", "--since", "1h", "--until", "2h", env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("relayd: dlq list: --since (")
    assert result.stderr.count("\n") == 1


def test_operator_commands_on_an_unmigrated_outbox_exit_1(
    cli_env: dict[str, str], empty_database: Database
) -> None:
    """No outbox table: exit 1 telling the operator to run `relayd migrate`."""
    env = cli_env | {"RELAYD_DATABASE__DSN": empty_database.dsn}
    for args in (["dlq", "list"], ["pause", "--reason", "x"]):
        result = run_relayd_blocking(*args, env=env)
        assert result.returncode == 1
        assert result.stderr == (
            "relayd: outbox table relayd.outbox does not exist: run `relayd migrate`\n"
        )


def test_pause_and_resume_say_what_they_did(env: dict[str, str]) -> None:
    """`pause` writes the pause (a second pause updates its reason) and lists the pauses in
    force; `resume` lifts it; resuming what is not paused says so and exits 0."""
    result = run_relayd_blocking(
        "pause", "--queue", "orders", "--reason", "migration", "--actor", "al", env=env
    )
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0] == (
        "paused queue orders of relayd.outbox: every relay stops claiming it from its next claim"
    )
    assert lines[1] == "paused now:"
    assert lines[2].startswith("  queue orders: migration (by al since ")

    result = run_relayd_blocking(
        "pause", "--queue", "orders", "--reason", "longer", "--actor", "al", "--json", env=env
    )
    data = json.loads(result.stdout)
    assert (data["paused"], data["updated"]) == (True, True)
    assert [p["reason"] for p in data["pauses"]] == ["longer"]

    result = run_relayd_blocking("resume", env=env)
    assert (result.returncode, result.stdout.splitlines()[0]) == (
        0,
        "every queue was not paused: nothing to resume",
    )
    result = run_relayd_blocking("resume", "--queue", "orders", env=env)
    assert result.returncode == 0
    assert result.stdout.startswith("resumed queue orders of relayd.outbox (paused since ")
    assert result.stdout.endswith("by al: longer); idle relays woken\nnothing is paused now\n")


async def test_pausing_a_queue_no_row_uses_warns_but_pauses(
    conn: asyncpg.Connection, env: dict[str, str]
) -> None:
    """`pause --queue Q` for a queue no row routes to, in any state (a typo, or a queue not
    used yet), still pauses it but warns in one stderr line, and in --json's `warning`; a
    queue whose only rows are published is in use: no warning."""
    orders = await produce(conn, 2, queue="orders")
    await conn.execute(
        "UPDATE relayd.outbox SET published_at = now() WHERE event_id = ANY($1::uuid[])", orders
    )
    result = run_relayd_blocking("pause", "--queue", "ordres", "--reason", "deploy", env=env)
    assert result.returncode == 0
    assert result.stderr == (
        "relayd: warning: no row of relayd.outbox routes to queue ordres (all 2 rows read): "
        "paused all the same; if the name is wrong, `relayd resume --queue ordres`\n"
    )
    assert result.stdout.startswith("paused queue ordres of relayd.outbox: ")
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_pauses") == 1

    result = run_relayd_blocking(
        "pause", "--queue", "ordres", "--reason", "deploy", "--json", env=env
    )
    assert result.returncode == 0
    assert json.loads(result.stdout)["warning"].startswith(
        "no row of relayd.outbox routes to queue ordres"
    )
    result = run_relayd_blocking(
        "pause", "--queue", "orders", "--reason", "deploy", "--json", env=env
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout)["warning"] is None
