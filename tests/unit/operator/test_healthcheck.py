"""`relayd healthcheck` (relayd/operator/healthcheck.py): where it asks; what it says to no
answer."""

from __future__ import annotations

import pytest

from relayd.cli import main
from relayd.operator.healthcheck import healthz_url
from relayd.settings import Settings
from tests.support import clear_relayd_env


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RELAYD_* variable of the developer's shell leaks into these tests."""
    clear_relayd_env(monkeypatch)


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("127.0.0.1:9464", "http://127.0.0.1:9464/healthz"),
        ("0.0.0.0:9464", "http://127.0.0.1:9464/healthz"),
        ("[::]:8080", "http://[::1]:8080/healthz"),
        ("[::1]:8080", "http://[::1]:8080/healthz"),
        ("relayd.internal:1234", "http://relayd.internal:1234/healthz"),
    ],
)
def test_healthz_url_asks_loopback_for_a_wildcard_listen(listen: str, url: str) -> None:
    """A wildcard http.listen (the image's 0.0.0.0) is asked on loopback."""
    assert healthz_url(Settings(http={"listen": listen})) == url


def test_disabled_http_is_unhealthy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """http.enabled = false: nothing to ask, exit 1 with one line."""
    monkeypatch.setenv("RELAYD_HTTP__ENABLED", "false")
    monkeypatch.setenv("RELAYD_CONFIG", "")
    assert main(["healthcheck"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "relayd: unhealthy: http.enabled is false: no /healthz to ask\n"


def test_a_config_error_exits_1_not_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 is reserved by Docker's HEALTHCHECK: a bad setting is reported as unhealthy."""
    monkeypatch.setenv("RELAYD_HTTP__LISTEN", "nowhere")
    monkeypatch.setenv("RELAYD_CONFIG", "")
    assert main(["healthcheck"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("relayd: unhealthy: config error: http.listen: ")
    assert err.count("\n") == 1
