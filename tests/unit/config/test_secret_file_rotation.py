"""The sink's bearer token follows sink.token_file when an operator rotates it: looked at no
more than once a second (off the event loop) and at once after a 401/403; an unusable file
(unreadable, empty, not a regular file, too large, or not a token that can be sent) keeps the
token in use with one warning; no token, old or new, reaches a log or an error text; a
request that cannot be built is a sink-wide outcome, never an exception."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import SecretStr

from relayd.config import secret_files
from relayd.config.secret_files import SECRET_MAX_BYTES, TokenFile
from relayd.core.envelope import Envelope
from relayd.core.outcomes import Outcome, Published, SinkDown
from relayd.sinks import SendWindow
from relayd.sinks.ojs.settings import OjsSettings
from relayd.sinks.ojs.sink import OjsSink
from relayd.testing.emulator import EmulatorConfig, FaultRule, RunningEmulator, start_emulator
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


async def test_the_file_is_looked_at_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD + "\n")
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    assert await token.current() == OLD
    rotate(path, NEW + "\n")
    clock.now += 0.999
    assert await token.current() == OLD  # not looked at yet
    clock.now += 0.001
    with structlog.testing.capture_logs() as logs:
        assert await token.current() == NEW
    assert [entry["event"] for entry in logs] == ["sink.token_reloaded"]
    assert not _leaks(logs)


async def test_fresh_answers_without_waiting_only_while_no_look_is_due(tmp_path: Path) -> None:
    """`fresh()` gives what `current()` would give without waiting, and nothing once a look
    is due: a caller that takes it never sends a token older than the interval."""
    path = tmp_path / "token"
    path.write_text(OLD + "\n")
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    assert token.fresh() is None  # never looked at: the file may have changed since load
    assert await token.current() == OLD
    assert token.fresh() == OLD
    rotate(path, NEW + "\n")
    clock.now += 1.0
    assert token.fresh() is None
    assert await token.current() == NEW
    assert token.fresh() == NEW


async def test_requests_beside_a_due_look_wait_for_it(tmp_path: Path) -> None:
    """After an idle spell, the requests that start together all wait for the one look the
    first of them began: none goes on with the old token (the rotation bound)."""
    path = tmp_path / "token"
    path.write_text(OLD + "\n")
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    assert await token.current() == OLD
    rotate(path, NEW + "\n")
    clock.now += 60.0  # idle
    assert await asyncio.gather(*(token.current() for _ in range(40))) == [NEW] * 40


async def test_a_look_that_hangs_holds_requests_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look stuck in the file system holds the requests waiting for it at most
    LOOK_WAIT_S; they go on with the token in use, and nothing waits on the loop."""
    path = tmp_path / "token"
    path.write_text(OLD + "\n")
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    stuck = threading.Event()

    def hanging(*_args: object) -> object:
        stuck.wait(10)  # released below, so that no thread outlives the test for long
        return secret_files._Look(error="stuck")

    monkeypatch.setattr(secret_files, "_look_at", hanging)
    monkeypatch.setattr(secret_files, "LOOK_WAIT_S", 0.2)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await asyncio.gather(*(token.current() for _ in range(5))) == [OLD] * 5
        assert loop.time() - started < 2.0
    finally:
        stuck.set()


class _SpinGuard(_Clock):
    """A clock that fails the test once it is read far more often than any request would:
    a request spinning on the loop without yielding reads it without end."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads > 1000:
            raise AssertionError("a request spins on the loop without yielding")
        return self.now


async def test_a_request_meeting_a_look_that_just_ended_lets_it_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that starts between a look's end and the moment its result is applied (its
    callback is queued behind the request) yields to it instead of waiting, without ever
    yielding, on a look that is already done; it then sends the file's new token. So do
    the requests that waited for the look."""
    path = tmp_path / "token"
    path.write_text(NEW)
    clock = _SpinGuard()
    token = TokenFile(path, OLD, clock=clock)
    loop = asyncio.get_running_loop()
    looks: list[asyncio.Future[secret_files._Look]] = []

    def held(function: Any) -> asyncio.Future[secret_files._Look]:
        looks.append(loop.create_future())  # ended below, as a look's thread ends it
        return looks[-1]

    monkeypatch.setattr(secret_files, "_off_loop", held)
    waiting = asyncio.ensure_future(token.current())  # starts the look and waits for it
    await asyncio.sleep(0)
    assert len(looks) == 1
    # The look ends while a request is already queued to run before its callback applies it.
    late = asyncio.ensure_future(token.current())
    looks[0].set_result(secret_files._Look(token=NEW, signature=(1, 2, 3)))
    async with asyncio.timeout(5):
        assert list(await asyncio.gather(waiting, late)) == [NEW, NEW]


async def test_refresh_looks_at_once(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    assert await token.current() == OLD
    rotate(path, NEW)
    assert await token.refresh() is True
    assert await token.current() == NEW
    assert await token.refresh() is False  # nothing changed since


async def test_the_first_look_reads_the_file_whatever_it_held_at_load(tmp_path: Path) -> None:
    """The file may have been rotated between the configuration's load and the first use."""
    path = tmp_path / "token"
    path.write_text(NEW)
    assert await TokenFile(path, OLD, clock=_Clock()).current() == NEW


async def test_a_rewrite_with_the_same_token_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    token = TokenFile(path, OLD, clock=_Clock())
    assert await token.current() == OLD
    rotate(path, f"  {OLD}\n")
    with structlog.testing.capture_logs() as logs:
        assert await token.refresh() is False
    assert logs == []
    assert await token.current() == OLD


async def test_an_unusable_file_keeps_the_token_and_warns_once(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    clock = _Clock()
    token = TokenFile(path, OLD, clock=clock)
    with structlog.testing.capture_logs() as logs:
        assert await token.current() == OLD
        rotate(path, "\n")  # empty
        assert await token.refresh() is False
        clock.now += 5
        assert await token.current() == OLD
        path.unlink()  # gone
        assert await token.refresh() is False
        path.write_bytes(b"\xff\xfe")  # not UTF-8
        assert await token.refresh() is False
        assert await token.current() == OLD
        rotate(path, NEW)
        assert await token.refresh() is True
        assert await token.current() == NEW
        rotate(path, "")  # unusable again: a new episode, a new warning
        assert await token.refresh() is False
    events = [(entry["event"], entry["log_level"]) for entry in logs]
    assert events == [
        ("sink.token_unreadable", "warning"),
        ("sink.token_readable", "info"),
        ("sink.token_reloaded", "info"),
        ("sink.token_unreadable", "warning"),
    ]
    assert "is empty" in logs[0]["error"]
    assert str(path) == logs[0]["path"]
    assert await token.current() == NEW
    assert not _leaks(logs)


async def test_an_unchanged_signature_is_not_read_again(tmp_path: Path) -> None:
    """A look is a stat: the file is read again only when its (mtime, size, inode) moved."""
    path = tmp_path / "token"
    path.write_text(OLD)
    token = TokenFile(path, OLD, clock=_Clock())
    assert await token.current() == OLD
    stat = path.stat()
    path.write_text(NEW)  # in place, the same size; then the old mtime put back
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert await token.refresh() is False
    assert await token.current() == OLD


@pytest.mark.parametrize(
    "rotated",
    [f"{NEW}\n# rotated by ops\n", f"{NEW}\rX", f"{NEW}\x00X", f"{NEW} X", f"{NEW}\u00e9"],
)
async def test_a_rotated_token_that_cannot_be_sent_keeps_the_previous_one(
    tmp_path: Path, rotated: str
) -> None:
    """A token plus a comment line, a CR, a NUL, inner whitespace or a non-ASCII
    character is not taken: the previous token stays, with one warning that shows neither."""
    path = tmp_path / "token"
    path.write_text(OLD)
    token = TokenFile(path, OLD, clock=_Clock())
    with structlog.testing.capture_logs() as logs:
        rotate(path, rotated)
        assert await token.refresh() is False
        assert await token.current() == OLD
        assert await token.refresh() is False  # still refused: no second warning
    assert [entry["event"] for entry in logs] == ["sink.token_unreadable"]
    assert "does not hold a bearer token" in logs[0]["error"]
    assert not _leaks(logs)


def _swap_in_fifo(path: Path) -> None:
    fifo = path.with_name("fifo")
    os.mkfifo(fifo)
    os.replace(fifo, path)


def _swap_in_a_large_file(path: Path) -> None:
    rotate(path, "a" * (SECRET_MAX_BYTES + 1))


@pytest.mark.timeout(10)  # the code before the fix blocks on the FIFO: fail, do not hang
@pytest.mark.parametrize(
    ("swap", "error"),
    [
        (_swap_in_fifo, "is a FIFO, not a regular file"),
        (_swap_in_a_large_file, f"is larger than {SECRET_MAX_BYTES} bytes"),
    ],
)
async def test_a_token_file_swapped_for_a_fifo_or_a_huge_file_is_not_read(
    tmp_path: Path, swap: object, error: str
) -> None:
    """A FIFO swapped in for the token file is refused without being read (it would
    block the reader), and so is a file over the bound: the token in use stays, one warning.
    /dev/zero is met by processes with a bounded address space (test_secret_files.py, the
    fault suite), never by this one."""
    assert callable(swap)
    path = tmp_path / "token"
    path.write_text(OLD)
    token = TokenFile(path, OLD, clock=_Clock())
    with structlog.testing.capture_logs() as logs:
        swap(path)
        assert await token.refresh() is False
        assert await token.current() == OLD
    assert [entry["event"] for entry in logs] == ["sink.token_unreadable"]
    assert error in logs[0]["error"]
    rotate(path, NEW)
    assert await token.refresh() is True


# --- the sink against the emulator -------------------------------------------------------


def _settings(emulator: RunningEmulator, path: Path) -> OjsSettings:
    """Read as the configuration is loaded: the token file's content at this moment."""
    return OjsSettings(url=emulator.url, token_file=path, batch="off")


@asynccontextmanager
async def _sink(
    emulator: RunningEmulator,
    path: Path,
    clock: _Clock,
    health: SinkHealthRecord,
    settings: OjsSettings | None = None,
) -> AsyncIterator[OjsSink]:
    sink = OjsSink(settings or _settings(emulator, path), health, clock=clock)
    await sink.start()
    try:
        yield sink
    finally:
        await sink.close()


async def _publish(sink: OjsSink) -> tuple[str, Outcome]:
    row = claimed()
    envelopes = {row.event_id: Envelope.parse(row.job, row.event_id)}
    window = SendWindow(asyncio.get_running_loop().time() + 60)
    outcomes = await sink.publish([row], envelopes, window=window)
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


@pytest.mark.parametrize(
    "rotated", ["", f"{NEW}\n# rotated on Tuesday\n"], ids=["empty", "comment"]
)
async def test_an_unusable_token_file_keeps_the_token_in_use(tmp_path: Path, rotated: str) -> None:
    """An empty file, or a token plus a comment line, which used to raise out of
    the sink at the next request: the previous token is still sent, and accepted."""
    path = tmp_path / "token"
    path.write_text(OLD)
    clock, health = _Clock(), SinkHealthRecord()
    with structlog.testing.capture_logs() as logs:
        async with (
            await start_emulator(EmulatorConfig(auth_token=OLD)) as emulator,
            _sink(emulator, path, clock, health) as sink,
        ):
            assert isinstance((await _publish(sink))[1], Published)
            rotate(path, rotated)
            for _ in range(3):
                clock.now += 1
                assert isinstance((await _publish(sink))[1], Published)
    assert [entry["event"] for entry in logs] == ["sink.token_unreadable"]
    assert not _leaks(logs)
    assert health.failed == 0


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


async def test_a_request_that_cannot_be_built_is_a_sink_wide_outcome(tmp_path: Path) -> None:
    """The class: whatever makes aiohttp refuse to build a request (here a header
    value with a line break, slipped past the load-time check) is a severe sink-wide outcome
    that never reached the server, with no token in its text: never an exception."""
    clock, health = _Clock(), SinkHealthRecord()
    async with await start_emulator(EmulatorConfig()) as emulator:
        settings = OjsSettings(url=emulator.url, batch="off")
        settings._token = SecretStr(f"{OLD}\n{NEW}")
        async with _sink(emulator, tmp_path / "unused", clock, health, settings) as sink:
            _, first = await _publish(sink)
            _, second = await _publish(sink)
        assert emulator.emulator.ledger() == {}
    for outcome in (first, second):
        assert isinstance(outcome, SinkDown)
        assert (outcome.reached, outcome.severe) == (False, True)
        assert "could not be built" in outcome.error
        assert OLD not in outcome.error
        assert NEW not in outcome.error
    assert health.failed == 2
    assert all(health.severities)
