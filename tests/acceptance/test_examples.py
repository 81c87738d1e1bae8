"""The shipped example configurations, one per destination: each loads, `relayd config show`
prints it, and `relayd check` accepts it against a live server of its kind. Only what names
this machine is overridden from the environment (the DSN file, the server's address, the
secret file); every other key is the example's own."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import nats
import pytest

from relayd.settings import example_config, example_kinds
from relayd.testing.emulator import RunningEmulator
from relayd.testing.nats import NatsServer
from relayd.testing.webhook_receiver import receiving
from tests.support import Database, run_relayd

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "ojs": ROOT / "config.example.toml",
    "nats": ROOT / "examples" / "nats.toml",
    "webhook": ROOT / "examples" / "webhook.toml",
}
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # noqa: S105 - a test value


def test_every_kind_has_an_example_and_config_example_prints_it() -> None:
    assert example_kinds() == sorted(EXAMPLES)
    for kind, path in EXAMPLES.items():
        assert example_config(kind) == path.read_text()
        assert f'kind = "{kind}"' in path.read_text()


async def _check(kind: str, env: dict[str, str]) -> None:
    """`config show` and `check --json` accept the example of `kind`: every check passes."""
    path = EXAMPLES[kind]
    code, out, err = await run_relayd("config", "show", "--json", "--config", str(path), env=env)
    assert code == 0, err
    assert json.loads(out)["sink"]["kind"] == tomllib.loads(example_config(kind))["sink"]["kind"]
    code, out, err = await run_relayd("check", "--json", "--config", str(path), env=env)
    verdicts = {line["name"]: line for line in json.loads(out)}
    assert code == 0, (out, err)
    assert {line["verdict"] for line in verdicts.values()} <= {"ok", "warn"}, verdicts
    assert verdicts["sink"]["verdict"] == "ok", verdicts["sink"]


@pytest.fixture
def dsn_file(tmp_path: Path, database: Database) -> Path:
    path = tmp_path / "database-dsn"
    path.write_text(database.dsn + "\n")
    return path


async def test_the_ojs_example_checks_against_a_server(
    cli_env: dict[str, str], database: Database, emulator: RunningEmulator
) -> None:
    env = cli_env | {"RELAYD_DATABASE__DSN": database.dsn, "RELAYD_SINK__URL": emulator.url}
    await _check("ojs", env)


async def test_the_nats_example_checks_against_a_server(
    cli_env: dict[str, str], dsn_file: Path, nats_server: NatsServer
) -> None:
    """The stream the example names, taking every subject its routes name."""
    client = await nats.connect(nats_server.url)
    try:
        await client.jetstream().add_stream(name="EVENTS", subjects=["events.>"])
    finally:
        await client.close()
    env = cli_env | {
        "RELAYD_DATABASE__DSN_FILE": str(dsn_file),
        "RELAYD_SINK__SERVERS": json.dumps([nats_server.url]),
    }
    await _check("nats", env)


async def test_the_webhook_example_checks_against_a_receiver(
    cli_env: dict[str, str], dsn_file: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "webhook-secret"
    secret.write_text(SECRET + "\n")
    async with receiving([SECRET]) as receiver:
        env = cli_env | {
            "RELAYD_DATABASE__DSN_FILE": str(dsn_file),
            "RELAYD_SINK__URL": receiver.endpoint("hooks"),
            "RELAYD_SINK__SECRET_FILE": str(secret),
            "RELAYD_SINK__ROUTES": json.dumps(
                [{"type": "order.paid", "url": receiver.endpoint("orders")}]
            ),
        }
        await _check("webhook", env)
