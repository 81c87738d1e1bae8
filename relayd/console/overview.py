"""The overview's figures: `relayd status`'s report, read by `build_report` at most once per
`metrics.sample_interval_s` (the gauges' period), and only while a page asks for it.

However many browsers show the overview and refresh it, the database answers one status read
per interval; a page is served the latest read at once (its time is on the page) and asks for
the next. The first page waits for the first read. A read that fails (PostgreSQL
unreachable, a statement timeout) is what the pages show until the next one succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from relayd.core.errors import DatabaseUnavailable, StatementError
from relayd.operator.status import StatusReport, build_report

if TYPE_CHECKING:
    from relayd.store import Store


class StatusSampler:
    """The latest status report, refreshed on demand, at most once per `interval_s`."""

    def __init__(self, store: Store, *, interval_s: float, lease_s: float) -> None:
        self._store = store
        self.interval_s = interval_s
        self._lease_s = lease_s
        self._wanted = asyncio.Event()
        self._read = asyncio.Event()  # set once the first read is over
        self._report: StatusReport | None = None
        self._failure: DatabaseUnavailable | StatementError | None = None
        self.reads = 0

    async def latest(self) -> StatusReport:
        """The latest report (waiting for the first one); asks for the next read. Raises
        what the latest read failed with."""
        self._wanted.set()
        await self._read.wait()
        if self._failure is not None:
            raise self._failure
        assert self._report is not None  # noqa: S101 - a read either succeeded or failed
        return self._report

    async def run(self, stop: asyncio.Event) -> None:
        """Read whenever a page asked since the last read, then rest `interval_s`; until
        `stop`."""
        while await _first(self._wanted, stop):
            self._wanted.clear()
            try:
                self._report = await build_report(
                    self._store, sample_interval_s=self.interval_s, lease_s=self._lease_s
                )
                self._failure = None
            except (DatabaseUnavailable, StatementError) as exc:
                self._failure = exc
            self.reads += 1
            self._read.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)


async def _first(wanted: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait for `wanted` or `stop`: True for `wanted` (and not stopped)."""
    if not (wanted.is_set() or stop.is_set()):
        waits = {asyncio.ensure_future(wanted.wait()), asyncio.ensure_future(stop.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
    return not stop.is_set()


@contextlib.asynccontextmanager
async def sampling(sampler: StatusSampler) -> AsyncIterator[None]:
    """`sampler` running for the block's duration, in a task group: a crash of it ends the
    block loudly; leaving the block stops it."""
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(sampler.run(stop), name="console-status-sampler")
        try:
            yield
        finally:
            stop.set()
