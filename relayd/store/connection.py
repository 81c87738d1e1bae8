"""The pool and the named queries it runs; asyncpg's failures translated into relayd's."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, Any, Self

import asyncpg

from relayd.core.errors import ConfigError, DatabaseUnavailable, PrivilegeError, StatementError
from relayd.core.rows import OutboxTable
from relayd.store.denials import explain_denial

if TYPE_CHECKING:
    from relayd.settings import Settings

# Failures that say "this connection is gone, or the server cannot serve it right now", not
# "this statement is wrong". A PostgreSQL restart or failover, pg_terminate_backend, a network
# cut and a statement timeout all surface as one of these, at any statement, in any state of
# asyncpg's protocol machine (hence InternalClientError and InterfaceError).
_CONNECTION_GONE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,  # class 08, and "connection was closed in the middle"
    asyncpg.InterfaceError,  # "connection is closed", "another operation is in progress"
    asyncpg.InternalClientError,  # protocol state errors after the server went away
    asyncpg.exceptions.InvalidCachedStatementError,  # a schema change: re-prepared next time
)
_SQLSTATE_CLASSES_GONE = frozenset(
    {
        "08",  # connection exception
        "40",  # transaction rollback: serialization failure, deadlock
        "53",  # insufficient resources: too many connections, disk full
        "57",  # operator intervention: shutdown, terminated, statement timeout
        "58",  # system error: I/O
    }
)
_SQLSTATES_GONE = frozenset(
    {
        "55P03",  # lock_not_available (lock_timeout)
        "25006",  # read_only_sql_transaction: a failover left us on a standby
    }
)


def connection_gone(exc: BaseException) -> bool:
    """Whether `exc` means "retry on another connection" rather than "this statement fails"."""
    if isinstance(exc, asyncpg.ClientConfigurationError):
        return False  # a bad DSN or option: an operator must fix it
    if isinstance(exc, _CONNECTION_GONE):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = exc.sqlstate or ""
        return sqlstate[:2] in _SQLSTATE_CLASSES_GONE or sqlstate in _SQLSTATES_GONE
    return False


# Failures an operator must fix (bad password, missing database): retrying will not help.
FATAL_CONNECT: tuple[type[BaseException], ...] = (
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
)

_NAME_LINE = re.compile(r"^-- (name|fragment): (\w+)\s*$", re.M)
# Each store module's statements are in a file of its own name (`sql/cycle.sql` for
# `cycle.py`); a fragment may be used by any block.
_SQL = "sql"


def load_queries(table: OutboxTable, directory: Traversable | None = None) -> dict[str, str]:
    """Read the named blocks of every file in `directory` (relayd's own `sql/`), put each
    fragment where a block or another fragment names it (`@fragment@`), and bind the table
    identifiers into them, once. A name given twice, in one file or in two, is refused: the
    second block would silently replace the first."""
    queries: dict[str, str] = {}
    fragments: dict[str, str] = {}
    where: dict[str, str] = {}
    sql = resources.files("relayd.store").joinpath(_SQL) if directory is None else directory
    for file in sorted(sql.iterdir(), key=lambda entry: entry.name):
        if not file.name.endswith(".sql"):
            continue
        pieces = _NAME_LINE.split(file.read_text(encoding="utf-8"))
        for kind, name, body in zip(pieces[1::3], pieces[2::3], pieces[3::3], strict=True):
            if name in where:
                raise RuntimeError(
                    f"sql/{file.name} names a block {name!r}, as sql/{where[name]} does"
                )
            where[name] = file.name
            if kind == "fragment":
                fragments[name] = _uncommented(body)
            else:
                queries[name] = body.strip()
    for name, statement in queries.items():
        whole = statement
        for _ in range(len(fragments) + 1):  # a fragment may name another, never itself
            for fragment, part in fragments.items():
                whole = whole.replace(f"@{fragment}@", f"({part})")
        queries[name] = render(whole, table)
    return queries


def _uncommented(body: str) -> str:
    """A block without its leading comment lines (a fragment goes inside a statement)."""
    lines = body.strip().splitlines()
    while lines and lines[0].startswith("--"):
        lines.pop(0)
    return "\n".join(lines).strip() if lines else ""


def render(sql: str, table: OutboxTable) -> str:
    """Substitute the validated, quoted identifiers for the @placeholders@."""
    return (
        sql.replace("@outbox@", table.qualified)
        .replace("@schema@", table.quoted_schema)
        .replace("@name@", table.name)
    )


@contextlib.contextmanager
def _translated(statement: str = "connect") -> Iterator[None]:
    """asyncpg's exceptions become relayd's: `DatabaseUnavailable` when the connection is
    gone (callers retry), `StatementError` naming `statement` when PostgreSQL refused it
    (`PrivilegeError`, naming the privilege, when the role lacks one)."""
    try:
        yield
    except Exception as exc:
        if connection_gone(exc):
            raise DatabaseUnavailable(describe_db_error(exc)) from exc
        if isinstance(exc, asyncpg.InsufficientPrivilegeError):
            raise PrivilegeError(statement, explain_denial(statement, exc.message)) from exc
        if isinstance(exc, asyncpg.PostgresError):
            raise StatementError(statement, describe_db_error(exc)) from exc
        raise


def describe_db_error(exc: BaseException) -> str:
    """A short, secret-free description of a database failure."""
    if isinstance(exc, asyncpg.PostgresError):
        return f"{type(exc).__name__}: {exc.sqlstate}: {str(exc)[:200]}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return type(exc).__name__


class StoreBase:
    """An asyncpg pool for one outbox table, and its named queries: what every group of
    queries runs on."""

    def __init__(self, pool: asyncpg.Pool, table: OutboxTable, dsn: str) -> None:
        self._pool = pool
        self._dsn = dsn
        self.table = table
        self._q = load_queries(table)

    @classmethod
    async def connect(  # noqa: PLR0913 - keyword-only pool options
        cls,
        dsn: str,
        table: OutboxTable,
        *,
        max_size: int = 10,
        connect_timeout_s: float = 10.0,
        statement_timeout_s: float = 30.0,
        daemon: bool = False,
    ) -> Self:
        """Open a pool; `DatabaseUnavailable` if PostgreSQL cannot be reached, `ConfigError`
        if it refuses us for good (bad credentials, no such database, a malformed DSN, an
        unknown server option). `daemon` (`relayd run`'s pool): see `_server_settings`."""
        with _translated():
            try:
                pool = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    max_size=max_size,
                    timeout=connect_timeout_s,
                    server_settings=_server_settings(statement_timeout_s, daemon),
                    reset=_keep_session,
                )
            except (ValueError, asyncpg.ClientConfigurationError) as exc:
                # The message may quote the DSN, which may hold a password: name the type only.
                raise ConfigError("database.dsn", f"invalid DSN ({type(exc).__name__})") from None
            except asyncpg.PostgresError as exc:
                # Unreachable, shutting down, too many connections: _translated() makes it
                # DatabaseUnavailable. Anything else the server says while we connect
                # (FATAL_CONNECT, an unknown option in the DSN: 42704) it will say again.
                if connection_gone(exc) and not isinstance(exc, FATAL_CONNECT):
                    raise
                # The server's message names a user, a database or a setting, never the
                # password; the DSN itself is not quoted.
                raise ConfigError(
                    "database.dsn",
                    f"the server refused the connection: {exc.message} ({exc.sqlstate})",
                ) from None
        return cls(pool, table, dsn)

    @classmethod
    async def for_command(
        cls, settings: Settings, *, connect_timeout_s: float | None = None
    ) -> Self:
        """A two-connection pool for one operator command (status, doctor, dlq, check): no
        waiting for PostgreSQL, unlike `relayd run`, since an operator asked now."""
        database = settings.database
        return await cls.connect(
            settings.dsn,
            settings.outbox.outbox_table,
            max_size=2,
            connect_timeout_s=database.connect_timeout_s
            if connect_timeout_s is None
            else connect_timeout_s,
            statement_timeout_s=database.statement_timeout_s,
        )

    async def close(self) -> None:
        with contextlib.suppress(*_CONNECTION_GONE):
            await asyncio.wait_for(self._pool.close(), timeout=5)

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with _translated(name):
            return await self._pool.fetch(self._q[name], *args)


def _server_settings(statement_timeout_s: float, daemon: bool) -> dict[str, str]:
    """The session settings of every connection of a pool.

    `daemon` (`relayd run`'s pool) sets two planner settings, both about the prepared
    statements the daemon repeats, each with an index made for it:

    - `enable_seqscan` off. The planner may price a sequential scan lower while the table's
      statistics say it is small, as they do for a new outbox until autovacuum first
      analyzes it, or for a queue whose live rows are few. The plan a prepared statement
      caches is then a scan of the whole table on every claim (measured: a fresh outbox at
      5,000 rows/s read 13,000 rows per claim and doubled PostgreSQL's CPU). The setting only
      prices sequential scans out; a statement with no other path still scans.
    - `plan_cache_mode` force_generic_plan: each statement is planned once per connection
      (and again after a schema change or an ANALYZE of its tables), not at every execution.
      At the default (`auto`) PostgreSQL plans a statement for its parameters' values five
      times, then keeps the generic plan only if it does not look dearer than those. A
      settle of a few rows (its `unnest` of a short array looks cheaper with the values)
      was planned again at every execution, about a fifth of the server CPU of a one-row
      claim and settle (docs/performance.md), and so is any statement whose statistics
      make its values look cheaper. The daemon's generic plans read the same index in the
      same order as its plans for values, and stop at the same LIMIT.

    Operator commands keep the planner's defaults.
    """
    # Whole milliseconds, never 0: truncating a sub-millisecond timeout would send 0, which
    # PostgreSQL reads as "no limit" (config refuses one too; this is defence in depth).
    # Nearest rather than ceil, so float noise (4.03 s -> 4030.0000000000005 ms) adds nothing.
    settings = {
        "application_name": "relayd",
        "statement_timeout": str(max(1, round(statement_timeout_s * 1000))),
    }
    if daemon:
        settings["enable_seqscan"] = "off"
        settings["plan_cache_mode"] = "force_generic_plan"
    return settings


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """The pool's reset on release, made a no-op. asyncpg's default runs a reset query (close
    cursors, UNLISTEN, RESET ALL, release advisory locks) on every release: one more round trip
    per statement. relayd leaves no session state behind: no SET, no session advisory lock
    (migrations take a transaction-scoped one), LISTEN only on its own connection or undone at
    once (`check_listen`). The pool still rolls back a transaction left open."""
