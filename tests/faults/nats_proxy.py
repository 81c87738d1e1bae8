"""A TCP proxy between relayd and nats-server that reads the NATS protocol, so that a test
can lose exactly the answers that make a publish ambiguous.

The protocol is text lines ending CRLF; four operations carry a payload whose size ends
their line: the client's `PUB subject [reply] size` and `HPUB subject [reply] hsize size`,
the server's `MSG subject sid [reply] size` and `HMSG subject sid [reply] hsize size`, each
followed by `size` bytes and CRLF. A JetStream publish is a (H)PUB with a reply inbox; its
PubAck comes back as a (H)MSG on that inbox whose JSON has `stream` and `seq` (a stored
message, or a duplicate). The proxy forwards frame by frame and, on command:

- `drop_acks(n)`: swallows the next `n` PubAcks (the message is stored, the publisher never
  learns it: an ambiguous outcome per publish, the connection intact);
- `cut_after(n)`: forwards `n` more publishes and, when the server's PubAck to the n-th
  comes back, drops it and resets (RST) every connection at once, whatever else is in
  flight: that message is stored and its publisher never learns it (at least one ambiguous
  publish, whatever the timing). New connections are accepted as before (the client
  reconnects).
- `hold_publish(marker)`: holds back the next publish whose frame holds `marker` (an event
  id's bytes) while everything else flows; `release_held()` forwards it on its connection,
  at a frame boundary, and returns once the server answered it: a copy of a message that
  arrives late, after its publisher gave up on it and perhaps sent it again.

`publishes` counts the publishes forwarded (to tell whether a relay sent anything at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_LIMIT = 8 * 1024 * 1024  # a line (INFO) or a payload, above any max_payload a test sets
_PAYLOAD_OPS = (b"PUB", b"HPUB", b"MSG", b"HMSG")


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next frame: its line and its payload (with the CRLF that ends it), or b"" if it
    has none."""
    line = await reader.readuntil(b"\r\n")
    words = line.split()
    if words and words[0].upper() in _PAYLOAD_OPS:
        return line, await reader.readexactly(int(words[-1]) + 2)
    return line, b""


def _is_publish(line: bytes) -> bool:
    """A client's publish to a stream's subject: not to the JetStream API or an inbox."""
    words = line.split()
    return (
        len(words) >= 3
        and words[0].upper() in (b"PUB", b"HPUB")
        and not words[1].startswith((b"$JS.", b"_INBOX."))
    )


def _reply_subject(line: bytes) -> bytes | None:
    """A publish's reply inbox: PUB subject reply size, HPUB subject reply hsize size."""
    words = line.split()
    with_reply = 4 if words[0].upper() == b"PUB" else 5
    return words[2] if len(words) == with_reply else None


def _is_puback(line: bytes, payload: bytes) -> bool:
    words = line.split()
    if not words or words[0].upper() not in (b"MSG", b"HMSG"):
        return False
    body = payload[:-2]
    if words[0].upper() == b"HMSG":
        body = body[int(words[-2]) :]
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    return isinstance(answer, dict) and "stream" in answer and "seq" in answer


@dataclass
class NatsProxyStats:
    accepted: int = 0
    publishes: int = 0  # publishes forwarded to the server
    dropped_acks: int = 0
    cuts: int = 0


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None

    def reset(self) -> None:
        _rst(self.client)
        if self.upstream is not None:
            _rst(self.upstream)


@dataclass
class NatsProxy:
    """Start with `start()`; relayd connects to `url`; see the module docstring."""

    host: str
    port: int
    stats: NatsProxyStats = field(default_factory=NatsProxyStats)
    listen_port: int = 0
    _acks_to_drop: int = 0
    _publishes_before_cut: int | None = None
    _cut_on_reply: bytes | None = None  # the inbox whose PubAck triggers the cut
    _server: asyncio.Server | None = None
    _links: set[_Link] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _done: asyncio.Event = field(default_factory=asyncio.Event)
    _hold_marker: bytes | None = None
    _held: tuple[_Link, bytes] | None = None
    _held_reply: bytes | None = None
    _held_now: asyncio.Event = field(default_factory=asyncio.Event)
    _held_answered: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def for_url(cls, url: str) -> NatsProxy:
        parts = urlsplit(url)
        return cls(host=parts.hostname or "127.0.0.1", port=parts.port or 4222)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.listen_port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.listen_port, limit=_LIMIT
        )
        self.listen_port = self._server.sockets[0].getsockname()[1]

    def drop_acks(self, count: int) -> None:
        """Swallow the next `count` PubAcks; `done()` returns once they are swallowed."""
        self._done.clear()
        self._acks_to_drop = count

    def cut_after(self, publishes: int) -> None:
        """Reset every connection once `publishes` more publishes are forwarded; `done()`
        returns once it has."""
        self._done.clear()
        self._publishes_before_cut = publishes

    def hold_publish(self, marker: bytes) -> None:
        """Hold back the next publish holding `marker` until `release_held()`."""
        self._hold_marker = marker
        self._held_now.clear()
        self._held_answered.clear()

    async def held(self, timeout_s: float = 30.0) -> None:
        """Wait until the publish is held."""
        async with asyncio.timeout(timeout_s):
            await self._held_now.wait()

    async def release_held(self, timeout_s: float = 30.0) -> None:
        """Forward the held publish; return once the server's answer to it passed by."""
        assert self._held is not None, "nothing is held"
        link, frame = self._held
        self._held = None
        assert link.upstream is not None
        link.upstream.write(frame)
        await link.upstream.drain()
        async with asyncio.timeout(timeout_s):
            await self._held_answered.wait()

    async def done(self, timeout_s: float = 30.0) -> None:
        """Wait until the fault armed last has happened."""
        async with asyncio.timeout(timeout_s):
            await self._done.wait()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for link in list(self._links):
            link.reset()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        link = _Link(writer)
        try:
            up_reader, link.upstream = await asyncio.open_connection(
                self.host, self.port, limit=_LIMIT
            )
        except OSError:
            _rst(writer)
            return
        self._links.add(link)
        for task in (
            asyncio.create_task(self._client_to_server(link, reader)),
            asyncio.create_task(self._server_to_client(link, up_reader)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _client_to_server(self, link: _Link, reader: asyncio.StreamReader) -> None:
        assert link.upstream is not None
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            while True:
                line, payload = await _frame(reader)
                if self._holds(line, payload):
                    self._held = (link, line + payload)
                    self._held_reply = _reply_subject(line)
                    self._held_now.set()
                    continue
                link.upstream.write(line + payload)
                await link.upstream.drain()
                if _is_publish(line):
                    self.stats.publishes += 1
                    if self._publishes_before_cut is not None:
                        self._publishes_before_cut -= 1
                        if self._publishes_before_cut <= 0:
                            self._publishes_before_cut = None
                            self._cut_on_reply = _reply_subject(line)
        self._end(link)

    async def _server_to_client(self, link: _Link, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            while True:
                line, payload = await _frame(reader)
                if self._held_reply is not None and line.split()[1:2] == [self._held_reply]:
                    self._held_reply = None
                    self._held_answered.set()
                if self._cut_on_reply is not None and line.split()[1:2] == [self._cut_on_reply]:
                    self.stats.dropped_acks += 1
                    self._cut()
                    return
                if self._acks_to_drop > 0 and _is_puback(line, payload):
                    self._acks_to_drop -= 1
                    self.stats.dropped_acks += 1
                    if self._acks_to_drop == 0:
                        self._done.set()
                    continue
                link.client.write(line + payload)
                await link.client.drain()
        self._end(link)

    def _holds(self, line: bytes, payload: bytes) -> bool:
        if self._hold_marker is None or not _is_publish(line) or self._hold_marker not in payload:
            return False
        self._hold_marker = None
        return True

    def _cut(self) -> None:
        self._cut_on_reply = None
        self.stats.cuts += 1
        for link in list(self._links):
            self._end(link)
        self._done.set()

    def _end(self, link: _Link) -> None:
        if link in self._links:
            self._links.discard(link)
            link.reset()
