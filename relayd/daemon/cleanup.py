"""Retention: delete published rows older than `cleanup.published_retention_s`, in small
batches; a housekeeping chore of the daemon (relayd/engine/chores.py), every `interval_s`.
Dead rows are never deleted here (C7): only an operator discards them."""

from __future__ import annotations

import asyncio

from relayd.config.sections import CleanupSettings
from relayd.store import Store
from relayd.telemetry.logs import get_logger


async def clean_published(store: Store, settings: CleanupSettings, stopping: asyncio.Event) -> None:
    """Delete expired published rows batch by batch until none is left (or the daemon
    stops). A refused DELETE (a foreign key from an application table to a published row, a
    trigger, a revoked privilege) raises `StatementError`; the rows deleted before it stay
    deleted, and the chore reports the failure."""
    deleted = 0
    try:
        while not stopping.is_set():
            count = await store.delete_published(
                settings.published_retention_s, settings.batch_size
            )
            deleted += count
            if count < settings.batch_size:
                break
    finally:
        if deleted:
            get_logger("cleanup").info("cleanup.deleted", rows=deleted)
