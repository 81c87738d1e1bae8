"""Secret files at load (sink.token_file, database.dsn_file): only a regular file of at most
64 KiB is read, never a FIFO, a device or a directory, and without blocking on one; a token
must be sendable as a bearer header value. Every refusal is one ConfigError naming the key,
never quoting the file's content."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from relayd.cli import main
from relayd.config.secret_files import SECRET_MAX_BYTES, bearer_problem, read_secret_file
from relayd.core.errors import ConfigError
from relayd.settings import load_settings
from tests.support import clear_relayd_env, ojs_settings, relayd_argv
from tests.tools import tool

# A FIFO read the old way blocks until a writer appears: on the code before the fix these
# tests hang, and this bound turns the hang into a failure.
_NO_BLOCK = pytest.mark.timeout(10)

SECRET_TAIL = "Zq7-rotated-by-ops"  # noqa: S105 - a test value, not a credential


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RELAYD_* variable of the developer's shell leaks into these tests."""
    clear_relayd_env(monkeypatch)


def _config(tmp_path: Path, key: str, secret: Path) -> Path:
    section, name = key.split(".")
    path = tmp_path / "relayd.toml"
    path.write_text(f'[{section}]\n{name} = "{secret}"\n')
    return path


def _load_error(tmp_path: Path, key: str, secret: Path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_settings(_config(tmp_path, key, secret))
    return caught.value


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("abc.DEF_123-~+/=", None),
        ("!\"#$%&'()*,:;<>?@[\\]^`{|}", None),
        ("tok\n# " + SECRET_TAIL, "a line break at character 4"),
        ("tok\r" + SECRET_TAIL, "a line break at character 4"),
        ("tok\x00" + SECRET_TAIL, "a control character at character 4"),
        ("tok\x7f" + SECRET_TAIL, "a control character at character 4"),
        ("tok\x1b]52;c;" + SECRET_TAIL, "a control character at character 4"),
        ("tok " + SECRET_TAIL, "whitespace at character 4"),
        ("tok\t" + SECRET_TAIL, "whitespace at character 4"),
        ("tøk" + SECRET_TAIL, "a non-ASCII character at character 2"),
        ("tok\u2028" + SECRET_TAIL, "a non-ASCII character at character 4"),
    ],
)
def test_a_bearer_token_is_one_line_of_visible_ascii(token: str, problem: str | None) -> None:
    """The one rule for a sendable token; the problem names a kind and a position only."""
    found = bearer_problem(token)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert found.startswith(problem)
        assert SECRET_TAIL not in found


@pytest.mark.parametrize(
    "content",
    [
        f"tok\n# {SECRET_TAIL}\n",
        f"tok\r{SECRET_TAIL}",
        f"tok\x00{SECRET_TAIL}",
        f"tok {SECRET_TAIL}",
        f"tøk{SECRET_TAIL}",
    ],
)
def test_a_token_that_cannot_be_sent_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    """Refused at load (exit 2, one line naming sink.token_file), not at the first
    POST; the message never shows the token."""
    secret = tmp_path / "token"
    secret.write_text(content)
    error = _load_error(tmp_path, "sink.token_file", secret)
    assert error.key == "sink.token_file"
    assert "does not hold a bearer token" in str(error)
    assert SECRET_TAIL not in str(error)
    assert main(["check", "--config", str(_config(tmp_path, "sink.token_file", secret))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("relayd: config error: sink.token_file: ")
    assert SECRET_TAIL not in err


def test_surrounding_whitespace_is_not_part_of_the_token(tmp_path: Path) -> None:
    """A trailing newline, or spaces around the token, are trimmed before the rule applies."""
    secret = tmp_path / "token"
    secret.write_text(f"  tok-{SECRET_TAIL}\r\n\n")
    settings = load_settings(_config(tmp_path, "sink.token_file", secret))
    token = ojs_settings(settings).token
    assert token is not None
    assert token.get_secret_value() == f"tok-{SECRET_TAIL}"


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _directory(tmp_path: Path) -> Path:
    path = tmp_path / "secrets.d"
    path.mkdir()
    return path


@_NO_BLOCK
@pytest.mark.parametrize("key", ["sink.token_file", "database.dsn_file"])
@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (_fifo, "is a FIFO, not a regular file"),
        (_directory, "is a directory, not a regular file"),
    ],
)
def test_a_secret_file_that_is_not_a_regular_file_is_refused_at_once(
    tmp_path: Path, key: str, make: object, kind: str
) -> None:
    """A FIFO (which would block the reader) and a directory are refused without
    being read: one ConfigError."""
    assert callable(make)
    secret: Path = make(tmp_path)
    error = _load_error(tmp_path, key, secret)
    assert error.key == key
    assert kind in str(error)


def test_a_secret_file_over_the_bound_is_refused(tmp_path: Path) -> None:
    """At most SECRET_MAX_BYTES are read; a larger file is refused, not read whole."""
    secret = tmp_path / "token"
    secret.write_text("a" * SECRET_MAX_BYTES)
    assert read_secret_file(secret) == "a" * SECRET_MAX_BYTES
    secret.write_text("a" * (SECRET_MAX_BYTES + 1))
    error = _load_error(tmp_path, "sink.token_file", secret)
    assert error.key == "sink.token_file"
    assert f"larger than {SECRET_MAX_BYTES} bytes" in str(error)


# The address space of the process that meets /dev/zero: if a regression read it, the
# process fails on its own instead of growing until the kernel kills something on the
# machine.
_ZERO_AS_BYTES = 1024**3


@pytest.mark.parametrize("key", ["sink.token_file", "database.dsn_file"])
def test_a_secret_file_linked_to_dev_zero_is_refused_unread(
    cli_env: dict[str, str], tmp_path: Path, key: str
) -> None:
    """/dev/zero behind a symlink (which would be read without end) is refused at
    once: `relayd check` (which reads every secret file) exits 2 with one line naming the
    key."""
    secret = tmp_path / "zero"
    secret.symlink_to("/dev/zero")
    prlimit = str(tool("prlimit", "util-linux"))
    argv = [prlimit, f"--as={_ZERO_AS_BYTES}", "--", *relayd_argv()]
    result = subprocess.run(
        [*argv, "check", "--config", str(_config(tmp_path, key, secret))],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        f"relayd: config error: {key}: {secret} is a character device, not a regular file\n"
    )
