"""An installed (non-editable) wheel carries its migrations and SQL, and runs what the
container image runs (`relayd --version`, `relayd run`, `relayd healthcheck`)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from relayd import __version__
from relayd.config import DEFAULT_CONFIG_PATH
from relayd.testing.emulator import RunningEmulator
from tests.support import Database, relayd_env, run_relayd_blocking

ROOT = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this tree."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    [built] = out.glob("relayd-*.whl")
    return built


@pytest.fixture(scope="module")
def installed_wheel(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed (without dependencies) into a private directory."""
    site = tmp_path_factory.mktemp("wheel") / "site"
    subprocess.run(
        [*PIP, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300
    )
    return site


def _env(site: Path, **extra: str) -> dict[str, str]:
    # The installed copy first, the venv's dependencies after; not the source tree.
    return relayd_env({"PYTHONPATH": str(site)} | extra)


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
    result = run_relayd_blocking("config", "example", env=_env(installed_wheel), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "config.example.toml").read_text()
    assert (installed_wheel / "relayd" / "config.example.toml").is_file()


def test_installed_wheel_migrates_a_database(
    installed_wheel: Path, empty_database: Database, tmp_path: Path
) -> None:
    """`relayd migrate` from the installed wheel creates the outbox."""
    config = tmp_path / "relayd.toml"
    config.write_text("")
    result = run_relayd_blocking(
        "migrate",
        "--json",
        env=_env(
            installed_wheel, RELAYD_CONFIG=str(config), RELAYD_DATABASE__DSN=empty_database.dsn
        ),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    shipped = sorted(path.stem for path in (ROOT / "migrations").glob("*.sql"))
    assert json.loads(result.stdout)["applied"] == shipped


# --- what the container image runs ---------------------------------------------------------


@pytest.fixture(scope="module")
def image_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment outside the tree with the wheel installed as the image
    installs it, its `relayd` script included. The dependencies come from the test
    environment's site-packages (a .pth line; the tests reach no package index), at the
    versions deploy/constraints.txt pins for the image."""
    venv = tmp_path_factory.mktemp("image") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [*PIP, "--python", str(python), "install", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def _image_env(**settings: str) -> dict[str, str]:
    """The image's environment: no RELAYD_CONFIG, its ENV lines, a home that does not exist."""
    return relayd_env(
        {"HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1", "RELAYD_LOG__FORMAT": "json"}
        | settings
    )


def _files(venv: Path) -> set[Path]:
    return {path for path in venv.rglob("*") if path.is_file()}


def test_image_command_reports_its_version(image_venv: Path, tmp_path: Path) -> None:
    """`relayd --version` from the installed script, in a directory outside the tree."""
    result = subprocess.run(
        [image_venv / "bin" / "relayd", "--version"],
        env=_image_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"relayd {__version__}\n"


def _healthcheck(venv: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv / "bin" / "relayd", "healthcheck", "--timeout", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def free_port() -> int:
    """A loopback port nothing listens on (as far as a bind can tell)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_healthcheck_answers_for_a_daemon_configured_by_environment_alone(
    image_venv: Path, database: Database, emulator: RunningEmulator, free_port: int
) -> None:
    """1. `relayd run` configured by the environment only (as the image is); 2. `relayd
    healthcheck` exits 0 with one line once it serves, and `relayd check` passes every
    check; 3. after SIGTERM, healthcheck exits 1 with one line; 4. nothing was written into
    the installation (a read-only root file system)."""
    if DEFAULT_CONFIG_PATH.exists():
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists on this machine: the run would read it")
    before = _files(image_venv)
    env = _image_env(
        RELAYD_DATABASE__DSN=database.dsn,
        RELAYD_SINK__URL=emulator.url,
        RELAYD_HTTP__LISTEN=f"127.0.0.1:{free_port}",
        RELAYD_RELAY__SHUTDOWN_GRACE_S="1",
    )
    # 1.
    daemon = await asyncio.create_subprocess_exec(
        image_venv / "bin" / "relayd",
        "run",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        # 2.
        async with asyncio.timeout(60):
            while (healthy := await asyncio.to_thread(_healthcheck, image_venv, env)).returncode:
                assert daemon.returncode is None, "relayd run exited"
                await asyncio.sleep(0.2)
        assert (
            healthy.stdout
            == f"relayd: healthy: http://127.0.0.1:{free_port}/healthz answered 200\n"
        )
        checked = await asyncio.create_subprocess_exec(
            image_venv / "bin" / "relayd",
            "check",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(60):
            out, err = await checked.communicate()
        assert checked.returncode == 0, (out + err).decode()
        assert [line.split()[1] for line in out.decode().splitlines()] == [
            "config",
            "database",
            "schema",
            "privileges",
            "listen",
            "sink",
            "clock",
        ]
        # 3.
        daemon.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, stderr = await daemon.communicate()
        assert daemon.returncode == 0, stderr.decode()[-2000:]
    finally:
        if daemon.returncode is None:
            daemon.kill()
            await daemon.wait()
    unhealthy = await asyncio.to_thread(_healthcheck, image_venv, env)
    assert unhealthy.returncode == 1
    assert unhealthy.stdout == ""
    assert unhealthy.stderr.startswith(f"relayd: unhealthy: http://127.0.0.1:{free_port}/healthz ")
    assert unhealthy.stderr.count("\n") == 1
    # 4.
    assert _files(image_venv) == before
