"""`relayd keys` as an operator meets it: the parked keys listed (a table, and JSON that parses
whole), each action's line and exit code, the refusal of a key that is not parked, one line
with exit 2 for every bad input; `relayd status` showing parked keys; and `relayd dlq retry`
refusing to deliver an ordered row after later rows of its key."""

from __future__ import annotations

import json

import asyncpg
import pytest

from tests.support import Database, insert_keyed, park_key, run_relayd_blocking


@pytest.fixture
def env(cli_env: dict[str, str], database: Database) -> dict[str, str]:
    return cli_env | {"RELAYD_DATABASE__DSN": database.dsn}


async def _audit(conn: asyncpg.Connection) -> list[tuple[str, str, str | None]]:
    rows = await conn.fetch("SELECT action, actor, reason FROM relayd.relayd_audit ORDER BY id")
    return [(r["action"], r["actor"], r["reason"]) for r in rows]


async def test_keys_list_shows_the_parked_keys_with_their_heads(
    conn: asyncpg.Connection, env: dict[str, str]
) -> None:
    """One line per parked key, parked longest first: key, route, when and for how long,
    the head, its attempts, the rows waiting behind it, the reason and the error; a key
    whose rows flow is not listed. `--json` gives every field; `--route` narrows."""
    old = await park_key(conn, "order-1", 4, parked_for="3 hours")
    new = await park_key(
        conn, "mail-7", 1, job_type="mail.send", reason="sink_rejected", error="400 bad\naddress"
    )
    await insert_keyed(conn, "flowing", 2)

    result = run_relayd_blocking("keys", "list", env=env)
    assert (result.returncode, result.stderr) == (0, "")
    header, first, second, footer = result.stdout.splitlines()
    assert header.split() == [
        "KEY",
        "ROUTE",
        "PARKED_AT",
        "FOR",
        "HEAD",
        "ATTEMPTS",
        "WAITING",
        "REASON",
        "ERROR",
    ]
    cells = first.split()
    assert cells[:2] == ["order-1", "order.fulfill"]
    assert cells[2].endswith("Z")
    assert cells[3].startswith("3h")
    assert cells[4:8] == [old[0], "5", "3", "max_attempts"]
    assert first.endswith("  503 Service Unavailable: inventory-db is down")
    assert second.split()[:2] == ["mail-7", "mail.send"]
    assert second.split()[4:8] == [new[0], "5", "0", "sink_rejected"]
    assert second.endswith("  400 bad address")  # one line
    assert footer == "2 parked keys, parked longest first (keys whose rows flow are not listed)"

    result = run_relayd_blocking("keys", "list", "--parked", "--json", env=env)
    assert (result.returncode, result.stderr) == (0, "")
    listed = json.loads(result.stdout)["parked_keys"]
    assert [k["key"] for k in listed] == ["order-1", "mail-7"]
    assert listed[0] | {"parked_at": None, "parked_age_s": None, "last_attempt_at": None} == {
        "key": "order-1",
        "route": "order.fulfill",
        "parked_at": None,
        "parked_age_s": None,
        "event_id": old[0],
        "head_state": "pending",
        "reason": "max_attempts",
        "error": "503 Service Unavailable: inventory-db is down",
        "attempts": 5,
        "last_attempt_at": None,
        "rows_waiting": 3,
        "rows_waiting_capped": False,
    }
    assert listed[0]["parked_at"].endswith("+00:00")
    assert listed[0]["parked_age_s"] >= 3 * 3600

    result = run_relayd_blocking("keys", "list", "--route", "mail.send", "--json", env=env)
    assert [k["key"] for k in json.loads(result.stdout)["parked_keys"]] == ["mail-7"]
    result = run_relayd_blocking("keys", "list", "--route", "invoice.render", env=env)
    assert (result.returncode, result.stdout) == (0, "no key is parked on route invoice.render\n")


async def test_each_action_says_what_it_did_and_writes_one_audit_row(
    conn: asyncpg.Connection, env: dict[str, str]
) -> None:
    """retry, skip and release: exit 0, one line naming the key, its head and the audit row
    (or, with --json, one document); a dry run first changes nothing."""
    a = await park_key(conn, "a", 2)
    b = await park_key(conn, "b", 2, reason="sink_rejected")
    c = await park_key(conn, "c", 2)

    result = run_relayd_blocking("keys", "retry", "a", "--dry-run", "--actor", "al", env=env)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"dry run, nothing changed: would retry key a (route order.fulfill): its head {a[0]} "
        "has its attempts back (5 -> 0) and is the next row of the key the relays take\n"
    )
    assert await _audit(conn) == []

    result = run_relayd_blocking(
        "keys", "retry", "a", "--reason", "db back", "--actor", "al", env=env
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith(f"retried key a (route order.fulfill): its head {a[0]} has")
    assert result.stdout.endswith("; audit #1 by al\n")

    result = run_relayd_blocking(
        "keys", "skip", "b", "--reason", "cancelled", "--actor", "al", "--json", env=env
    )
    assert (result.returncode, result.stderr) == (0, "")
    data = json.loads(result.stdout)
    assert (data["action"], data["key"], data["event_id"], data["head_state"]) == (
        "keys.skip",
        "b",
        b[0],
        "dead",
    )
    assert (data["parked"]["reason"], data["audit_id"], data["dry_run"]) == (
        "sink_rejected",
        2,
        False,
    )
    assert data["last_error"].startswith("skipped by an operator: ")

    result = run_relayd_blocking("keys", "release", "c", "--actor", "al", env=env)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"released key c (route order.fulfill): its head {c[0]} is tried again with its 5 "
        "attempts: one more failure parks the key again; audit #3 by al\n"
    )
    assert await _audit(conn) == [
        ("keys.retry", "al", "db back"),
        ("keys.skip", "al", "cancelled"),
        ("keys.release", "al", None),
    ]
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_parked_keys") == 0
    result = run_relayd_blocking("keys", "list", env=env)
    assert (result.returncode, result.stdout) == (0, "no key is parked\n")


async def test_a_key_that_is_not_parked_exits_1_and_changes_nothing(
    conn: asyncpg.Connection, env: dict[str, str]
) -> None:
    await insert_keyed(conn, "flowing", 1)
    for verb in (["retry"], ["skip", "--reason", "x"], ["release"]):
        result = run_relayd_blocking("keys", verb[0], "flowing", *verb[1:], "--json", env=env)
        assert (result.returncode, result.stdout) == (1, "")
        assert result.stderr == (
            f"relayd: keys {verb[0]}: key flowing is not parked in relayd.outbox: nothing "
            "changed (`relayd keys list` shows the parked keys)\n"
        )
    assert await _audit(conn) == []


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["keys", "skip", "k"],
            "keys skip: --reason: required: say why this row may be passed over",
        ),
        (["keys", "skip", "k", "--reason", " "], "keys skip: --reason: must not be empty"),
        (["keys", "retry", ""], "keys retry: KEY: must not be empty"),
        (
            ["keys", "release", "k" * 257],
            "keys release: KEY: a key is at most 256 characters, got 257",
        ),
        (["keys", "retry", "k", "--actor", ""], "keys retry: --actor: must not be empty"),
        (["keys", "list", "--limit", "0"], "keys list: --limit: must be from 1 to 10000, got 0"),
        (["keys", "list", "--route", "Bad Type"], "keys list: --route: 'Bad Type' is not an event"),
    ],
)
def test_a_bad_value_exits_2_in_one_line(
    cli_env: dict[str, str], args: list[str], line: str
) -> None:
    result = run_relayd_blocking(*args, env=cli_env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"relayd: {line}")
    assert result.stderr.count("\n") == 1


async def test_status_shows_the_parked_keys(conn: asyncpg.Connection, env: dict[str, str]) -> None:
    """`relayd status`: how many keys are parked, the oldest with their route, age and
    reason; `--json` the same under `parked_keys`."""
    await park_key(conn, "order-1", 2, parked_for="2 hours")
    result = run_relayd_blocking("status", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = lines.index("Parked keys: 1 ordered key whose rows wait for an operator")
    assert lines[at + 1].split() == ["key", "route", "parked", "for", "reason"]
    assert lines[at + 2].split()[:2] == ["order-1", "order.fulfill"]
    assert lines[at + 2].split()[-1] == "max_attempts"
    result = run_relayd_blocking("status", "--json", env=env)
    parked = json.loads(result.stdout)["parked_keys"]
    assert (parked["count"], parked["by_route"]) == (1, [{"route": "order.fulfill", "keys": 1}])
    assert parked["oldest_age_s"] >= 7200
    assert [(p["key"], p["reason"]) for p in parked["oldest"]] == [("order-1", "max_attempts")]


async def test_dlq_retry_refuses_an_ordered_row_whose_key_moved_on(
    conn: asyncpg.Connection, env: dict[str, str]
) -> None:
    """A dead letter of key k whose two later rows were delivered: `dlq retry ID` and
    `dlq retry --all` exit 1, change nothing and say why; `--out-of-order` redrives it."""
    first, *later = await insert_keyed(conn, "k", 3)
    await conn.execute(
        "UPDATE relayd.outbox SET dead_at = now() - interval '1 hour', "
        "dead_reason = 'sink_rejected', attempts = 1 WHERE event_id = $1",
        first,
    )
    await conn.execute(
        "UPDATE relayd.outbox SET published_at = now() WHERE event_id = ANY($1::uuid[])", later
    )
    refusal = (
        "relayd: dlq retry: refused, nothing changed: 1 dead letter of ordered keys would be "
        "delivered after later rows of their key; --out-of-order redrives them all the same\n"
    )
    for selection in ([first], ["--all"]):
        result = run_relayd_blocking("dlq", "retry", *selection, env=env)
        assert (result.returncode, result.stderr) == (1, refusal)
        assert (
            result.stdout.splitlines()[1] == f"  {first} (key k): 2 later rows of its key delivered"
        )
    result = run_relayd_blocking("dlq", "retry", "--all", "--json", env=env)
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert (data["refused"], data["out_of_order_total"], data["matched"]) == ("out_of_order", 1, 0)
    assert data["out_of_order"] == [{"event_id": first, "key": "k", "delivered_after": 2}]
    assert await conn.fetchval("SELECT count(*) FROM relayd.relayd_audit") == 0

    result = run_relayd_blocking("dlq", "retry", first, "--out-of-order", "--actor", "al", env=env)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("redrove 1 dead letter in 1 batch; audit #1 by al")
    row = await conn.fetchrow(
        "SELECT dead_at, available_at = 'infinity' AS waiting FROM relayd.outbox "
        "WHERE event_id = $1",
        first,
    )
    assert row is not None
    assert (row["dead_at"], row["waiting"]) == (None, True)
    filters = await conn.fetchval("SELECT filters::text FROM relayd.relayd_audit")
    assert json.loads(filters) == {"named_ids": 1, "out_of_order": True}
