"""A sink kind plugs in from outside the product: a settings model derived from
`SinkSettings`, registered under a kind, and the daemon, `relayd check`, the demo's skeleton
and the configuration loader use it with no line of relayd knowing it. The throwaway kind
here puts rows on a shelf (a file, so that a relay in another process shares it), batches
them in pairs, and cannot be asked what it holds (so a row an earlier attempt may have
delivered is sent again)."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, ClassVar, Literal

import asyncpg
import pytest
import structlog

from relayd.core.envelope import Envelope
from relayd.core.errors import ConfigError
from relayd.core.outcomes import NotStarted, Outcome, Published, SinkDown
from relayd.core.rows import ClaimedRow
from relayd.daemon.lifecycle import Daemon
from relayd.demo import TABLE, Orders, Summary, note_problems, run_demo
from relayd.operator.check import Verdict, run_checks
from relayd.producer import new_job
from relayd.settings import load_settings
from relayd.sinks import (
    Capabilities,
    ExchangeObserver,
    SendWindow,
    SinkHealth,
    SinkSettings,
    registry,
    report,
)
from relayd.telemetry.metrics import RelayMetrics
from tests.support import Database, drained, produce

ROOT = Path(__file__).resolve().parents[3]


class MemorySettings(SinkSettings):
    kind: Literal["memory"] = "memory"
    shelf: Path  # a key of this kind only: the file where the rows go, one id a line
    fail_first: int = 0  # the first N requests time out after storing (an ambiguous outcome)

    sink_class: ClassVar[str] = f"{__name__}:MemorySink"
    demo: ClassVar[str | None] = f"{__name__}:MemoryDemo"

    @property
    def target(self) -> str:
        return f"memory shelf {self.shelf.name}"


def shelved(shelf: Path) -> list[str]:
    """Every row the shelf received, in order of arrival (a row may arrive twice)."""
    return shelf.read_text().split() if shelf.exists() else []


class MemorySink:
    def __init__(
        self, settings: MemorySettings, health: SinkHealth, *, observe: ExchangeObserver | None
    ) -> None:
        self._settings = settings
        self._health = health
        self._observe = observe
        self._failures_left = settings.fail_first
        self.started = False

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(batches=True, reconcile_by_id=False)

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        return [list(rows[i : i + 2]) for i in range(0, len(rows), 2)]

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, window: SendWindow
    ) -> dict[str, Outcome]:
        assert self.started
        if window.closed():
            return {row.event_id: NotStarted() for row in rows}
        with self._settings.shelf.open("a") as shelf:
            shelf.writelines(f"{row.event_id}\n" for row in rows)
        outcome: Outcome = Published(sink_state="shelved")
        if self._failures_left:
            self._failures_left -= 1
            outcome = SinkDown("stored, but the answer was lost")
        self._note("put", "ok" if isinstance(outcome, Published) else "timeout")
        return {row.event_id: report(self._health, outcome) for row in rows}

    async def check(self) -> tuple[bool, str]:
        return True, "the shelf answers"

    def _note(self, operation: str, code: str) -> None:
        if self._observe is not None:
            self._observe(operation, code)


class MemoryDemo:
    """The memory kind's part of `relayd demo`: a shelf in the demo's directory."""

    destination = "the shelf"
    requires: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._shelf: Path | None = None

    async def start(self, stack: AsyncExitStack, base: Path) -> dict[str, Any]:
        self._shelf = base / "shelf"
        return {"shelf": str(self._shelf)}

    def orders(self) -> Orders:
        return Orders(
            lambda ids: [new_job("order.shelve", [{"order_id": n}]) for n in ids],
            {"too_large": new_job("order.shelve", ["x" * (2 * 1024 * 1024)])},
        )

    async def check(self, watch: asyncpg.Connection, summary: Summary) -> None:
        assert self._shelf is not None
        rows = await watch.fetch(
            f"SELECT event_id::text FROM {TABLE.qualified} WHERE published_at IS NOT NULL"
        )
        published, seen = {row["event_id"] for row in rows}, set(shelved(self._shelf))
        note_problems(
            summary,
            "shelf check",
            [
                (len(published - seen), "published ids not on the shelf"),
                (len(seen - published), "ids on the shelf the outbox does not hold published"),
            ],
        )

    def verdict(self) -> tuple[str, str, str]:
        return ("(never: re-sent instead)", "shelf check", "every published id is on the shelf")


@pytest.fixture
def memory_kind() -> Iterator[None]:
    with registry.registered(MemorySettings, "memory"):
        yield


def _config(tmp_path: Path, database: Database, sink: str) -> Path:
    path = tmp_path / "relayd.toml"
    path.write_text(
        f"[database]\ndsn = {database.dsn!r}\n"
        "[relay]\nworkers = 2\nbatch_size = 10\nlease_s = 10.0\npoll_interval_s = 0.2\n"
        "[retry]\nbase_s = 0.01\ncap_s = 0.05\n"
        "[http]\nenabled = false\n[cleanup]\nenabled = false\n"
        f"[sink]\nkind = 'memory'\ntimeout_s = 2.0\n{sink}"
    )
    return path


async def _run(path: Path) -> Daemon:
    daemon = Daemon(
        load_settings(path), metrics=RelayMetrics(), rng=random.Random(3), until_idle=True
    )
    assert await daemon.run() == 0
    return daemon


async def test_the_daemon_publishes_through_a_kind_registered_from_outside(
    memory_kind: None, tmp_path: Path, database: Database, conn: asyncpg.Connection
) -> None:
    """Rows go to the registered kind, grouped as it asked (it batches), each once; the
    sink-request metric is labelled with the kind and the kind's own operation."""
    ids = await produce(conn, 25)
    shelf = tmp_path / "a"
    daemon = await _run(_config(tmp_path, database, f"shelf = '{shelf}'\n"))
    assert await drained(conn)
    assert sorted(shelved(shelf)) == sorted(ids)
    puts = daemon.metrics.registry.get_sample_value(
        "relayd_sink_requests_total", {"sink": "memory", "operation": "put", "code": "ok"}
    )
    assert puts is not None
    assert 13 <= puts < 25  # in pairs (an odd row, or a claim's last, goes alone)


async def test_an_ambiguous_outcome_is_resent_where_the_sink_cannot_be_asked(
    memory_kind: None, tmp_path: Path, database: Database, conn: asyncpg.Connection
) -> None:
    """Without reconciliation by id, a row whose answer was lost is sent again with the same
    id (at least once), and the relay says so for each such row."""
    [event_id] = await produce(conn, 1)
    shelf = tmp_path / "b"
    with structlog.testing.capture_logs() as logs:
        await _run(_config(tmp_path, database, f"shelf = '{shelf}'\nfail_first = 1\n"))
    assert await drained(conn)
    assert shelved(shelf) == [event_id, event_id]
    resent = [entry for entry in logs if entry["event"] == "relay.resending"]
    assert [entry["event_id"] for entry in resent] == [event_id]


async def test_check_names_the_target_and_what_an_ambiguous_outcome_means(
    memory_kind: None, tmp_path: Path, database: Database
) -> None:
    settings = load_settings(_config(tmp_path, database, "shelf = '/tmp/c'\n"))
    lines = {line.name: line for line in await run_checks(settings, "test")}
    assert lines["sink"].verdict is Verdict.OK
    assert lines["sink"].detail == (
        "memory shelf c: the shelf answers; "
        "an unanswered attempt is re-sent with the same id, for the destination to dedupe"
    )


class ClientlessSettings(MemorySettings):
    """The memory kind, needing a client library that is not installed."""

    client_modules: ClassVar[tuple[str, ...]] = ("relayd_no_such_client",)
    extra: ClassVar[str | None] = "memory"


async def test_a_kind_without_its_client_names_the_extra(
    tmp_path: Path, database: Database
) -> None:
    """`relayd check` fails its sink line, and `relayd run` refuses to start (a configuration
    error: exit 2), each naming the extra that installs the kind's client."""
    with registry.registered(ClientlessSettings, "memory"):
        settings = load_settings(_config(tmp_path, database, "shelf = '/tmp/d'\n"))
        lines = {line.name: line for line in await run_checks(settings, "test")}
        with pytest.raises(ConfigError, match=r"install relayd\[memory\]") as refused:
            await Daemon(settings, metrics=RelayMetrics()).run()
    assert lines["sink"].verdict is Verdict.FAIL
    assert (
        "relayd_no_such_client, which is not installed: install relayd[memory]"
        in lines["sink"].detail
    )
    assert refused.value.key == "sink.kind"


# `relayd`, run by a child process that registers the memory kind first, as this test does.
_RELAYD_WITH_MEMORY = (
    sys.executable,
    "-c",
    f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
    "from relayd.cli import main\n"
    "from relayd.sinks import registry\n"
    f"from {__name__} import MemorySettings\n"
    "with registry.registered(MemorySettings, 'memory'):\n"
    "    sys.exit(main())\n",
)


def test_the_demo_skeleton_runs_the_kind_end_to_end(
    memory_kind: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`relayd demo --sink memory`'s skeleton: an embedded PostgreSQL, the kind's stand-in,
    a relay of the kind, the orders and the poison row, then the kind's own check."""
    assert run_demo(120, kind="memory", relayd=_RELAYD_WITH_MEMORY) == 0
    out = capsys.readouterr().out
    assert "relayd run    pid " in out
    assert "[sink] kind = memory: memory shelf shelf" in out
    assert "committed              121 rows (120 orders + 1 poison)" in out
    assert "dead-lettered            1 (too_large 1)" in out
    assert "shelf check        OK: every published id is on the shelf" in out


def test_keys_are_those_of_the_configured_kind(
    memory_kind: None, tmp_path: Path, database: Database
) -> None:
    """A key of another kind is refused naming that kind; a key this kind requires is
    named when missing; an unknown kind lists the registered ones."""
    with pytest.raises(ConfigError) as refused:
        load_settings(_config(tmp_path, database, "shelf = '/tmp/e'\nurl = 'http://x:1'\n"))
    assert str(refused.value) == "sink.url: unknown key for sink kind 'memory' (a key of 'ojs')"
    with pytest.raises(ConfigError) as missing:
        load_settings(_config(tmp_path, database, ""))
    assert str(missing.value).startswith("sink.shelf: ")
    path = _config(tmp_path, database, "shelf = '/tmp/e'\n")
    path.write_text(path.read_text().replace("'memory'", "'kafka'"))
    with pytest.raises(ConfigError) as unknown:
        load_settings(path)
    assert (
        str(unknown.value)
        == "sink.kind: unknown sink kind 'kafka' (relayd knows 'memory', 'nats', 'ojs', 'webhook')"
    )
