"""relayd's exception hierarchy; foreign exceptions are translated at one boundary each.

    RelaydError
    ├── ConfigError            a bad setting: the CLI prints one line naming the key, exits 2
    ├── SchemaError            the outbox table is missing or not migrated: exit 1
    ├── MigrationError         a migration file is missing, edited after it ran, or failed
    └── DatabaseUnavailable    PostgreSQL could not be reached or dropped the connection;
                               callers back off and retry, they never crash on it

asyncpg exceptions are translated in `store.py`, aiohttp exceptions in `sinks/ojs.py`
(into outcome values, not exceptions), pydantic errors in `config.py`.
"""

from __future__ import annotations

# Process exit codes (design.md §5).
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class RelaydError(Exception):
    """Base class of every error relayd raises on purpose."""


class ConfigError(RelaydError):
    """A setting is invalid; `key` is its dotted name (`outbox.table`)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class SchemaError(RelaydError):
    """The outbox table does not exist or lacks relay columns (run `relayd migrate`)."""


class MigrationError(RelaydError):
    """A migration could not be applied, or an applied one no longer matches its file."""


class DatabaseUnavailable(RelaydError):
    """PostgreSQL is unreachable or the connection broke mid-statement."""
