"""`relayd` reads the configuration file it is told to, says which, and ships its example."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import asyncpg

from tests.support import Database, run_relayd_blocking

ROOT = Path(__file__).resolve().parents[2]


async def test_config_before_the_subcommand_is_used(
    cli_env: dict[str, str], empty_database: Database, tmp_path: Path
) -> None:
    """`relayd --config X migrate` (the form --help shows) reads X, as `migrate --config X`
    does; neither falls back to $RELAYD_CONFIG."""
    config = tmp_path / "outbox.toml"
    config.write_text(f'[database]\ndsn = "{empty_database.dsn}"\n')
    before = run_relayd_blocking("--config", str(config), "migrate", "--json", env=cli_env)
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout)["applied"]
    after = run_relayd_blocking("migrate", "--config", str(config), "--json", env=cli_env)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["applied"] == []
    conn = await asyncpg.connect(empty_database.dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('relayd.outbox') IS NOT NULL")
    finally:
        await conn.close()


def test_a_named_missing_file_is_an_error_wherever_it_is_named(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """`relayd --config /nonexistent config show` exits 2 instead of printing defaults."""
    missing = tmp_path / "nonexistent.toml"
    for argv in (
        ("--config", str(missing), "config", "show"),
        ("config", "show", "--config", str(missing)),
    ):
        result = run_relayd_blocking(*argv, env=cli_env)
        assert result.returncode == 2, argv
        assert result.stderr == f"relayd: config error: config: file not found: {missing}\n"


def test_config_show_says_which_file_it_read(cli_env: dict[str, str], tmp_path: Path) -> None:
    """The TOML output starts with the file it read (or that there was none); with --json,
    stdout stays pure JSON and the file is named on stderr."""
    config = tmp_path / "relayd.toml"
    config.write_text("[relay]\nworkers = 3\n")
    shown = run_relayd_blocking("--config", str(config), "config", "show", env=cli_env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == f"# configuration file: {config}"
    assert tomllib.loads(shown.stdout)["relay"]["workers"] == 3
    as_json = run_relayd_blocking("config", "show", "--json", "--config", str(config), env=cli_env)
    assert json.loads(as_json.stdout)["relay"]["workers"] == 3
    assert as_json.stderr == f"relayd: configuration file: {config}\n"
    env = {key: value for key, value in cli_env.items() if key != "RELAYD_CONFIG"}
    default = run_relayd_blocking("config", "show", env=env)
    assert default.stdout.splitlines()[0] in (
        "# configuration file: /etc/relayd/config.toml",
        "# no configuration file at /etc/relayd/config.toml: defaults and environment only",
    )


def test_config_example_prints_the_shipped_example(cli_env: dict[str, str]) -> None:
    """`relayd config example` prints config.example.toml, which loads as the defaults."""
    result = run_relayd_blocking("config", "example", env=cli_env)
    assert result.returncode == 0
    assert result.stdout == (ROOT / "config.example.toml").read_text()


def test_a_relayd_variable_that_is_no_setting_exits_2(cli_env: dict[str, str]) -> None:
    """A typo such as RELAYD_RELAY_WORKERS (one underscore) is refused in one line naming it,
    with the setting it resembles, instead of leaving relay.workers at its default."""
    result = run_relayd_blocking("config", "show", env=cli_env | {"RELAYD_RELAY_WORKERS": "8"})
    assert result.returncode == 2
    assert result.stderr.startswith(
        "relayd: config error: RELAYD_RELAY_WORKERS: not a setting "
        "(did you mean RELAYD_RELAY__WORKERS? "
    )
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""
    # The test suite's own prefix is left alone.
    result = run_relayd_blocking("config", "show", env=cli_env | {"RELAYD_TEST_DSN": "x"})
    assert result.returncode == 0, result.stderr
