"""A TCP proxy a test can cut and restore: PostgreSQL "goes away" without stopping it.

It listens on 127.0.0.1 and forwards to a TCP address or a Unix socket (the embedded
server listens on a socket only). `cut()` closes every connection and stops listening, so
new connections are refused; `restore()` listens again on the same port. `reply_delay_s`
holds back what the server sends (in order, each chunk by the delay in force when it
arrived): a slow link, or a server whose answers arrive after the client gave up on them.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit


class TcpProxy:
    def __init__(
        self, *, host: str | None = None, port: int | None = None, unix_path: str | None = None
    ) -> None:
        self._target_host, self._target_port, self._unix_path = host, port, unix_path
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self.port = 0
        self.reply_delay_s = 0.0

    @classmethod
    def for_dsn(cls, dsn: str) -> TcpProxy:
        """A proxy in front of the server of `dsn` (start it, then use `dsn_through`)."""
        parts = urlsplit(dsn)
        socket_dir = parse_qs(parts.query).get("host", [""])[0]
        if socket_dir.startswith("/"):
            port = parts.port or 5432
            proxy = cls(unix_path=str(Path(socket_dir) / f".s.PGSQL.{port}"))
        else:
            proxy = cls(host=parts.hostname or "127.0.0.1", port=parts.port or 5432)
        return proxy

    def dsn_through(self, dsn: str) -> str:
        """`dsn` rewritten to connect through this proxy."""
        parts = urlsplit(dsn)
        user = parts.username or "postgres"
        auth = f"{user}:{parts.password}@" if parts.password else f"{user}@"
        return urlunsplit((parts.scheme, f"{auth}127.0.0.1:{self.port}", parts.path, "", ""))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._unix_path is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self._unix_path)
            else:
                assert self._target_host is not None
                assert self._target_port is not None
                up_reader, up_writer = await asyncio.open_connection(
                    self._target_host, self._target_port
                )
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump_delayed(up_reader, writer)),
        ]
        self._pumps.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._pumps.difference_update(pumps)
        for end in (writer, up_writer):
            end.transport.abort()
            self._writers.discard(end)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    async def _pump_delayed(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Forward the server's bytes, each chunk `reply_delay_s` after it arrived."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(due - loop.time(), 0.0))
                writer.write(data)
                await writer.drain()

        delivering = asyncio.create_task(deliver())
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await reader.read(65536):
                    queue.put_nowait((loop.time() + self.reply_delay_s, data))
                queue.put_nowait((loop.time(), b""))
                await delivering
        finally:
            delivering.cancel()
            await asyncio.gather(delivering, return_exceptions=True)
            writer.transport.abort()
