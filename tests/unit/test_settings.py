"""Configuration: TOML + environment + secret files, one-line errors, redaction."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from relayd.cli import main
from relayd.config.dsn import redact_dsn
from relayd.config.sections import DatabaseSettings
from relayd.core.errors import ConfigError
from relayd.core.rows import OutboxTable
from relayd.settings import Settings, load_settings
from relayd.store import _server_settings
from tests.support import SinkHealthRecord, clear_relayd_env, ojs_settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config.example.toml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RELAYD_* variable of the developer's shell leaks into these tests."""
    clear_relayd_env(monkeypatch)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "relayd.toml"
    path.write_text(text)
    return path


def test_example_config_loads_and_documents_every_key() -> None:
    """config.example.toml is valid and lists every setting (commented out if unset)."""
    settings = load_settings(EXAMPLE)
    assert settings == Settings()
    text = EXAMPLE.read_text()
    documented = tomllib.loads(text)
    for section in Settings.model_fields:
        assert f"[{section}]" in text
        # The section's model as loaded: for [sink], that of the default kind.
        for key in type(getattr(settings, section)).model_fields:
            assert key in documented.get(section, {}) or f"# {key} = " in text, (
                f"{section}.{key} is not documented in config.example.toml"
            )


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RELAYD_<SECTION>__<KEY> wins over the TOML file."""
    path = _write(tmp_path, "[relay]\nworkers = 2\n[sink]\nurl = 'http://a:1'\n")
    monkeypatch.setenv("RELAYD_RELAY__WORKERS", "7")
    settings = load_settings(path)
    assert settings.relay.workers == 7
    assert settings.sink.target == "http://a:1"


def test_config_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RELAYD_CONFIG names the file when --config is absent; a named missing file is an error."""
    monkeypatch.setenv("RELAYD_CONFIG", str(_write(tmp_path, "[relay]\nworkers = 3\n")))
    assert load_settings().relay.workers == 3
    monkeypatch.setenv("RELAYD_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="file not found"):
        load_settings()


@pytest.mark.parametrize(
    ("text", "env", "key", "reason"),
    [
        ('[outbox]\ntable = "x; drop"\n', {}, "outbox.table", "invalid table name"),
        ('[outbox]\ntable = "a.b.c"\n', {}, "outbox.table", "invalid table name"),
        ('[outbox]\ntable = "Outbox"\n', {}, "outbox.table", "invalid table name"),
        ("[sink]\nbogus = 1\n", {}, "sink.bogus", "unknown key"),
        ("[nope]\nx = 1\n", {}, "nope", "unknown key"),
        ("[relay]\nworkers = 0\n", {}, "relay.workers", "greater than or equal to 1"),
        ("", {"RELAYD_RELAY__WORKERS": "many"}, "relay.workers", "valid integer"),
        ("", {"RELAYD_SINK__SURPRISE": "1"}, "RELAYD_SINK__SURPRISE", "not a setting"),
        ("[relay]\nlease_s = 15\n", {}, "relay.lease_s", "greater than 2 x sink.timeout_s"),
        ('[sink]\nurl = "ftp://x"\n', {}, "sink.url", "http:// or https://"),
        ('[sink]\nurl = "http://u:p@x"\n', {}, "sink.url", "sink.token_file"),
        ('[http]\nlisten = "9464"\n', {}, "http.listen", "HOST:PORT"),
        ("[relay\n", {}, "config", "invalid TOML"),
        ('[database]\ndsn = "postgres://db/x"\ndsn_file = "/y"\n', {}, "database", "not both"),
        ('[sink]\ntoken_file = "/nonexistent/token"\n', {}, "sink.token_file", "cannot read"),
        # No float setting may be infinite or NaN: each one ends up in a sleep, a deadline or
        # make_interval(), where inf crashes the first claim instead of the start-up.
        ("[relay]\nlease_s = inf\n", {}, "relay.lease_s", "finite number"),
        ("", {"RELAYD_RELAY__LEASE_S": "inf"}, "relay.lease_s", "finite number"),
        ("", {"RELAYD_SINK__TIMEOUT_S": "NaN"}, "sink.timeout_s", "finite number"),
        ("[retry]\ncap_s = nan\n", {}, "retry.cap_s", "finite number"),
        ("[cleanup]\npublished_retention_s = inf\n", {}, "cleanup.published_retention_s", "finite"),
        # Every duration has a finite upper bound.
        ("[relay]\nlease_s = 1e9\n", {}, "relay.lease_s", "less than or equal to 86400"),
        ("[sink]\ntimeout_s = 1e300\n", {}, "sink.timeout_s", "less than or equal to"),
        ("[retry]\ncap_s = 1e9\n", {}, "retry.cap_s", "less than or equal to 86400"),
        ("[relay]\npoll_interval_s = 1e9\n", {}, "relay.poll_interval_s", "less than or equal"),
        ("[cleanup]\npublished_retention_s = 1e12\n", {}, "cleanup.published_retention_s", "less"),
        # statement_timeout is an int of milliseconds on the server, and 0 means "no limit".
        ("[database]\nstatement_timeout_s = 1e7\n", {}, "database.statement_timeout_s", "2147483"),
        ("[database]\nstatement_timeout_s = inf\n", {}, "database.statement_timeout_s", "finite"),
        ("[database]\nstatement_timeout_s = 0.0004\n", {}, "database.statement_timeout_s", "0.001"),
        # A RELAYD_* variable that is no setting is refused like an unknown key in the file:
        # a typo would otherwise leave the setting at its default without a word.
        ("", {"RELAYD_BOGUS__X": "1"}, "RELAYD_BOGUS__X", "not a setting"),
        ("", {"relayd_Bogus__x": "1"}, "relayd_Bogus__x", "sections: database, outbox, sink"),
        ("", {"RELAYD___X": "1"}, "RELAYD___X", "not a setting"),
        ("", {"RELAYD_RELAY_WORKERS": "8"}, "RELAYD_RELAY_WORKERS", "mean RELAYD_RELAY__WORKERS?"),
        ("", {"RELAYD_CONFG": "/etc/x.toml"}, "RELAYD_CONFG", "did you mean RELAYD_CONFIG?"),
        ("", {"RELAYD_DATABASE": "{}"}, "RELAYD_DATABASE", "RELAYD_<SECTION>__<KEY>"),
        ("", {"RELAYD_RELAY__WORKERS__X": "8"}, "RELAYD_RELAY__WORKERS__X", "not a setting"),
        ("", {"RELAYD_OJS_CONFORMANCE": "/x"}, "RELAYD_OJS_CONFORMANCE", "not a setting"),
    ],
)
def test_bad_config_names_the_key(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    env: dict[str, str],
    key: str,
    reason: str,
) -> None:
    """Every invalid setting becomes one ConfigError naming its key and the reason."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_settings(_write(tmp_path, text))
    assert caught.value.key == key
    assert reason in caught.value.reason
    assert "\n" not in str(caught.value)


def test_durations_accept_their_documented_bounds(tmp_path: Path) -> None:
    """The largest allowed durations and the smallest statement timeout load."""
    settings = load_settings(
        _write(
            tmp_path,
            "[database]\nstatement_timeout_s = 0.001\n[relay]\nlease_s = 86400\n"
            "[sink]\ntimeout_s = 43199\n[retry]\ncap_s = 86400\n"
            "[cleanup]\npublished_retention_s = 315360000\n",
        )
    )
    assert settings.database.statement_timeout_s == 0.001
    assert settings.cleanup.published_retention_s == 315_360_000


def test_the_test_suites_variables_are_not_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELAYD_CONFIG names the file and RELAYD_TEST_* (reserved for relayd's test suite) is
    left alone: neither is refused as an unknown setting."""
    for name in ("RELAYD_TEST_DSN", "RELAYD_TEST_OJS_CONFORMANCE", "relayd_test_anything"):
        monkeypatch.setenv(name, "postgresql://x:hunter2@h/db")
    monkeypatch.setenv("RELAYD_CONFIG", str(_write(tmp_path, "")))
    assert load_settings() == Settings()


BAD_DSNS = [
    ("mysql://relayd:hunter2@db/app", "postgresql:// or postgres://"),
    ("host=db user=relayd password=hunter2", "postgresql:// or postgres://"),
    ("postgresql://relayd:hunter2@db/app?sslmode=bogus", "sslmode must be one of disable,"),
    ("postgresql://relayd:hunter2@db/app?sslmode=REQUIRE", "verify-full"),
    ("postgresql://relayd:hunter2@db/app?target_session_attrs=master", "read-write"),
    ("postgresql://relayd:hunter2@db/app?sslnegotiation=hunter2", "sslnegotiation"),
    ("postgresql://relayd:hunter2@db/app?gsslib=hunter2", "gsslib"),
    ("postgresql://relayd:hunter2@db/app?ssl_min_protocol_version=SSLv3", "TLSv1.2"),
    ("postgresql://relayd:hunter2@db:hunter2/app", "port must be a number from 1 to 65535"),
    ("postgresql://relayd:hunter2@db:70000/app", "port must be a number from 1 to 65535"),
    ("postgresql://relayd:hunter2@db:0/app", "port must be a number from 1 to 65535"),
    ("postgresql://relayd:hunter2@a:5432,b:99999/app", "port must be a number from 1 to 65535"),
    ("postgresql://relayd:hunter2@[::1]:x/app", "port must be a number from 1 to 65535"),
    ("postgresql://relayd:hunter2@[::1/app", "IPv6"),
    ("postgresql://relayd:hunter2@a,,b/app", "empty host"),
    ("postgresql:///app?port=hunter2", "port must be a number from 1 to 65535"),
    ("postgresql://relayd:hunter2@db/app?hunter2", "malformed query string"),
    ("postgresql://relayd:hunter2@x@db/app", "percent-encode it in the password as %40"),
    ("postgresql://db/app?sslnegotiation=direct&sslmode=prefer", "requires sslmode require"),
]


@pytest.mark.parametrize("source", ["dsn", "dsn_file"])
@pytest.mark.parametrize(("dsn", "reason"), BAD_DSNS)
def test_bad_dsn_names_the_key_but_never_quotes_the_dsn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, dsn: str, reason: str
) -> None:
    """A DSN asyncpg would refuse (or retry forever on) fails at load, without its text."""
    if source == "dsn":
        monkeypatch.setenv("RELAYD_DATABASE__DSN", dsn)
    else:
        (tmp_path / "dsn").write_text(dsn + "\n")
        monkeypatch.setenv("RELAYD_DATABASE__DSN_FILE", str(tmp_path / "dsn"))
    with pytest.raises(ConfigError) as caught:
        load_settings(_write(tmp_path, ""))
    assert caught.value.key == f"database.{source}"
    assert reason in caught.value.reason
    assert "hunter2" not in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://relayd:p%40ss@db:5432/app",
        "postgres://db/app?sslmode=verify-full&target_session_attrs=read-write",
        "postgresql://a:5432,b:5433/app?sslmode=disable&application_name=x",
        "postgresql://[::1]:5432/app?sslnegotiation=direct&sslmode=require",
        "postgresql:///app?host=/var/run/postgresql&port=5433",
        "postgresql://%2Fvar%2Frun%2Fpostgresql/app",
        "postgresql://db/app?ssl_min_protocol_version=TLSv1.3&gsslib=gssapi",
        "postgresql://db/app?sslmode=verify_full",
    ],
)
def test_good_dsns_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dsn: str) -> None:
    """DSNs asyncpg accepts (multi-host, IPv6, sockets, server options) pass validation."""
    monkeypatch.setenv("RELAYD_DATABASE__DSN", dsn)
    assert load_settings(_write(tmp_path, "")).dsn == dsn


@pytest.mark.parametrize(
    ("seconds", "milliseconds"),
    [(30.0, "30000"), (4.03, "4030"), (0.0004, "1"), (1e-9, "1"), (2147483.0, "2147483000")],
)
def test_statement_timeout_is_whole_milliseconds_never_zero(
    seconds: float, milliseconds: str
) -> None:
    """Seconds become whole milliseconds, never 0 (which PostgreSQL reads as no limit)."""
    assert _server_settings(seconds, False)["statement_timeout"] == milliseconds


def test_secrets_come_from_files_and_never_show(tmp_path: Path) -> None:
    """dsn_file and token_file are read at load; repr and redacted() hide their content."""
    dsn_file = tmp_path / "dsn"
    dsn_file.write_text("postgresql://relayd:hunter2@db/app\n")
    token_file = tmp_path / "token"
    token_file.write_text("tok-3xyz\n")
    settings = load_settings(
        _write(
            tmp_path,
            f'[database]\ndsn_file = "{dsn_file}"\n[sink]\nurl = "http://x:1"\n'
            f'token_file = "{token_file}"\n',
        )
    )
    assert settings.dsn == "postgresql://relayd:hunter2@db/app"
    token = ojs_settings(settings).token
    assert token is not None
    assert token.get_secret_value() == "tok-3xyz"
    shown = repr(settings) + str(settings.redacted())
    assert "hunter2" not in shown
    assert "tok-3xyz" not in shown
    # The file is the DSN's one source: redacted() names it and shows no DSN at all.
    assert settings.redacted()["database"]["dsn"] is None
    assert settings.redacted()["database"]["dsn_file"] == str(dsn_file)


def test_settings_built_directly_read_their_secret_files(tmp_path: Path) -> None:
    """Settings(...) built directly (sections as models or dicts) has read its *_file secrets."""
    (tmp_path / "dsn").write_text("postgresql://relayd:hunter2@db/app\n")
    (tmp_path / "token").write_text("tok-3xyz\n")
    settings = Settings(
        database=DatabaseSettings(dsn_file=tmp_path / "dsn"),
        sink={"url": "http://x:1", "token_file": tmp_path / "token"},
    )
    assert settings.dsn == "postgresql://relayd:hunter2@db/app"
    assert settings.database.resolved_dsn is not None
    token = ojs_settings(settings).token
    assert token is not None
    assert token.get_secret_value() == "tok-3xyz"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[sink]\ntoken_file = "/nonexistent/token"\n',
            "sink.token_file: cannot read /nonexistent/token: No such file or directory",
        ),
        (
            '[database]\ndsn_file = "/nonexistent/dsn"\n',
            "database.dsn_file: cannot read /nonexistent/dsn: No such file or directory",
        ),
        (
            '[database]\ndsn_file = "/dev/null"\n',
            "database.dsn_file: /dev/null is a character device, not a regular file",
        ),
        (
            '[sink]\nca_file = "/nonexistent/ca"\n',
            "sink.ca_file: not a readable file: /nonexistent/ca",
        ),
        ('[database]\ndsn = "postgres://db/x"\ndsn_file = "/dev/null"\n', "database: set either"),
    ],
)
def test_secret_file_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    """A secret file that cannot be used is one ConfigError naming its key and path."""
    with pytest.raises(ConfigError) as caught:
        load_settings(_write(tmp_path, text))
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://u:secret@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("postgresql://u:@/db?host=/run/pg", "postgresql://u:@/db?host=/run/pg"),
        (
            "postgres://u:p%40ss@h/db?sslmode=require&password=x",
            "postgres://u:***@h/db?sslmode=require&password=***",
        ),
        ("host=h user=u password=secret dbname=d", "host=h user=u password=*** dbname=d"),
        ("host=h password='se cret' dbname=d", "host=h password=*** dbname=d"),
    ],
)
def test_redact_dsn(dsn: str, expected: str) -> None:
    """Passwords in URL userinfo, query parameters and key=value DSNs are redacted."""
    assert redact_dsn(dsn) == expected


def test_outbox_table_is_quoted_and_channel_sized() -> None:
    """The validated name is quoted for SQL; bare names land in public."""
    assert OutboxTable.parse("relayd.outbox").qualified == '"relayd"."outbox"'
    assert OutboxTable.parse("outbox").channel == "public.outbox"
    with pytest.raises(ValueError, match="too long"):
        OutboxTable.parse("a" * 40 + "." + "b" * 40)


def test_cli_config_show_redacts_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`relayd config show` prints no password (TOML and --json)."""
    path = _write(tmp_path, '[database]\ndsn = "postgresql://app:s3cr3t@db:5432/app"\n')
    assert main(["config", "show", "--config", str(path)]) == 0
    assert main(["config", "show", "--json", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out
    assert 'dsn = "postgresql://app:***@db:5432/app"' in out


def test_cli_bad_table_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config with outbox.table = "x; drop" exits 2 with one line naming outbox.table."""
    path = _write(tmp_path, '[outbox]\ntable = "x; drop"\n')
    assert main(["config", "show", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("relayd: config error: outbox.table: ")


# Every key away from its default, secrets from files under a directory whose name TOML must
# escape (quotes, a backslash, a character outside the BMP that JSON would write as a
# surrogate pair, which TOML refuses).
_EVERY_KEY = """
[database]
dsn_file = '{secrets}/dsn'
pool_max_size = 7
connect_timeout_s = 2.5
statement_timeout_s = 0.001
[outbox]
table = "app.outbox_events"
[sink]
url = "https://ojs.internal:8443/base"
token_file = '{secrets}/token'
ca_file = '{secrets}/ca.pem'
timeout_s = 4.0
connect_timeout_s = 1.5
concurrency = 9
batch = "off"
batch_max_jobs = 11
batch_max_bytes = 2048
max_envelope_bytes = 4096
[relay]
workers = 3
batch_size = 17
lease_s = 12.5
poll_interval_s = 0.25
listen = false
shutdown_grace_s = 0
full_scan_interval_s = 3
storm_threshold = 0.75
storm_window = 40
[retry]
base_s = 0.1
cap_s = 1e-1
max_attempts = 4
breaker_threshold = 2
breaker_cooldown_s = 0.3
[http]
enabled = false
listen = "[::1]:9999"
[log]
level = "debug"
format = "json"
[cleanup]
enabled = false
published_retention_s = 3600
interval_s = 5
batch_size = 10
[metrics]
sample_interval_s = 0.5
"""


def test_config_show_loads_back_as_the_same_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`relayd config show` saved to a file loads back as the same settings (secrets read from
    the same files); each secret file is named once by its path, never by its content, and
    dsn and dsn_file never both appear."""
    secrets = tmp_path / 'a "quoted" \\ dir \u2713 \U0001f642'
    secrets.mkdir()
    (secrets / "dsn").write_text("postgresql://relayd:hunter2@db/app\n")
    (secrets / "token").write_text("tok-3xyz\n")
    (secrets / "ca.pem").write_text("not parsed at load\n")
    config = _write(tmp_path, _EVERY_KEY.format(secrets=secrets))
    monkeypatch.setenv("RELAYD_RELAY__WORKERS", "5")  # the environment's value is shown
    original = load_settings(config)
    assert original != Settings()
    assert main(["config", "show", "--config", str(config)]) == 0
    shown = capsys.readouterr().out
    assert "hunter2" not in shown
    assert "tok-3xyz" not in shown
    assert "postgresql" not in shown  # not even redacted: the file is the DSN's one source
    assert tomllib.loads(shown)["database"]["dsn_file"] == str(secrets / "dsn")
    assert "dsn" not in tomllib.loads(shown)["database"]
    saved = tmp_path / "shown.toml"
    saved.write_text(shown)
    monkeypatch.delenv("RELAYD_RELAY__WORKERS")
    reloaded = load_settings(saved)
    assert reloaded == original
    assert reloaded.dsn == "postgresql://relayd:hunter2@db/app"
    assert reloaded.relay.workers == 5
    # --json shows the same single source for the DSN.
    assert main(["config", "show", "--json", "--config", str(config)]) == 0
    database = json.loads(capsys.readouterr().out)["database"]
    assert (database["dsn"], database["dsn_file"]) == (None, str(secrets / "dsn"))


def test_config_show_never_prints_an_inline_password_as_a_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An inline DSN without a password is shown as it is and loads back; one with a password
    is shown only as a comment, redacted, since a `***` password read back would be wrong."""
    plain = _write(tmp_path, '[database]\ndsn = "postgresql://app@db:5432/app"\n')
    assert main(["config", "show", "--config", str(plain)]) == 0
    assert tomllib.loads(capsys.readouterr().out)["database"]["dsn"] == (
        "postgresql://app@db:5432/app"
    )
    secret = _write(tmp_path, '[database]\ndsn = "postgresql://app:s3cr3t@db:5432/app"\n')
    assert main(["config", "show", "--config", str(secret)]) == 0
    shown = capsys.readouterr().out
    assert "dsn" not in tomllib.loads(shown)["database"]
    [line] = [line for line in shown.splitlines() if "postgresql://" in line]
    assert line.startswith('# dsn = "postgresql://app:***@db:5432/app"')
    assert "dsn_file" in line


@pytest.mark.parametrize(
    ("kind", "keys"),
    [
        ("ojs", {"url": "http://sink:8080", "token_file": "token"}),
        ("nats", {"servers": ["nats://sink:4222"], "stream": "S", "password_file": "pw"}),
        ("webhook", {"url": "http://sink/hooks", "secret_file": "secret"}),
    ],
)
def test_an_operator_command_loads_the_sink_without_its_files(
    tmp_path: Path, kind: str, keys: dict[str, object]
) -> None:
    """`load_settings(sink_files=False)` keeps the sink's file paths without opening them
    (absent here, as to an operator who may not read them); such settings cannot build a
    sink, and the same file loaded for `relayd run` is refused naming the key."""
    absent = tmp_path / "absent"
    sink = {k: str(absent / str(v)) if k.endswith("_file") else v for k, v in keys.items()}
    lines = [f"{k} = {json.dumps(v)}" for k, v in sink.items()]
    if kind == "nats":
        lines.append('user = "relay"')
    path = _write(tmp_path, "\n".join(["[sink]", f'kind = "{kind}"', *lines, ""]))
    settings = load_settings(path, sink_files=False)
    file_key = next(k for k in sink if k.endswith("_file"))
    assert settings.redacted()["sink"][file_key] == sink[file_key]
    with pytest.raises(RuntimeError, match="loaded without their files"):
        settings.sink.build(SinkHealthRecord())
    with pytest.raises(ConfigError) as refused:
        load_settings(path)
    assert refused.value.key == f"sink.{file_key}"
