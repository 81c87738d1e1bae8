"""The sink's bearer token follows sink.token_file when an operator rotates it: looked at no
more than once a second and at once after a 401/403; an unusable file keeps the token in use
with one warning; no token, old or new, reaches a log or an error text."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog

from relayd.config import SinkSettings
from relayd.models import Envelope, Outcome, Published, SinkDown
from relayd.sinks.ojs import OjsSink
from relayd.testing.emulator import EmulatorConfig, FaultRule, RunningEmulator, start_emulator
from relayd.token_file import TokenFile
from tests.support import SinkHealthRecord, claimed

OLD = "old-token-7Qk2"  # test tokens, not credentials
NEW = "new-token-Zr81"


class _Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rotate(path: Path, text: str) -> None:
    """As operators and Kubernetes do: a new file renamed over the old one."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _leaks(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if OLD in repr(entry) or NEW in repr(entry)]


# --- TokenFile ---------------------------------------------------------------------------


def test_the_file_is_looked_at_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD + "\n")
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    assert token.value == OLD
    rotate(path, NEW + "\n")
    clock.now += 0.999
    assert token.value == OLD  # not looked at yet
    clock.now += 0.001
    with structlog.testing.capture_logs() as logs:
        assert token.value == NEW
    assert [entry["event"] for entry in logs] == ["sink.token_reloaded"]
    assert not _leaks(logs)


def test_refresh_looks_at_once(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    assert token.value == OLD
    rotate(path, NEW)
    assert token.refresh() is True
    assert token.value == NEW
    assert token.refresh() is False  # nothing changed since


def test_the_first_look_reads_the_file_whatever_it_held_at_load(tmp_path: Path) -> None:
    """The file may have been rotated between the configuration's load and the first use."""
    path = tmp_path / "token"
    path.write_text(NEW)
    assert TokenFile(path, OLD, clock=_Clock()).value == NEW


def test_a_rewrite_with_the_same_token_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    token = TokenFile(path, OLD, clock=_Clock())
    assert token.value == OLD
    rotate(path, f"  {OLD}\n")
    with structlog.testing.capture_logs() as logs:
        assert token.refresh() is False
    assert logs == []
    assert token.value == OLD


def test_an_unusable_file_keeps_the_token_and_warns_once(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    with structlog.testing.capture_logs() as logs:
        assert token.value == OLD
        rotate(path, "\n")  # empty
        assert token.refresh() is False
        clock.now += 5
        assert token.value == OLD
        path.unlink()  # gone
        assert token.refresh() is False
        path.write_bytes(b"\xff\xfe")  # not UTF-8
        assert token.refresh() is False
        assert token.value == OLD
        rotate(path, NEW)
        assert token.refresh() is True
        assert token.value == NEW
        rotate(path, "")  # unusable again: a new episode, a new warning
        assert token.refresh() is False
    events = [(entry["event"], entry["log_level"]) for entry in logs]
    assert events == [
        ("sink.token_unreadable", "warning"),
        ("sink.token_readable", "info"),
        ("sink.token_reloaded", "info"),
        ("sink.token_unreadable", "warning"),
    ]
    assert "is empty" in logs[0]["error"]
    assert str(path) == logs[0]["path"]
    assert token.value == NEW
    assert not _leaks(logs)


def test_an_unchanged_signature_is_not_read_again(tmp_path: Path) -> None:
    """A look is a stat: the file is read again only when its (mtime, size, inode) moved."""
    path = tmp_path / "token"
    path.write_text(OLD)
    token = TokenFile(path, OLD, clock=_Clock())
    assert token.value == OLD
    stat = path.stat()
    path.write_text(NEW)  # in place, the same size; then the old mtime put back
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert token.refresh() is False
    assert token.value == OLD


# --- the sink against the emulator -------------------------------------------------------


def _settings(emulator: RunningEmulator, path: Path) -> SinkSettings:
    """Read as the configuration is loaded: the token file's content at this moment."""
    return SinkSettings(url=emulator.url, token_file=path, batch="off")


@asynccontextmanager
async def _sink(
    emulator: RunningEmulator,
    path: Path,
    clock: _Clock,
    health: SinkHealthRecord,
    settings: SinkSettings | None = None,
) -> AsyncIterator[OjsSink]:
    sink = OjsSink(settings or _settings(emulator, path), emulator.url, health, clock=clock)
    await sink.start()
    try:
        yield sink
    finally:
        await sink.close()


async def _publish(sink: OjsSink) -> tuple[str, Outcome]:
    row = claimed()
    envelopes = {row.event_id: Envelope.parse(row.job, row.event_id)}
    send_by = asyncio.get_running_loop().time() + 60
    outcomes = await sink.publish([row], envelopes, send_by=send_by)
    return row.event_id, outcomes[row.event_id]


async def test_a_refusal_makes_the_sink_read_the_rotated_token(tmp_path: Path) -> None:
    """The server took the new token first (403 for the old one); the operator rotates the
    file; the next refusal has the sink look at once (no second needs to pass), and the
    request after it is accepted. Nothing carries a token."""
    path = tmp_path / "token"
    path.write_text(OLD)
    clock, health = _Clock(), SinkHealthRecord()
    with structlog.testing.capture_logs() as logs:
        async with (
            await start_emulator(EmulatorConfig(auth_token=NEW)) as emulator,
            _sink(emulator, path, clock, health) as sink,
        ):
            _, refused = await _publish(sink)
            assert isinstance(refused, SinkDown)
            assert refused.severe
            assert "403" in refused.error
            assert "sink.token_file" in refused.error
            rotate(path, NEW)
            # The clock stands still: the token is not looked at before the next refusal.
            _, again = await _publish(sink)
            assert isinstance(again, SinkDown)
            assert "403" in again.error
            event_id, accepted = await _publish(sink)
            assert isinstance(accepted, Published)
            assert set(emulator.emulator.ledger()) == {event_id}
            assert (health.failed, health.ok) == (2, 1)
            assert all(health.severities), "a refused token is a severe failure"
    assert [entry["event"] for entry in logs] == ["sink.token_reloaded"]
    assert not _leaks(logs)
    assert OLD not in refused.error + again.error


async def test_a_rotation_is_picked_up_within_a_second_without_a_refusal(
    tmp_path: Path,
) -> None:
    """Rotated between the load and the first request: the first request sends the new one.
    Rotated back while requests succeed: the token in use stays until a second has passed."""
    path = tmp_path / "token"
    path.write_text(OLD)
    clock, health = _Clock(), SinkHealthRecord()
    async with await start_emulator(EmulatorConfig(auth_token=NEW)) as emulator:
        loaded = _settings(emulator, path)
        rotate(path, NEW)  # after the configuration was loaded
        async with _sink(emulator, path, clock, health, loaded) as sink:
            assert isinstance((await _publish(sink))[1], Published)
            rotate(path, OLD)  # the old token again: the server refuses it
            clock.now += 0.5
            assert isinstance((await _publish(sink))[1], Published)
            clock.now += 0.5
            refused = (await _publish(sink))[1]
            assert isinstance(refused, SinkDown)
            assert "403" in refused.error
    assert health.ok == 2


async def test_an_unusable_token_file_keeps_the_token_in_use(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    clock, health = _Clock(), SinkHealthRecord()
    with structlog.testing.capture_logs() as logs:
        async with (
            await start_emulator(EmulatorConfig(auth_token=OLD)) as emulator,
            _sink(emulator, path, clock, health) as sink,
        ):
            assert isinstance((await _publish(sink))[1], Published)
            rotate(path, "")
            for _ in range(3):
                clock.now += 1
                assert isinstance((await _publish(sink))[1], Published)
    assert [entry["event"] for entry in logs] == ["sink.token_unreadable"]
    assert not _leaks(logs)


async def test_an_echoed_token_is_redacted_the_rotated_out_one_too(tmp_path: Path) -> None:
    """A server or proxy that echoes credentials in its refusal: neither the token in use
    nor the one it replaced reaches the error text (which becomes last_error and logs)."""
    path = tmp_path / "token"
    path.write_text(OLD)
    echo = json.dumps(
        {"error": {"code": "unauthorized", "message": f"not {OLD!r}, not {json.dumps(NEW)}"}}
    )
    clock, health = _Clock(), SinkHealthRecord()
    async with await start_emulator(EmulatorConfig(auth_token=NEW)) as emulator:
        loaded = _settings(emulator, path)
        rotate(path, NEW)
        async with _sink(emulator, path, clock, health, loaded) as sink:
            emulator.emulator.add_fault(FaultRule(action="status", status=401, body=echo))
            _, refused = await _publish(sink)
    assert isinstance(refused, SinkDown)
    assert "401" in refused.error
    assert OLD not in refused.error
    assert NEW not in refused.error
    assert "***" in refused.error
