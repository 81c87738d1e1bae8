"""What the network scenarios need beyond the harness: a TCP proxy that misbehaves on
command, and private network namespaces with nftables rules (processes started inside one
through `Scene.spawn`, kept by the Scene like its own).

`FaultProxy` sits in front of the sink or PostgreSQL (TCP or a Unix socket) and switches, for
the connections it holds and the ones it accepts later, between:

- `forward`: forward as is (the healthy path);
- `latency`: every chunk, each way, is delivered `latency_s` after it arrived (order kept);
- `blackhole`: accept, forward nothing, swallow what is sent (a route that drops packets:
  nothing is refused, nothing answers). Healing resets (RST) every connection that lost
  bytes, as its TCP would once its retransmissions gave up; the others go on;
- `reset`: every connection is reset (RST), new ones at once;
- `half_open`: the peer keeps the socket but stops reading and answering (a frozen host or
  process); healing resumes every connection where it stopped, nothing lost;
- `slicing`: forward in chunks of `slice_bytes`, one write (and one segment) each.

Run as `python -m tests.faults.netfaults bridge UNIX_PATH HOST:PORT SOURCE_IP`, it is the
bridge that lets the test process reach a server inside a network namespace: it listens on
a Unix socket (a file, visible from every namespace) and connects, from inside the
namespace, to HOST:PORT from SOURCE_IP (so that a firewall rule can tell it from the relay).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import socket
import struct
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

_REPO = Path(__file__).resolve().parents[2]
_READY_TIMEOUT_S = 30.0
_CHUNK = 65536


class Mode(enum.StrEnum):
    FORWARD = "forward"
    LATENCY = "latency"
    BLACKHOLE = "blackhole"
    RESET = "reset"
    HALF_OPEN = "half_open"
    SLICING = "slicing"


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Link:
    """One proxied connection: the client's end and, once connected, the server's."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    swallowed: bool = False  # bytes were lost: the stream cannot go on

    def reset(self) -> None:
        _rst(self.client)
        _rst(self.upstream)


@dataclass
class ProxyStats:
    accepted: int = 0
    resets: int = 0
    swallowed_bytes: int = 0
    delayed_chunks: int = 0
    sliced_writes: int = 0
    forwarded_bytes: int = 0


class FaultProxy:
    """A TCP proxy on 127.0.0.1 (or a Unix socket) whose `mode` a test switches; see the
    module docstring for the modes."""

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int | None = None,
        unix_path: str | None = None,
        listen_unix: Path | None = None,
    ) -> None:
        self._host, self._port, self._unix_path = host, port, unix_path
        self.latency_s = 0.3
        self.slice_bytes = 3
        self.listen_unix = listen_unix
        self.mode = Mode.FORWARD
        self.stats = ProxyStats()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()

    @classmethod
    def for_url(cls, url: str, *, listen_unix: Path | None = None) -> FaultProxy:
        """In front of the HTTP server at `url`."""
        parts = urlsplit(url)
        return cls(
            host=parts.hostname or "127.0.0.1", port=parts.port or 80, listen_unix=listen_unix
        )

    @classmethod
    def for_dsn(cls, dsn: str, *, listen_unix: Path | None = None) -> FaultProxy:
        """In front of the server of `dsn`: its Unix socket (`?host=/dir`) or its TCP port."""
        parts = urlsplit(dsn)
        socket_dir = parse_qs(parts.query).get("host", [""])[0]
        port = parts.port or 5432
        if socket_dir.startswith("/"):
            path = str(Path(socket_dir) / f".s.PGSQL.{port}")
            return cls(unix_path=path, listen_unix=listen_unix)
        return cls(host=parts.hostname or "127.0.0.1", port=port, listen_unix=listen_unix)

    def url_through(self, url: str) -> str:
        parts = urlsplit(url)
        return urlunsplit((parts.scheme, f"127.0.0.1:{self.port}", parts.path, "", ""))

    def dsn_through(self, dsn: str) -> str:
        """`dsn` rewritten to connect through this proxy (TCP, or its Unix socket)."""
        parts = urlsplit(dsn)
        user = parts.username or "postgres"
        auth = f"{user}:{parts.password}@" if parts.password else f"{user}@"
        if self.listen_unix is not None:
            directory, port = self.listen_unix.parent, self.listen_unix.name.rsplit(".", 1)[1]
            return urlunsplit((parts.scheme, auth, parts.path, f"host={directory}&port={port}", ""))
        return urlunsplit((parts.scheme, f"{auth}127.0.0.1:{self.port}", parts.path, "", ""))

    async def start(self) -> None:
        if self.listen_unix is not None:
            self._server = await asyncio.start_unix_server(self._accept, str(self.listen_unix))
            return
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def set_mode(self, mode: Mode) -> None:
        """Switch every connection, held and future, to `mode`."""
        leaving = self.mode
        self.mode = mode
        if mode is Mode.RESET or (leaving is Mode.BLACKHOLE and mode is not Mode.BLACKHOLE):
            for link in list(self._links):
                if mode is Mode.RESET or link.swallowed:
                    self.stats.resets += 1
                    link.reset()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        await asyncio.sleep(0)

    async def heal(self) -> None:
        await self.set_mode(Mode.FORWARD)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.reset()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _until_not(self, mode: Mode) -> None:
        while self.mode is mode:
            await self._changed.wait()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        link = _Link(client=writer)
        self._links.add(link)
        self.stats.accepted += 1
        try:
            await self._serve(link, reader)
        except (OSError, ConnectionError):
            link.reset()
        finally:
            self._links.discard(link)
            self._tasks.discard(task)
            for end in (link.client, link.upstream):
                if end is not None:
                    end.transport.abort()

    async def _serve(self, link: _Link, reader: asyncio.StreamReader) -> None:
        await self._until_not(Mode.HALF_OPEN)  # a frozen peer: accepted, never served
        if self.mode is Mode.RESET:
            self.stats.resets += 1
            link.reset()
            return
        if self.mode is Mode.BLACKHOLE:
            link.swallowed = True
            while data := await reader.read(_CHUNK):
                self.stats.swallowed_bytes += len(data)
            return
        if self._unix_path is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self._unix_path)
        else:
            assert self._host is not None
            assert self._port is not None
            up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        link.upstream = up_writer
        for end in (link.client, up_writer):
            sock = end.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(
            self._pipe(reader, up_writer, link),
            self._pipe(up_reader, link.client, link),
            return_exceptions=True,
        )

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, link: _Link
    ) -> None:
        """Read `source`, deliver to `sink` as the mode says, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes, bool] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data, sliced = item
                await asyncio.sleep(max(due - loop.time(), 0.0))
                await self._until_not(Mode.HALF_OPEN)
                if self.mode is Mode.BLACKHOLE:
                    link.swallowed = True
                    self.stats.swallowed_bytes += len(data)
                    continue
                step = self.slice_bytes if sliced else len(data)
                for start in range(0, len(data), step):
                    sink.write(data[start : start + step])
                    await sink.drain()
                    if sliced:
                        self.stats.sliced_writes += 1
                        await asyncio.sleep(0)
                self.stats.forwarded_bytes += len(data)

        delivering = asyncio.create_task(deliver())
        last_due = 0.0
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while True:
                    await self._until_not(Mode.HALF_OPEN)  # stops reading: buffers fill up
                    data = await source.read(_CHUNK)
                    if not data:
                        break
                    mode = self.mode
                    if mode is Mode.BLACKHOLE:
                        link.swallowed = True
                        self.stats.swallowed_bytes += len(data)
                        continue
                    due = loop.time()
                    if mode is Mode.LATENCY:
                        due += self.latency_s
                        self.stats.delayed_chunks += 1
                    last_due = max(due, last_due)
                    queue.put_nowait((last_due, data, mode is Mode.SLICING))
                queue.put_nowait(None)
                await delivering
        finally:
            delivering.cancel()
            await asyncio.gather(delivering, return_exceptions=True)
            sink.transport.abort()


# --- network namespaces --------------------------------------------------------------------


@dataclass
class NetNs:
    """A private network namespace with only its loopback, up."""

    name: str = field(default_factory=lambda: f"relayd-t-{uuid.uuid4().hex[:8]}")

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside."""
        return ["ip", "netns", "exec", self.name]

    async def run(self, *argv: str, stdin: str | None = None) -> None:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate(None if stdin is None else stdin.encode())
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({process.returncode}): {out.decode()}")

    async def nft(self, script: str) -> None:
        """Load an nftables script inside the namespace."""
        await self.run(*self.prefix(), "nft", "-f", "-", stdin=script)


@contextlib.asynccontextmanager
async def netns() -> AsyncIterator[NetNs]:
    """A fresh namespace (RuntimeError if it cannot be made), deleted on exit."""
    space = NetNs()
    await space.run("ip", "netns", "add", space.name)
    try:
        await space.run(*space.prefix(), "ip", "link", "set", "lo", "up")
        yield space
    finally:
        with contextlib.suppress(RuntimeError):
            await space.run("ip", "netns", "del", space.name)


def bridge_argv(unix_path: Path, target: str, source_ip: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.faults.netfaults",
        "bridge",
        str(unix_path),
        target,
        source_ip,
    ]


def bridge_env() -> dict[str, str]:
    return {"PYTHONPATH": str(_REPO)}


async def _bridge(unix_path: str, target: str, source_ip: str) -> None:
    host, _, port = target.rpartition(":")

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(
                host, int(port), local_addr=(source_ip, 0)
            )
        except OSError:
            writer.transport.abort()
            return
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    server = await asyncio.start_unix_server(accept, unix_path)
    print(f"bridge ready on {unix_path}", flush=True)  # noqa: T201 - the parent waits for it
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.netfaults")
    commands = parser.add_subparsers(dest="command", required=True)
    bridge = commands.add_parser("bridge", help="a Unix socket to HOST:PORT, from SOURCE_IP")
    bridge.add_argument("unix_path")
    bridge.add_argument("target", metavar="HOST:PORT")
    bridge.add_argument("source_ip")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_bridge(args.unix_path, args.target, args.source_ip))
    return 0


if __name__ == "__main__":
    sys.exit(main())
