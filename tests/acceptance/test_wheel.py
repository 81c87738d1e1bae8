"""An installed (non-editable) wheel carries its migrations and SQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import Database

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel and install it (without dependencies) into a private directory."""
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out / "dist"), str(ROOT)],
        check=True,
        timeout=300,
    )
    [wheel] = (out / "dist").glob("relayd-*.whl")
    site = out / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300
    )
    return site


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYD_")}
    # The installed copy first, the venv's dependencies after; not the source tree.
    env["PYTHONPATH"] = str(site)
    return env | extra


def test_installed_wheel_finds_its_migrations(installed_wheel: Path, tmp_path: Path) -> None:
    """load_migrations() reads relayd/_migrations from the installed package."""
    script = (
        "import json, relayd, relayd.migrate as m; "
        "print(json.dumps({'pkg': relayd.__file__, 'dir': str(m.migrations_dir()), "
        "'versions': [x.version for x in m.load_migrations()]}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(installed_wheel),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    found = json.loads(result.stdout)
    assert found["pkg"].startswith(str(installed_wheel))
    assert found["dir"].startswith(str(installed_wheel / "relayd" / "_migrations"))
    assert found["versions"][0] == 1


def test_installed_wheel_ships_the_example_configuration(
    installed_wheel: Path, tmp_path: Path
) -> None:
    """`relayd config example` from the installed wheel (no source tree) prints the example."""
    result = subprocess.run(
        [sys.executable, "-m", "relayd", "config", "example"],
        env=_env(installed_wheel),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "config.example.toml").read_text()
    assert (installed_wheel / "relayd" / "config.example.toml").is_file()


def test_installed_wheel_migrates_a_database(
    installed_wheel: Path, empty_database: Database, tmp_path: Path
) -> None:
    """`relayd migrate` from the installed wheel creates the outbox."""
    config = tmp_path / "relayd.toml"
    config.write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "relayd", "migrate", "--json"],
        env=_env(
            installed_wheel, RELAYD_CONFIG=str(config), RELAYD_DATABASE__DSN=empty_database.dsn
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    shipped = sorted(path.stem for path in (ROOT / "migrations").glob("*.sql"))
    assert json.loads(result.stdout)["applied"] == shipped
