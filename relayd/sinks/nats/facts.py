"""What the NATS sink knows of the server and the stream (JetStream API level, the stream's
configuration: `relayd/sinks/nats/dedupe.py`), read when first needed and again after a TTL,
a reconnect, or an answer that shows them stale, or when a caller needs them read since a
given moment; concurrent callers share one read."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relayd.core.outcomes import SinkDown
from relayd.sinks.nats.dedupe import StreamFacts

# How long the server's API level and the stream's configuration are trusted before they are
# read again (an operator may change the window or allow_atomic at any time).
FACTS_TTL_S = 60.0


@dataclass(frozen=True, slots=True)
class _Facts:
    facts: StreamFacts
    expires_at: float  # the sink's clock
    read_at: float  # loop time the read was sent


class StreamFactsCache:
    """The facts `read` returns, kept for `FACTS_TTL_S` of `clock`."""

    def __init__(
        self,
        read: Callable[[], Awaitable[StreamFacts | SinkDown]],
        *,
        clock: Callable[[], float],
    ) -> None:
        self._read = read
        self._clock = clock
        self._facts: _Facts | None = None
        self._failure: tuple[float, SinkDown] | None = None
        self._lock = asyncio.Lock()

    def forget(self) -> None:
        """Read them again when next asked (a reconnect, a stream changed since)."""
        self._facts = None

    async def get(self, fresh_since: float | None = None) -> StreamFacts | SinkDown:
        """The facts, read since `fresh_since` (loop time) when given."""
        asked_at = self._clock()
        if (cached := self._cached(asked_at, fresh_since)) is not None:
            return cached  # the usual case, asked for every row: no lock
        async with self._lock:
            if (cached := self._cached(asked_at, fresh_since)) is not None:
                return cached
            failed = self._failure
            if failed is not None and failed[0] >= asked_at:
                return failed[1]  # decided while this row waited: shared, not asked again
            read_at = asyncio.get_running_loop().time()
            facts = await self._read()
            if isinstance(facts, StreamFacts):
                self._facts = _Facts(facts, self._clock() + FACTS_TTL_S, read_at)
                self._failure = None
            else:
                self._failure = (self._clock(), facts)
            return facts

    def _cached(self, asked_at: float, fresh_since: float | None) -> StreamFacts | None:
        known = self._facts
        if known is None or known.expires_at <= asked_at:
            return None
        if fresh_since is not None and known.read_at < fresh_since:
            return None
        return known.facts
