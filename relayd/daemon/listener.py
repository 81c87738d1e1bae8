"""The outbox trigger's NOTIFY, fed into a `WorkSignal` over a dedicated LISTEN connection that
reconnects through the database-outage policy (relay.listen = true)."""

from __future__ import annotations

import asyncio

from relayd.core.errors import DatabaseUnavailable
from relayd.core.wakeup import WorkSignal, wait_first
from relayd.store import Store
from relayd.store.outage import DatabaseRetry
from relayd.telemetry.logs import get_logger

# How often the LISTEN connection proves it is alive (a silently dead TCP peer never closes).
_LISTEN_PING_S = 30.0


async def listen_for_inserts(
    store: Store, wakeup: WorkSignal, stopping: asyncio.Event, database: DatabaseRetry
) -> None:
    """Relay the outbox channel's notifications into `wakeup` until `stopping` is set,
    reconnecting through `database`'s policy when the connection is lost."""
    log = get_logger("wakeup")
    outage = database.outage(log=log, event="wakeup.listen_failed", stopping=stopping)

    async def session() -> None:
        """One LISTEN connection, until it is lost or the daemon stops."""
        try:
            async with store.listen(wakeup.notify) as listener:
                log.info("wakeup.listening", channel=store.table.channel)
                outage.over()
                # Rows committed while we were not listening got no notification for us.
                wakeup.notify()
                while not stopping.is_set() and not listener.lost.is_set():
                    await wait_first((listener.lost, stopping), _LISTEN_PING_S)
                    if not stopping.is_set() and not listener.lost.is_set():
                        async with asyncio.timeout(10):
                            await listener.ping()
        except TimeoutError as exc:
            raise DatabaseUnavailable("the LISTEN connection did not answer its ping") from exc

    await outage.repeat(session)
