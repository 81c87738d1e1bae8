"""`relayd` reports operator mistakes in one line with the documented exit code."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import Database, run_relayd_blocking, secret_dsn


def test_run_without_sink_url_exits_2(cli_env: dict[str, str], empty_database: Database) -> None:
    """No sink.url: exit 2 naming the key, no traceback."""
    result = run_relayd_blocking("run", env=cli_env | {"RELAYD_DATABASE__DSN": empty_database.dsn})
    assert result.returncode == 2
    assert result.stderr == "relayd: config error: sink.url: required (the OJS server's base URL)\n"


def test_run_on_an_unmigrated_database_exits_1(
    cli_env: dict[str, str], empty_database: Database
) -> None:
    """No outbox table: exit 1 telling the operator to run `relayd migrate`."""
    env = cli_env | {
        "RELAYD_DATABASE__DSN": empty_database.dsn,
        "RELAYD_SINK__URL": "http://127.0.0.1:9",
        "RELAYD_HTTP__ENABLED": "false",
        "RELAYD_LOG__FORMAT": "json",
    }
    result = run_relayd_blocking("run", env=env)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "relayd: outbox table relayd.outbox does not exist: run `relayd migrate`"
    )
    assert "Traceback" not in result.stderr


def test_migrate_with_a_wrong_database_name_exits_2_without_the_password(
    cli_env: dict[str, str], empty_database: Database
) -> None:
    """A DSN the server refuses for good: exit 2 naming database.dsn; no secret in the output."""
    dsn = empty_database.dsn.replace(empty_database.name, "no_such_database")
    dsn = dsn.replace("postgres:@", "postgres:hunter2@")
    result = run_relayd_blocking("migrate", env=cli_env | {"RELAYD_DATABASE__DSN": dsn})
    assert result.returncode == 2
    assert result.stderr.startswith("relayd: config error: database.dsn: ")
    assert "hunter2" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("env", "query", "line"),
    [
        ({"RELAYD_RELAY__LEASE_S": "inf"}, "", "relay.lease_s: Input should be a finite number"),
        (
            {"RELAYD_DATABASE__STATEMENT_TIMEOUT_S": "1e7"},
            "",
            "database.statement_timeout_s: Input should be less than or equal to 2147483",
        ),
        (
            {},
            "sslmode=bogus",
            "database.dsn: sslmode must be one of disable, allow, prefer, require, verify-ca, "
            "verify-full",
        ),
        (
            {},
            "bogus_option=1",
            "database.dsn: the server refused the connection: unrecognized configuration "
            'parameter "bogus_option" (42704)',
        ),
        (
            {"RELAYD_BOGUS__X": "1"},
            "",
            "RELAYD_BOGUS__X: not a setting (relayd reads RELAYD_CONFIG and "
            "RELAYD_<SECTION>__<KEY>, sections: database, outbox, sink, relay, retry, http, log, "
            "cleanup, metrics, console)",
        ),
    ],
)
def test_run_refuses_a_bad_setting_in_one_line(
    cli_env: dict[str, str],
    empty_database: Database,
    env: dict[str, str],
    query: str,
    line: str,
) -> None:
    """A setting that would fail at run time: exit 2, one stderr line naming the key."""
    result = run_relayd_blocking(
        "run",
        env=cli_env
        | env
        | {
            "RELAYD_DATABASE__DSN": secret_dsn(empty_database.dsn, query),
            "RELAYD_SINK__URL": "http://127.0.0.1:9",
            "RELAYD_HTTP__ENABLED": "false",
            "RELAYD_LOG__FORMAT": "json",
        },
    )
    assert result.returncode == 2
    assert result.stderr == f"relayd: config error: {line}\n"
    assert "hunter2" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "cannot read"),
        ("not-a-secret\n", "line 1 does not start with whsec_"),
        ("# only a comment\n", "holds no whsec_ line"),
    ],
)
def test_receiver_names_a_bad_secret_file(
    cli_env: dict[str, str], tmp_path: Path, text: str | None, says: str
) -> None:
    """`relayd receiver` with a missing or malformed secret file: exit 2, one line naming
    --secret-file and what is wrong, and never the file's content."""
    secret = tmp_path / "whsec.txt"
    if text is not None:
        secret.write_text(text)
    result = run_relayd_blocking("receiver", "--secret-file", str(secret), env=cli_env)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("relayd: config error: --secret-file: ")
    assert says in line
    assert "not-a-secret" not in line
