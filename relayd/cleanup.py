"""Retention: delete published rows older than `cleanup.published_retention_s`, in small
batches. Dead rows are never deleted here (C7): only an operator discards them."""

from __future__ import annotations

import asyncio

from relayd.config import CleanupSettings
from relayd.errors import DatabaseUnavailable
from relayd.logs import get_logger
from relayd.store import Store
from relayd.wakeup import wait_event


async def clean_published(store: Store, settings: CleanupSettings, stopping: asyncio.Event) -> None:
    """Every `interval_s`, delete expired published rows batch by batch until none is left."""
    log = get_logger("cleanup")
    while not stopping.is_set():
        deleted = 0
        try:
            while not stopping.is_set():
                count = await store.delete_published(
                    settings.published_retention_s, settings.batch_size
                )
                deleted += count
                if count < settings.batch_size:
                    break
        except DatabaseUnavailable as exc:
            log.warning("cleanup.database_unavailable", error=str(exc))
        if deleted:
            log.info("cleanup.deleted", rows=deleted)
        await wait_event(stopping, settings.interval_s)
