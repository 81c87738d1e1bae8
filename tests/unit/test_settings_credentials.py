"""systemd credentials: unset secrets are read from $CREDENTIALS_DIRECTORY (relayd/settings.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayd.core.errors import ConfigError
from relayd.settings import load_settings
from tests.support import clear_relayd_env, ojs_settings

DSN = "postgresql://relayd:s3cret@db.internal:5432/app"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RELAYD_* or credentials variable of the developer's shell leaks into these tests."""
    clear_relayd_env(monkeypatch)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)


@pytest.fixture
def credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A credentials directory as systemd makes it for a unit called anything."""
    directory = tmp_path / "credentials" / "relayd-eu@2.service"
    directory.mkdir(parents=True)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(directory))
    return directory


def _config(tmp_path: Path, text: str = "") -> Path:
    path = tmp_path / "relayd.toml"
    path.write_text(text)
    return path


def test_both_credentials_are_read_when_nothing_is_set(tmp_path: Path, credentials: Path) -> None:
    """database-dsn and ojs-token fill database.dsn_file and sink.token_file."""
    (credentials / "database-dsn").write_text(DSN + "\n")
    (credentials / "ojs-token").write_text("t0ken\n")
    settings = load_settings(_config(tmp_path))
    assert settings.dsn == DSN
    assert settings.database.dsn_file == credentials / "database-dsn"
    token = ojs_settings(settings).token
    assert token is not None
    assert token.get_secret_value() == "t0ken"
    # Shown as its source, the credential's path, never the DSN (config show loads back).
    database = settings.redacted()["database"]
    assert (database["dsn"], database["dsn_file"]) == (None, str(credentials / "database-dsn"))


def test_a_missing_optional_credential_leaves_the_setting_unset(
    tmp_path: Path, credentials: Path
) -> None:
    """No ojs-token credential: no token, and no error (the OJS server may need none)."""
    (credentials / "database-dsn").write_text(DSN)
    settings = load_settings(_config(tmp_path))
    assert ojs_settings(settings).token_file is None
    assert ojs_settings(settings).token is None


def test_a_missing_dsn_credential_is_the_usual_config_error(
    tmp_path: Path, credentials: Path
) -> None:
    """No DSN from anywhere: the one-line error naming database.dsn."""
    settings = load_settings(_config(tmp_path))
    with pytest.raises(ConfigError, match=r"^database\.dsn: required"):
        _ = settings.dsn


@pytest.mark.parametrize(
    "explicit",
    [
        '[database]\ndsn = "postgresql://other@elsewhere/db"\n',
        '[database]\ndsn_file = "{other}"\n',
    ],
)
def test_explicit_settings_win_over_credentials(
    tmp_path: Path, credentials: Path, explicit: str
) -> None:
    """A DSN or DSN file in the configuration is used; the credential is ignored."""
    other = tmp_path / "other-dsn"
    other.write_text("postgresql://other@elsewhere/db")
    (credentials / "database-dsn").write_text(DSN)
    settings = load_settings(_config(tmp_path, explicit.format(other=other)))
    assert settings.dsn == "postgresql://other@elsewhere/db"


def test_environment_token_file_wins_over_the_credential(
    tmp_path: Path, credentials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELAYD_SINK__TOKEN_FILE is used even when an ojs-token credential exists."""
    (credentials / "ojs-token").write_text("from-credential")
    mine = tmp_path / "token"
    mine.write_text("from-env")
    monkeypatch.setenv("RELAYD_SINK__TOKEN_FILE", str(mine))
    token = ojs_settings(load_settings(_config(tmp_path))).token
    assert token is not None
    assert token.get_secret_value() == "from-env"


def test_an_empty_credential_is_refused_naming_the_key(tmp_path: Path, credentials: Path) -> None:
    """A credential is a secret file like any other: empty is an error naming the key."""
    (credentials / "database-dsn").write_text("\n")
    with pytest.raises(ConfigError, match=r"^database\.dsn_file: .*database-dsn is empty"):
        load_settings(_config(tmp_path))


def test_without_credentials_directory_nothing_changes(tmp_path: Path) -> None:
    """Outside systemd the secrets stay unset."""
    settings = load_settings(_config(tmp_path))
    assert settings.database.dsn_file is None
    assert ojs_settings(settings).token_file is None
