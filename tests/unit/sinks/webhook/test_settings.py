"""`[sink] kind = "webhook"`: its keys, their one-line errors naming the key, the secret file's
`whsec_` lines (never shown), and the process exiting 2 on a bad configuration."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from relayd.core.errors import ConfigError
from relayd.settings import load_producer_sections, load_settings
from relayd.sinks.registry import kinds
from relayd.sinks.webhook.settings import WebhookSettings

KEY = base64.b64encode(bytes(range(32))).decode()
SECRET = f"whsec_{KEY}"
ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("RELAYD_") or name == "CREDENTIALS_DIRECTORY":
            monkeypatch.delenv(name)


def _config(tmp_path: Path, extra: str, secret: str | None = SECRET + "\n") -> Path:
    text = "[sink]\nkind = 'webhook'\n"
    if secret is not None:
        (tmp_path / "whsec").write_text(secret)
        text += f"secret_file = '{tmp_path / 'whsec'}'\n"
    path = tmp_path / "relayd.toml"
    path.write_text(text + extra)
    return path


def _load(tmp_path: Path, extra: str, secret: str | None = SECRET + "\n") -> WebhookSettings:
    sink = load_settings(_config(tmp_path, extra, secret)).sink
    assert isinstance(sink, WebhookSettings)
    return sink


def test_the_kind_is_registered() -> None:
    """`kind = "webhook"` chooses the webhook settings model."""
    assert kinds()["webhook"] is WebhookSettings


def test_a_url_and_routes_load(tmp_path: Path) -> None:
    """One URL, routes per type, and the secret's keys are read at load."""
    sink = _load(
        tmp_path,
        "url = 'https://receiver.example/hooks'\n"
        "[[sink.routes]]\ntype = 'order.paid'\nurl = 'https://billing.example/in'\n",
    )
    assert sink.target == "https://billing.example/in, https://receiver.example/hooks"
    assert sink.endpoints == {"order.paid": "https://billing.example/in"}
    assert sink.keys.keys == (bytes(range(32)),)


def test_several_lines_are_several_active_secrets(tmp_path: Path) -> None:
    """Each whsec_ line is an active key; blank and comment lines are skipped."""
    other = "whsec_" + base64.b64encode(b"k" * 24).decode()
    sink = _load(tmp_path, "url = 'http://127.0.0.1:9/'\n", f"# new\n{other}\n\n{SECRET}\n")
    assert sink.keys.keys == (b"k" * 24, bytes(range(32)))


@pytest.mark.parametrize(
    ("extra", "secret", "error"),
    [
        ("url = 'ftp://x/'\n", SECRET, "sink.url: expected an http:// or https://"),
        ("url = 'https://u:p@x/'\n", SECRET, "sink.url: credentials do not belong"),
        ("url = 'https://x/#a'\n", SECRET, "sink.url: a URL with a #fragment"),
        ("url = 'https://x:99999/'\n", SECRET, "sink.url: Port out of range"),
        (
            "[[sink.routes]]\ntype = 'Bad'\nurl = 'https://x/'\n",
            SECRET,
            "sink.routes.0.type: an event type matches",
        ),
        (
            "[[sink.routes]]\ntype = 'a'\nurl = 'https://x/'\n"
            "[[sink.routes]]\ntype = 'a'\nurl = 'https://y/'\n",
            SECRET,
            "sink.routes.1: a second route for type 'a'",
        ),
        ("url = 'https://x/'\nsubject = 'a'\n", SECRET, "sink.subject: unknown key"),
        ("url = 'https://x/'\n", "whsec_!!!!", "sink.secret_file:"),
        (
            "url = 'https://x/'\n",
            "whsec_" + base64.b64encode(b"short").decode(),
            "sink.secret_file:",
        ),
        ("url = 'https://x/'\n", KEY, "sink.secret_file:"),
        ("url = 'https://x/'\n", "# only a comment\n", "sink.secret_file:"),
        ("url = 'https://x/'\nca_file = '/nonexistent/ca.pem'\n", SECRET, "sink.ca_file:"),
        (
            "url = 'https://x/'\nsecret_path_patterns = ['[0-9]+', '(']\n",
            SECRET,
            "sink.secret_path_patterns.1: not a regular expression",
        ),
    ],
)
def test_bad_keys_are_named_in_one_line(
    tmp_path: Path, extra: str, secret: str, error: str
) -> None:
    """A bad key or secret file is one line naming the key, never showing the secret."""
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, extra, secret)
    text = str(refused.value)
    assert text.startswith(error), text
    assert "\n" not in text
    assert KEY not in text
    assert "!!!!" not in text


def test_a_bad_secret_line_is_named_by_number(tmp_path: Path) -> None:
    """The error says which line is wrong, and what, without its content."""
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, "url = 'https://x/'\n", f"{SECRET}\nwhsec_c2hvcnQ=\n")
    assert "line 2: the key is 5 bytes" in str(refused.value)


def test_no_url_and_no_secret_are_refused_when_the_sink_is_built(tmp_path: Path) -> None:
    """Without an endpoint, or without a secret, the sink is not built (the key named)."""
    with pytest.raises(ConfigError, match=r"^sink\.url: required"):
        _ = _load(tmp_path, "").target
    no_secret = _load(tmp_path, "url = 'https://x/'\n", secret=None)
    with pytest.raises(ConfigError, match=r"^sink\.secret_file: required"):
        no_secret.build(_Health())


def test_secrets_are_never_shown(tmp_path: Path) -> None:
    """Neither the settings' repr nor the keys' repr shows a secret."""
    sink = _load(tmp_path, "url = 'https://x/'\n")
    shown = repr(sink) + str(sink) + repr(sink.keys) + repr(sink.model_dump())
    assert KEY not in shown
    assert SECRET not in shown
    assert repr(sink.keys) == "SigningKeys(1 keys)"


def test_endpoints_are_shown_without_their_secrets(tmp_path: Path) -> None:
    """`target` (what `relayd check` and the start-up log print) and `shown` hide each URL's
    query and secret-looking segments, and the segments `secret_path_patterns` match;
    `hidden` lists what they hide, for cleaning a receiver's answer."""
    sink = _load(
        tmp_path,
        "url = 'https://r.example/hooks?token=abc'\n"
        "secret_path_patterns = ['acct-[0-9]+']\n"
        "[[sink.routes]]\ntype = 'order.paid'\n"
        "url = 'https://b.example/in/acct-42/Xk9pQ2rT7vW3yZ1aB4cD'\n",
    )
    assert sink.target == "https://b.example/in/***/***, https://r.example/hooks?***"
    assert sink.shown("https://b.example/in/acct-7/x") == "https://b.example/in/***/x"
    assert sink.hidden == ("Xk9pQ2rT7vW3yZ1aB4cD", "token=abc", "acct-42")


def test_routes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RELAYD_SINK__ROUTES is a JSON array of {"type", "url"}, and
    RELAYD_SINK__SECRET_PATH_PATTERNS one of patterns."""
    monkeypatch.setenv("RELAYD_SINK__ROUTES", '[{"type": "a.b", "url": "https://x/"}]')
    monkeypatch.setenv("RELAYD_SINK__SECRET_PATH_PATTERNS", '["[0-9]+"]')
    sink = _load(tmp_path, "")
    assert sink.endpoints == {"a.b": "https://x/"}
    assert sink.secret_path_patterns == ("[0-9]+",)


def test_a_bad_configuration_exits_2_with_one_line(tmp_path: Path) -> None:
    """`relayd check` on a bad secret file: exit 2, one line naming the key, no secret."""
    path = _config(tmp_path, "url = 'https://x/'\n", "whsec_" + KEY[:8] + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "relayd", "check", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "sink.secret_file" in result.stderr
    assert KEY[:8] not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


class _Health:
    def sink_accepted(self) -> None:
        pass

    def sink_answered(self) -> None:
        pass

    def sink_failed(self, *, severe: bool, reason: str) -> None:
        pass

    def sink_reconnected(self) -> None:
        pass


def test_the_example_documents_every_webhook_key_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/webhook.toml sets or shows (commented) every key of the kind, and loads
    (with its secret file and the CA bundle it shows commented)."""
    example = ROOT / "examples" / "webhook.toml"
    text = example.read_text()
    for key in WebhookSettings.model_fields.keys() - {"kind", "routes"}:
        assert f"\n{key} = " in text or f"# {key} = " in text, (
            f"sink.{key} is not in examples/webhook.toml"
        )
    (tmp_path / "dsn").write_text("postgresql://relayd@localhost/app")
    (tmp_path / "whsec").write_text(SECRET + "\n")
    (tmp_path / "ca.pem").write_text("not read until connecting")
    monkeypatch.setenv("RELAYD_DATABASE__DSN_FILE", str(tmp_path / "dsn"))
    monkeypatch.setenv("RELAYD_SINK__SECRET_FILE", str(tmp_path / "whsec"))
    path = tmp_path / "relayd.toml"
    ca_file = f"ca_file = '{tmp_path / 'ca.pem'}'"
    path.write_text(text.replace('# ca_file = "/etc/relayd/webhook-ca.pem"', ca_file))
    sink = load_settings(path).sink
    assert isinstance(sink, WebhookSettings)
    assert sink.endpoints == {"order.paid": "https://billing.example/hooks/orders"}
    assert sink.ca_file is not None


def test_a_producer_loads_the_sink_without_its_secret(tmp_path: Path) -> None:
    """A producer reading the daemon's file leaves the secret files (the shared one, each
    route's own) and the CA bundle unread."""
    path = tmp_path / "relayd.toml"
    path.write_text(
        "[sink]\nkind = 'webhook'\nurl = 'https://x/'\n"
        "secret_file = '/nonexistent/whsec'\nca_file = '/nonexistent/ca.pem'\n"
        "[[sink.routes]]\ntype = 'a.b'\nurl = 'https://y/'\nsecret_file = '/nonexistent/own'\n"
    )
    _, sink = load_producer_sections(path)
    assert isinstance(sink, WebhookSettings)
    assert sink.secret_file is None
    assert sink.url == "https://x/"
    assert sink.endpoints == {"a.b": "https://y/"}
    assert sink.routes[0].secret_file is None


OTHER_KEY = base64.b64encode(b"o" * 32).decode()
OTHER = f"whsec_{OTHER_KEY}"


def _route(index: int, url: str, secret_file: Path | None = None) -> str:
    text = f"[[sink.routes]]\ntype = 'order.t{index}'\nurl = '{url}'\n"
    return text + (f"secret_file = '{secret_file}'\n" if secret_file else "")


def test_a_route_signs_with_its_own_secret_file(tmp_path: Path) -> None:
    """A route's `secret_file` signs its endpoint; the other endpoints keep the shared one;
    no secret is shown by the settings, their dump or `relayd config show`'s data."""
    own = tmp_path / "own"
    own.write_text(OTHER + "\n")
    path = _config(
        tmp_path,
        "url = 'https://shared.example/hooks'\n"
        + _route(0, "https://a.example/in", own)
        + _route(1, "https://b.example/in"),
    )
    settings = load_settings(path)
    sink = settings.sink
    assert isinstance(sink, WebhookSettings)
    signing = {url: (secret.key, secret.path) for url, secret in sink.signing().items()}
    assert signing == {
        "https://shared.example/hooks": ("sink.secret_file", tmp_path / "whsec"),
        "https://a.example/in": ("sink.routes.0.secret_file", own),
        "https://b.example/in": ("sink.secret_file", tmp_path / "whsec"),
    }
    shown = repr(sink) + repr(sink.signing()) + json.dumps(settings.redacted(), default=str)
    assert KEY not in shown
    assert OTHER_KEY not in shown
    assert str(own) in shown  # the path is shown, never what it holds


def test_routes_with_their_own_secrets_need_no_shared_one(tmp_path: Path) -> None:
    """Without `sink.secret_file` the sink is built when every endpoint has its own; an
    endpoint without one is named in the one-line error about `sink.secret_file`."""
    own = tmp_path / "own"
    own.write_text(OTHER + "\n")
    sink = _load(tmp_path, _route(0, "https://a.example/in", own), secret=None)
    assert sink.build(_Health()) is not None
    lacking = _load(
        tmp_path,
        _route(0, "https://a.example/in", own) + _route(1, "https://b.example/in"),
        secret=None,
    )
    with pytest.raises(ConfigError) as refused:
        lacking.build(_Health())
    assert str(refused.value).startswith("sink.secret_file: required")
    assert str(refused.value).endswith("sink.routes.1 has no secret_file of its own")
    with pytest.raises(ConfigError, match=r"sink\.url has no secret_file of its own$"):
        _load(tmp_path, "url = 'https://x/'\n", secret=None).build(_Health())


@pytest.mark.parametrize(
    ("routes", "error"),
    [
        (
            lambda d: _route(0, "https://a.example/in", d / "missing"),
            "sink.routes.0.secret_file: cannot read",
        ),
        (
            lambda d: _route(0, "https://a.example/in", d / "bad"),
            "sink.routes.0.secret_file:",
        ),
        (
            lambda d: (
                _route(0, "https://a.example/in", d / "own") + _route(1, "https://a.example/in")
            ),
            "sink.routes.1.secret_file: its url is also sink.routes.0's, signed with another",
        ),
        (
            lambda d: _route(0, "https://shared.example/hooks", d / "own"),
            "sink.routes.0.secret_file: its url is also sink.url's, signed with another",
        ),
    ],
)
def test_a_bad_route_secret_is_named_in_one_line(
    tmp_path: Path, routes: Callable[[Path], str], error: str
) -> None:
    """An unreadable or unusable route secret file, or two secret files for one endpoint:
    one line naming the route's key, never a secret."""
    (tmp_path / "own").write_text(OTHER + "\n")
    (tmp_path / "bad").write_text("whsec_" + OTHER_KEY[:8] + "\n")
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, "url = 'https://shared.example/hooks'\n" + routes(tmp_path))
    text = str(refused.value)
    assert text.startswith(error), text
    assert "\n" not in text
    assert OTHER_KEY[:8] not in text
    assert KEY not in text


def test_one_secret_file_may_sign_several_routes(tmp_path: Path) -> None:
    """Two routes to one endpoint with the same secret file (written two ways) load."""
    own = tmp_path / "own"
    own.write_text(OTHER + "\n")
    (tmp_path / "sub").mkdir()
    sink = _load(
        tmp_path,
        _route(0, "https://a.example/in", own)
        + _route(1, "https://a.example/in", tmp_path / "sub" / ".." / "own"),
    )
    assert [secret.key for secret in sink.signing().values()] == ["sink.routes.0.secret_file"]
