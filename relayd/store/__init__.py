"""The only asyncpg user: one method per named query, each module's SQL in `sql/<module>.sql`.

Connection-level failures (refused, reset, server shutting down, statement timeout) are
translated here into `DatabaseUnavailable`; callers back off and retry.
"""

from __future__ import annotations

from relayd.store.connection import (
    FATAL_CONNECT,
    _server_settings,
    connection_gone,
    describe_db_error,
    load_queries,
    render,
)
from relayd.store.console import ConsoleQueries
from relayd.store.cycle import CycleQueries
from relayd.store.health import HealthQueries
from relayd.store.keys import KeyQueries
from relayd.store.listen import Listener, ListenQueries
from relayd.store.pauses import PauseQueries
from relayd.store.sampling import BacklogQueries
from relayd.store.schema import RELAY_COLUMNS, AppliedMigration, MigrationStep, SchemaQueries

__all__ = [
    "FATAL_CONNECT",
    "RELAY_COLUMNS",
    "AppliedMigration",
    "Listener",
    "MigrationStep",
    "Store",
    "_server_settings",
    "connection_gone",
    "describe_db_error",
    "load_queries",
    "render",
]


class Store(
    CycleQueries,
    ConsoleQueries,
    KeyQueries,
    PauseQueries,
    SchemaQueries,
    BacklogQueries,
    HealthQueries,
    ListenQueries,
):
    """Named queries over an asyncpg pool for one outbox table."""
