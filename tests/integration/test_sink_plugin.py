"""A sink kind plugs in from outside the product: a settings model derived from
`SinkSettings`, registered under a kind, and the daemon, `relayd check` and the
configuration loader use it with no line of relay.py, daemon.py, check.py or cli.py knowing
it. The throwaway kind here stores rows in memory, batches them in pairs, and cannot be
asked what it holds (so a row an earlier attempt may have delivered is sent again)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import asyncpg
import pytest
import structlog

from relayd.config import load_settings
from relayd.daemon import Daemon
from relayd.errors import ConfigError
from relayd.metrics import RelayMetrics
from relayd.models import ClaimedRow, Envelope, NotFound, Outcome, Published, SinkDown
from relayd.operator.check import Verdict, run_checks
from relayd.sinks import Capabilities, ExchangeObserver, Sink, SinkHealth, SinkSettings, registry
from tests.support import Database, drained, produce


class MemorySettings(SinkSettings):
    kind: Literal["memory"] = "memory"
    shelf: str  # a key of this kind only: where the rows go
    fail_first: int = 0  # the first N requests time out after storing (an ambiguous outcome)

    @property
    def target(self) -> str:
        return f"memory shelf {self.shelf}"

    def build(self, health: SinkHealth, observe: ExchangeObserver | None = None) -> Sink:
        return MemorySink(self, health, observe)


# Every row each shelf received, in order of arrival (a row may arrive twice).
SHELVES: dict[str, list[str]] = {}


class MemorySink:
    def __init__(
        self, settings: MemorySettings, health: SinkHealth, observe: ExchangeObserver | None
    ) -> None:
        self._settings = settings
        self._health = health
        self._observe = observe
        self._failures_left = settings.fail_first
        self.requests: list[int] = []
        self.started = False

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(batches=True, reconcile_by_id=False)

    async def start(self) -> None:
        self.started = True
        SHELVES.setdefault(self._settings.shelf, [])

    async def close(self) -> None:
        self.started = False

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        return [list(rows[i : i + 2]) for i in range(0, len(rows), 2)]

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, send_by: float
    ) -> dict[str, Outcome]:
        assert self.started
        self.requests.append(len(rows))
        SHELVES[self._settings.shelf].extend(row.event_id for row in rows)
        if self._failures_left:
            self._failures_left -= 1
            self._note("put", "timeout")
            self._health.sink_failed(severe=False)
            return {row.event_id: SinkDown("stored, but the answer was lost") for row in rows}
        self._note("put", "ok")
        self._health.sink_accepted()
        return {row.event_id: Published(sink_state="shelved") for row in rows}

    async def check(self) -> tuple[bool, str]:
        return True, "the shelf answers"

    async def reconcile(self, row: ClaimedRow, envelope: Envelope) -> Outcome | NotFound:
        return NotFound()

    def _note(self, operation: str, code: str) -> None:
        if self._observe is not None:
            self._observe(operation, code)


@pytest.fixture
def memory_kind() -> Iterator[None]:
    SHELVES.clear()
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
    daemon = await _run(_config(tmp_path, database, "shelf = 'a'\n"))
    assert await drained(conn)
    assert sorted(SHELVES["a"]) == sorted(ids)
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
    with structlog.testing.capture_logs() as logs:
        await _run(_config(tmp_path, database, "shelf = 'b'\nfail_first = 1\n"))
    assert await drained(conn)
    assert SHELVES["b"] == [event_id, event_id]
    resent = [entry for entry in logs if entry["event"] == "relay.resending"]
    assert [entry["event_id"] for entry in resent] == [event_id]


async def test_check_names_the_target_and_what_an_ambiguous_outcome_means(
    memory_kind: None, tmp_path: Path, database: Database
) -> None:
    settings = load_settings(_config(tmp_path, database, "shelf = 'c'\n"))
    lines = {line.name: line for line in await run_checks(settings, "test")}
    assert lines["sink"].verdict is Verdict.OK
    assert lines["sink"].detail == (
        "memory shelf c: the shelf answers; "
        "an unanswered attempt is re-sent with the same id, for the destination to dedupe"
    )


def test_keys_are_those_of_the_configured_kind(
    memory_kind: None, tmp_path: Path, database: Database
) -> None:
    """A key of another kind is refused naming that kind; a key this kind requires is
    named when missing; an unknown kind lists the registered ones."""
    with pytest.raises(ConfigError) as refused:
        load_settings(_config(tmp_path, database, "shelf = 'd'\nurl = 'http://x:1'\n"))
    assert str(refused.value) == "sink.url: unknown key for sink kind 'memory' (a key of 'ojs')"
    with pytest.raises(ConfigError) as missing:
        load_settings(_config(tmp_path, database, ""))
    assert str(missing.value).startswith("sink.shelf: ")
    path = _config(tmp_path, database, "shelf = 'd'\n")
    path.write_text(path.read_text().replace("'memory'", "'kafka'"))
    with pytest.raises(ConfigError) as unknown:
        load_settings(path)
    assert (
        str(unknown.value)
        == "sink.kind: unknown sink kind 'kafka' (relayd knows 'memory', 'nats', 'ojs', 'webhook')"
    )
