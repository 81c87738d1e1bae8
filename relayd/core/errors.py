"""relayd's exception hierarchy; foreign exceptions are translated at one boundary each.

    RelaydError
    ├── ConfigError            a bad setting: the CLI prints one line naming the key, exits 2
    ├── SchemaError            the outbox table is missing or not migrated: exit 1
    ├── MigrationError         a migration file is missing, edited after it ran, or failed
    ├── DatabaseUnavailable    PostgreSQL could not be reached or dropped the connection;
    │                          callers back off and retry, they never crash on it
    ├── StatementError         PostgreSQL refused a statement for a reason retrying will not
    │   │                      cure (a schema changed under relayd, a bug): names the statement
    │   └── PrivilegeError     ... because relayd's role lacks a privilege (SQLSTATE 42501):
    │                          also names the privileges and the object (relayd/store/privileges.py)
    ├── AppendError            a producer's event cannot be appended (relayd/producer/__init__.py
    │                          draws its subclasses): raised in the producer's transaction
    ├── ListenError            an address relayd must serve on is taken or refused: exit 1
    └── WorkerCrashed          a relay worker's cycle failed unexpectedly: the daemon logs the
                               step, statement and rows, drains the others and exits 1

asyncpg exceptions are translated in `store/connection.py`, aiohttp exceptions in
`sinks/ojs.py` (into outcome values, not exceptions), pydantic errors in `config.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

# Process exit codes (docs/run.md).
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


class StatementError(RelaydError):
    """PostgreSQL refused one of relayd's statements for a reason other than a lost
    connection; `statement` is the query's name (relayd/store/sql/)."""

    def __init__(self, statement: str, description: str) -> None:
        super().__init__(f"{statement}: {description}")
        self.statement = statement


class PrivilegeError(StatementError):
    """PostgreSQL refused one of relayd's statements because the role lacks a privilege;
    the description names what the statement needs, on which object."""


class ListenError(RelaydError):
    """relayd cannot listen where its configuration says (`key`, e.g. `http.listen`): the
    setting is valid, the environment is not (the port is taken, the address is not ours)."""

    def __init__(self, key: str, address: str, reason: str) -> None:
        super().__init__(f"{key}: cannot listen on {address}: {reason}")
        self.key = key


class WorkerCrashed(RelaydError):
    """A relay worker failed in a way that is neither a row's fault (dead-lettered) nor the
    connection's (retried): relayd's own bug, or a database that changed under it."""

    def __init__(self, step: str, event_ids: Sequence[str], statement: str | None = None) -> None:
        where = f"{step} ({statement})" if statement else step
        super().__init__(f"worker crashed in {where} holding {len(event_ids)} row(s)")
        self.step = step
        self.event_ids = list(event_ids)
        self.statement = statement
