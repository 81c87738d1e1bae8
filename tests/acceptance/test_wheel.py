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
import tarfile
import zipfile
from pathlib import Path

import asyncpg
import pytest

from relayd.core import __version__
from relayd.settings import DEFAULT_CONFIG_PATH
from relayd.testing.emulator import RunningEmulator
from tests.support import Database, produce, relayd_env, run_relayd_blocking

ROOT = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


# What `make dist` runs: the sdist, then the wheel built from the sdist (so the sdist is
# proven complete), with the build backend already installed (no package index).
DIST = ["-m", "build", "--no-isolation", "--outdir"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make dist`'s output for this tree: a directory holding the sdist and the wheel."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, *DIST, str(out), str(ROOT)], check=True, timeout=300, capture_output=True
    )
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    [built] = dist.glob("relayd-*.whl")
    return built


def test_make_dist_builds_an_sdist_and_a_wheel(dist: Path) -> None:
    """`make dist` runs the build above; the sdist carries what a clone documents (docs,
    examples, deployment), the wheel every example configuration."""
    assert " ".join(DIST) in (ROOT / "Makefile").read_text()
    [sdist] = dist.glob("relayd-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for shipped in (
        "README.md",
        "docs/nats.md",
        "examples/nats.toml",
        "deploy/systemd/relayd.service",
    ):
        assert shipped in names, shipped
    with zipfile.ZipFile(next(dist.glob("relayd-*.whl"))) as archive:
        wheel_names = set(archive.namelist())
    for example in ("config.example.toml", "examples/nats.toml", "examples/webhook.toml"):
        assert f"relayd/{example}" in wheel_names


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
        "import json, relayd, relayd.store.migrations as m; "
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


def _venv_with(wheel: Path, venv: Path) -> tuple[Path, Path]:
    """A fresh virtual environment at `venv` with the wheel installed, without its
    dependencies; the environment and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [*PIP, "--python", str(python), "install", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return venv, Path(site)


@pytest.fixture(scope="module")
def image_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment outside the tree with the wheel installed as the image
    installs it, its `relayd` script included. The dependencies come from the test
    environment's site-packages (a .pth line; the tests reach no package index), at the
    versions deploy/constraints.txt pins for the image."""
    venv, site = _venv_with(wheel, tmp_path_factory.mktemp("image") / "venv")
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


_APPEND = """
import asyncio, sys
import asyncpg
from pydantic import BaseModel
from relayd.producer import Outbox, append, define_event

class OrderPlacedV1(BaseModel):
    order_id: int

OrderPlaced = define_event("order.placed", 1, OrderPlacedV1)

async def main() -> None:
    conn = await asyncpg.connect(sys.argv[1])
    event = OrderPlaced.new(OrderPlacedV1(order_id=42))
    async with conn.transaction():
        await append(conn, event, outbox=Outbox())
    print(event.id)
    await conn.close()

asyncio.run(main())
"""


async def test_the_installed_wheel_runs_the_demo_and_a_producer_append(
    image_venv: Path, database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """What docs/install.md promises of `pip install dist/relayd-*.whl`: `relayd demo` runs
    end to end, and a producer appends an event with the installed package."""
    demo = await asyncio.create_subprocess_exec(
        image_venv / "bin" / "relayd",
        "demo",
        env=relayd_env({"RELAYD_CONFIG": "/nonexistent"}),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(180):
        out, err = await demo.communicate()
    assert demo.returncode == 0, (out.decode()[-2000:], err.decode()[-2000:])
    append = await asyncio.create_subprocess_exec(
        image_venv / "bin" / "python",
        "-c",
        _APPEND,
        database.dsn,
        env=relayd_env({}),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await append.communicate()
    assert append.returncode == 0, err.decode()[-2000:]
    stored = await conn.fetchval(
        "SELECT job->>'type' FROM relayd.outbox WHERE event_id = $1::uuid", out.decode().strip()
    )
    assert stored == "order.placed"


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
            "recovery",
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


# --- what a plain install holds and needs -----------------------------------------------------

# The fault suite's switches: test code, in no wheel (tests/faults/switches/).
_TEST_RIG = ("mutants", "failpoints", "launch", "patches", "webhook_mutants")


def test_the_wheel_carries_no_test_rig(wheel: Path) -> None:
    """The built wheel holds relayd's modules, its SQL and migrations, and none of the fault
    suite's switches (mutants, failpoints, their launcher)."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    modules = {Path(name).stem for name in names if name.endswith(".py")}
    assert modules.isdisjoint(_TEST_RIG), sorted(modules & set(_TEST_RIG))
    assert not [name for name in names if name.startswith("tests/")]
    assert "relayd/engine/relay.py" in names
    assert "relayd/store/sql/cycle.sql" in names
    assert "relayd/_migrations/0001_outbox.sql" in names


# A destination's client library, and what it alone brings: not in a plain install.
_NATS_EXTRA = frozenset({"nats", "nkeys", "nacl"})


@pytest.fixture(scope="module")
def plain_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel and relayd's own dependencies, as `pip
    install relayd` leaves it: no extra, so no NATS client. The dependencies are this test
    environment's, less the `nats` extra's packages (the tests reach no package index)."""
    root = tmp_path_factory.mktemp("plain")
    venv, site = _venv_with(wheel, root / "venv")
    dependencies = root / "dependencies"
    dependencies.mkdir()
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower().replace("_py", "")
        if top in _NATS_EXTRA or entry.name.startswith(("relayd", "_relayd", "__editable__")):
            continue
        (dependencies / entry.name).symlink_to(entry)
    (site / "zz_test_dependencies.pth").write_text(f"{dependencies}\n")
    return venv


async def test_a_plain_install_relays_without_the_nats_client(
    plain_venv: Path,
    database: Database,
    conn: asyncpg.Connection,
    emulator: RunningEmulator,
    tmp_path: Path,
) -> None:
    """1. Without the `nats` extra the NATS client cannot be imported; 2. `relayd run`
    against an OJS server publishes every row; 3. `kind = "nats"` is refused in one line
    naming the extra, exit 2, by `relayd run` and `relayd check` alike."""
    python, relayd = plain_venv / "bin" / "python", plain_venv / "bin" / "relayd"
    # 1.
    probe = await asyncio.to_thread(
        subprocess.run,
        [str(python), "-c", "import relayd, nats"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "No module named 'nats'" in probe.stderr
    # 2.
    ids = await produce(conn, 20)
    config = tmp_path / "relayd.toml"
    config.write_text(
        f"[database]\ndsn = {database.dsn!r}\n[sink]\nurl = {emulator.url!r}\n"
        "[http]\nenabled = false\n[relay]\npoll_interval_s = 0.1\n"
    )
    env = relayd_env({"RELAYD_CONFIG": str(config)})
    daemon = await asyncio.create_subprocess_exec(
        relayd, "run", env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(60):
            while set(ids) - set(emulator.emulator.ledger()):
                assert daemon.returncode is None, "relayd run exited"
                await asyncio.sleep(0.1)
        daemon.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, stderr = await daemon.communicate()
        assert daemon.returncode == 0, stderr.decode()[-2000:]
    finally:
        if daemon.returncode is None:
            daemon.kill()
            await daemon.wait()
    # 3.
    config.write_text(
        f"[database]\ndsn = {database.dsn!r}\n[http]\nenabled = false\n"
        "[sink]\nkind = 'nats'\nservers = ['nats://127.0.0.1:4222']\nstream = 'E'\n"
        "routes = [{type = 'order.paid', subject = 'orders.paid'}]\n"
    )
    refused = (
        "relayd: config error: sink.kind: kind 'nats' needs nats, nkeys, which is not "
        "installed: install relayd[nats] (pip install '.[nats]' in a clone, or the wheel with "
        "[nats]: docs/install.md)\n"
    )
    for command in ("run", "check"):
        result = await asyncio.to_thread(
            subprocess.run,
            [str(relayd), command],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if command == "run":
            assert (result.returncode, result.stderr) == (2, refused)
        else:
            assert result.returncode == 1
            assert "sink.kind: kind 'nats' needs nats, nkeys" in result.stdout
