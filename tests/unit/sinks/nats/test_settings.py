"""`[sink] kind = "nats"`: its keys, their one-line errors naming the key, credentials read
from files (one method at most), and the kind's example configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relayd.core.errors import ConfigError
from relayd.settings import Settings, load_settings
from relayd.sinks.nats.settings import NatsSettings
from relayd.sinks.registry import kinds

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "nats.toml"
SEED = "SUAGMJH5XLGZKQQWAWKRZJIGMOU4HPFUYLXJMXOO5NLFEO2OOQJ5LPRDPM"
BASE = "[sink]\nkind = 'nats'\nservers = ['nats://127.0.0.1:4222']\nstream = 'EVENTS'\n"
ROUTE = "[[sink.routes]]\ntype = 'order.updated'\nsubject = 'events.orders'\n"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.upper().startswith("RELAYD_") or name == "CREDENTIALS_DIRECTORY":
            monkeypatch.delenv(name)


def _load(tmp_path: Path, text: str) -> NatsSettings:
    path = tmp_path / "relayd.toml"
    path.write_text(text)
    sink = load_settings(path).sink
    assert isinstance(sink, NatsSettings)
    return sink


def _secret(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_issues_configuration_loads(tmp_path: Path) -> None:
    sink = _load(
        tmp_path, BASE + ROUTE + "[[sink.routes]]\ntype = 'a.b'\nsubject = 'x'\nversion = 2\n"
    )
    assert sink.target == "nats://127.0.0.1:4222 stream EVENTS"
    assert [(r.type, r.subject, r.version) for r in sink.routes] == [
        ("order.updated", "events.orders", None),
        ("a.b", "x", 2),
    ]
    assert sink.max_payload_bytes == 1024 * 1024
    assert sink.source == "relayd"


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            "max_payload_bytes = 0\n",
            "sink.max_payload_bytes: Input should be greater than or equal to 1",
        ),
        (
            "max_payload_bytes = -5\n",
            "sink.max_payload_bytes: Input should be greater than or equal to 1",
        ),
        ("batch = 'on'\n", "sink.batch: unknown key for sink kind 'nats' (a key of 'ojs')"),
        ("url = 'http://a:1'\n", "sink.url: unknown key for sink kind 'nats' (a key of 'ojs')"),
        ("stream = 'A.B'\n", "sink.stream: expected a stream name"),
        ("source = ''\n", "sink.source: expected a URI reference of 1 to 1024 characters"),
        (
            "servers = ['http://a:1']\n",
            "sink.servers: expected nats://host:port or tls://host:port",
        ),
        (
            "servers = ['nats://u:p@a:1']\n",
            "sink.servers: credentials do not belong in a server URL",
        ),
        ("servers = ['nats://a:99999']\n", "sink.servers: 'nats://a:99999': Port out of range"),
        ("user = 'relayd'\n", "sink.password_file: required with sink.user"),
        ("wat = 1\n", "sink.wat: unknown key"),
        ("past_window = 'drop'\n", "sink.past_window: Input should be 'resend' or 'dead_letter'"),
        ("marker_prefix = 'm.*'\n", "sink.marker_prefix: expected a subject prefix"),
        ("marker_prefix = ''\n", "sink.marker_prefix: expected a subject prefix"),
    ],
)
def test_bad_keys_are_named_in_one_line(tmp_path: Path, extra: str, error: str) -> None:
    text = BASE.replace("stream = 'EVENTS'\n", "") + extra
    if "stream" not in extra:
        text += "stream = 'EVENTS'\n"
    if "servers" in extra:
        text = text.replace("servers = ['nats://127.0.0.1:4222']\n", "", 1)
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, text + ROUTE)
    assert str(refused.value).startswith(error)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("route", "error"),
    [
        ("type = 'Order'\nsubject = 'x'\n", "sink.routes.0.type: an event type matches"),
        (
            "type = 'a'\nsubject = 'x.*'\n",
            "sink.routes.0.subject: expected a subject to publish to",
        ),
        ("type = 'a'\nsubject = 'x..y'\n", "sink.routes.0.subject: expected a subject"),
        ("type = 'a'\nsubject = 'x y'\n", "sink.routes.0.subject: expected a subject"),
        ("type = 'a'\nsubject = 'x'\nversion = 0\n", "sink.routes.0.version: Input should be"),
        ("type = 'a'\n", "sink.routes.0.subject: Field required"),
    ],
)
def test_bad_routes_are_named_by_index(tmp_path: Path, route: str, error: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, BASE + "[[sink.routes]]\n" + route)
    assert str(refused.value).startswith(error)


@pytest.mark.parametrize(
    ("sink", "route", "error"),
    [
        ("", "subject = 'events.o.{key}'\n", "sink.routes.0.subject: {key} needs an ordered route"),
        (
            "ordering = 'key'\n",
            "subject = 'events.o.{key}'\nordering = 'none'\n",
            "sink.routes.0.subject: {key} needs an ordered route",
        ),
        (
            "ordering = 'key'\n",
            "subject = 'events.{id}.{key}'\n",
            "sink.routes.0.subject: {id} and {key} in one subject",
        ),
        ("ordering = 'key'\n", "subject = 'events.o.{key}'\n", None),
        ("", "subject = 'events.o.{key}'\nordering = 'key'\n", None),
    ],
)
def test_the_key_in_a_subject_needs_an_ordered_route(
    tmp_path: Path, sink: str, route: str, error: str | None
) -> None:
    text = BASE + sink + "[[sink.routes]]\ntype = 'order.updated'\n" + route
    if error is None:
        assert _load(tmp_path, text).routes[0].subject == "events.o.{key}"
        return
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, text)
    assert str(refused.value).startswith(error)
    assert "\n" not in str(refused.value)


def test_two_routes_for_one_type_and_version_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, BASE + ROUTE + ROUTE.replace("events.orders", "events.other"))
    assert str(refused.value) == (
        "sink.routes.1: a second route for type 'order.updated', every version "
        "(the first is sink.routes.0)"
    )


def test_credentials_are_read_from_files_and_never_shown(tmp_path: Path) -> None:
    password = _secret(tmp_path, "password", "hunter2-nats\n")
    sink = _load(tmp_path, BASE + f"user = 'relayd'\npassword_file = '{password}'\n" + ROUTE)
    assert sink.password is not None
    assert sink.password.get_secret_value() == "hunter2-nats"
    assert "hunter2" not in repr(sink)
    assert "hunter2" not in str(sink.model_dump())
    token = _secret(tmp_path, "token", "s3cr3t-token\n")
    assert _load(tmp_path, BASE + f"token_file = '{token}'\n" + ROUTE).token is not None
    seed = _secret(tmp_path, "seed", SEED + "\n")
    assert _load(tmp_path, BASE + f"nkey_seed_file = '{seed}'\n" + ROUTE).nkey_seed_file == seed


def test_one_credential_method_at_most(tmp_path: Path) -> None:
    token = _secret(tmp_path, "token", "t\n")
    seed = _secret(tmp_path, "seed", SEED)
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, BASE + f"token_file = '{token}'\nnkey_seed_file = '{seed}'\n" + ROUTE)
    assert str(refused.value) == (
        "sink.nkey_seed_file: one credential method at most: sink.token_file is set too"
    )


@pytest.mark.parametrize(
    ("key", "content", "error"),
    [
        ("nkey_seed_file", "SAAB", "does not hold a user NKey seed (one line, SU...)"),
        ("creds_file", "token", "is not a NATS credentials file"),
        ("token_file", "two\nlines", "does not hold a bearer token"),
        ("token_file", "", "is empty"),
    ],
)
def test_unusable_secret_files_are_refused_at_load(
    tmp_path: Path, key: str, content: str, error: str
) -> None:
    path = _secret(tmp_path, key, content)
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, BASE + f"{key} = '{path}'\n" + ROUTE)
    assert str(refused.value).startswith(f"sink.{key}: ")
    assert error in str(refused.value)
    assert content not in str(refused.value) or not content


def test_systemd_credentials_fill_an_unset_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under systemd, a credential named nats-token (and the others) is used while the
    configuration names no credential method."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "nats-token").write_text("from-systemd\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    sink = _load(tmp_path, BASE + ROUTE)
    assert sink.token_file == credentials / "nats-token"


def test_servers_and_routes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELAYD_SINK__SERVERS takes URLs separated by commas (or a JSON array),
    RELAYD_SINK__ROUTES a JSON array of routes."""
    monkeypatch.setenv("RELAYD_SINK__SERVERS", "nats://a:4222, tls://b:4222")
    monkeypatch.setenv("RELAYD_SINK__ROUTES", '[{"type": "a.b", "subject": "x", "version": 3}]')
    sink = _load(tmp_path, "[sink]\nkind = 'nats'\nstream = 'EVENTS'\n")
    assert sink.servers == ("nats://a:4222", "tls://b:4222")
    assert [(r.type, r.subject, r.version) for r in sink.routes] == [("a.b", "x", 3)]
    monkeypatch.setenv("RELAYD_SINK__ROUTES", "{}")
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, "[sink]\nkind = 'nats'\nstream = 'EVENTS'\n")
    assert str(refused.value) == "sink.routes: expected a JSON array"


def test_what_run_requires_is_named_when_the_sink_is_built(tmp_path: Path) -> None:
    """Operator commands load without the NATS keys; building the sink names the first
    one missing."""
    sink = _load(tmp_path, "[sink]\nkind = 'nats'\n")
    with pytest.raises(ConfigError, match=r"^sink\.routes: required"):
        sink.build(_NoHealth())
    sink = _load(tmp_path, "[sink]\nkind = 'nats'\n" + ROUTE)
    with pytest.raises(ConfigError, match=r"^sink\.servers: required"):
        sink.build(_NoHealth())
    sink = _load(tmp_path, "[sink]\nkind = 'nats'\nservers = ['nats://a:1']\n" + ROUTE)
    with pytest.raises(ConfigError, match=r"^sink\.stream: required"):
        sink.build(_NoHealth())


def test_the_example_documents_every_nats_key_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/nats.toml sets or shows (commented) every key of the kind, and loads: as
    it is, and with the credential method it shows commented (user and password file)."""
    text = EXAMPLE.read_text()
    for key in kinds()["nats"].model_fields.keys() - {"kind"}:
        assert f"\n{key} = " in text or f"# {key} = " in text or key == "routes", (
            f"sink.{key} is not in examples/nats.toml"
        )
    dsn = _secret(tmp_path, "dsn", "postgresql://relayd@localhost/app")
    monkeypatch.setenv("RELAYD_DATABASE__DSN_FILE", str(dsn))
    sink = load_settings(EXAMPLE).sink
    assert isinstance(sink, NatsSettings)
    assert sink.stream == "EVENTS"
    assert [route.subject for route in sink.routes] == [
        "events.orders",
        "events.orders.v2",
        "events.payments.{id}",
    ]
    password = _secret(tmp_path, "password", "p")
    authenticated = text.replace("# user = ", "user = ").replace(
        '# password_file = "/var/run/secrets/relayd/nats-password"',
        f"password_file = '{password}'",
    )
    sink = _load(tmp_path, authenticated)
    assert sink.user == "relayd"


def test_loading_a_nats_configuration_imports_no_client() -> None:
    """The NATS client is imported when the sink is built, not when settings load."""
    code = (
        "import sys; from relayd.settings import Settings; "
        "Settings(sink={'kind': 'nats', 'servers': ['nats://a:1'], 'stream': 'E'}); "
        "assert 'nats' not in sys.modules and 'relayd.sinks.nats.sink' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class _NoHealth:
    def sink_accepted(self) -> None:
        raise AssertionError

    def sink_answered(self) -> None:
        raise AssertionError

    def sink_failed(self, *, severe: bool, reason: str) -> None:
        raise AssertionError

    def sink_reconnected(self) -> None:
        raise AssertionError


def test_config_show_prints_servers_and_routes_that_load_back(tmp_path: Path) -> None:
    """`relayd config show` writes the server list and the routes as TOML arrays (routes as
    inline tables), and its output loads back as the same settings."""
    path = tmp_path / "relayd.toml"
    path.write_text(BASE + ROUTE + "[[sink.routes]]\ntype = 'a.b'\nsubject = 'x'\nversion = 2\n")
    shown = subprocess.run(
        [sys.executable, "-m", "relayd", "--config", str(path), "config", "show"],
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    ).stdout
    assert 'servers = ["nats://127.0.0.1:4222"]\n' in shown
    assert '{type = "a.b", subject = "x", version = 2}]\n' in shown
    frozen = tmp_path / "frozen.toml"
    frozen.write_text(shown)
    assert load_settings(frozen) == load_settings(path)


def test_the_retry_horizon_comes_from_the_retry_and_relay_settings() -> None:
    """`relayd check` weighs the window against it: every backoff ceiling (1, 2, ... 60 s
    capped) and a lease (30 s) for each attempt after the first, 513 s by default."""
    settings = Settings(sink={"kind": "nats"})
    assert settings.sink.retry_horizon_s == 513.0
    assert isinstance(settings.sink, NatsSettings)
    assert settings.sink.past_window == "resend"
    assert settings.sink.marker_prefix == "relayd.markers"
