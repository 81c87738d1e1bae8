"""Who uses the console: the password file's users (HTTP basic), a trusted proxy's header,
or the local user on loopback; the CSRF token bound to each user."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from relayd.config.console import ConsoleSettings
from relayd.console.auth import Gate, Unauthenticated, read_password_file
from relayd.core.errors import ConfigError


def _basic(credentials: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(credentials.encode()).decode()}


def _users(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "users"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_the_password_file_is_name_password_lines(tmp_path: Path) -> None:
    """Comments and blank lines skipped; a password may hold colons and spaces."""
    path = _users(tmp_path, "# ops\n\nalice:pa:ss word\nbob:x\n")
    assert read_password_file(path) == {"alice": "pa:ss word", "bob": "x"}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("alice\n", "line 1: expected name:password"),
        ("alice:\n", "line 1: expected name:password"),
        ("a:1\na:2\n", "line 2: user 'a' given twice"),
        ("# nobody\n", "names no user"),
    ],
)
def test_a_bad_password_file_names_the_key_and_the_line(
    tmp_path: Path, text: str, reason: str
) -> None:
    """One ConfigError naming console.password_file and the line, never its content."""
    with pytest.raises(ConfigError, match=reason) as caught:
        read_password_file(_users(tmp_path, text))
    assert caught.value.key == "console.password_file"


def test_basic_admits_a_listed_user_with_the_right_password(tmp_path: Path) -> None:
    gate = Gate.from_settings(ConsoleSettings(password_file=_users(tmp_path, "alice:s3\n")))
    assert gate.user(_basic("alice:s3")) == "alice"
    for headers in ({}, _basic("alice:s4"), _basic("bob:s3"), {"Authorization": "Basic !!"}):
        with pytest.raises(Unauthenticated):
            gate.user(headers)


def test_a_proxy_header_names_the_user() -> None:
    gate = Gate.from_settings(ConsoleSettings(proxy_user_header="X-Remote-User"))
    assert gate.user({"X-Remote-User": " dana "}) == "dana"
    for value in ("", "a\nb", "x" * 201):
        with pytest.raises(Unauthenticated):
            gate.user({"X-Remote-User": value})


def test_the_csrf_token_is_the_users_and_this_consoles() -> None:
    """Another user's token, or another console's (a restart), is not valid."""
    gate, other = Gate(None, local_user="op"), Gate(None, local_user="op")
    token = gate.csrf_token("alice")
    assert gate.csrf_valid("alice", token)
    assert not gate.csrf_valid("bob", token)
    assert not other.csrf_valid("alice", token)
    assert not gate.csrf_valid("alice", "")


@pytest.mark.parametrize(
    ("console", "key"),
    [
        ({"listen": "0.0.0.0:8437"}, "console.listen"),
        ({"listen": "10.1.2.3:8437"}, "console.listen"),
        ({"listen": "relayd.internal:8437"}, "console.listen"),
        ({"listen": "localhost:8437", "proxy_user_header": "bad header"}, "proxy_user_header"),
    ],
)
def test_settings_refuse_an_unauthenticated_bind_beyond_loopback(
    console: dict[str, str], key: str
) -> None:
    with pytest.raises(ValueError, match=key.rpartition(".")[2]):
        ConsoleSettings(**console)


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "[::1]:8437", "localhost:8437", "127.8.9.1:1"])
def test_loopback_needs_no_authentication(listen: str) -> None:
    assert ConsoleSettings(listen=listen).authentication is None
