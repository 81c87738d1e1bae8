"""`Store.connect`: what PostgreSQL or asyncpg refuse for good is a ConfigError, not an outage."""

from __future__ import annotations

import pytest

from relayd.core.errors import ConfigError, DatabaseUnavailable
from relayd.store import Store
from tests.support import DEFAULT_TABLE, Database, secret_dsn


async def _refusal(dsn: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        await Store.connect(dsn, DEFAULT_TABLE, max_size=2, connect_timeout_s=5)
    assert caught.value.key == "database.dsn"
    assert "hunter2" not in str(caught.value)
    return caught.value


@pytest.mark.parametrize(
    "query", ["sslmode=bogus", "target_session_attrs=master", "gsslib=hunter2"]
)
async def test_a_dsn_asyncpg_refuses_is_a_config_error(
    empty_database: Database, query: str
) -> None:
    """asyncpg's ClientConfigurationError (an InterfaceError) is not mistaken for an outage."""
    error = await _refusal(secret_dsn(empty_database.dsn, query))
    assert error.reason == "invalid DSN (ClientConfigurationError)"


async def test_an_unknown_server_option_is_a_config_error(empty_database: Database) -> None:
    """A server setting PostgreSQL does not know (42704) names the setting and the SQLSTATE."""
    error = await _refusal(secret_dsn(empty_database.dsn, "bogus_option=1"))
    assert error.reason == (
        'the server refused the connection: unrecognized configuration parameter "bogus_option" '
        "(42704)"
    )


async def test_a_missing_database_is_named(empty_database: Database) -> None:
    """A wrong database name says which database does not exist."""
    dsn = secret_dsn(empty_database.dsn).replace(empty_database.name, "no_such_db")
    error = await _refusal(dsn)
    assert error.reason == (
        'the server refused the connection: database "no_such_db" does not exist (3D000)'
    )


async def test_an_unreachable_server_is_still_unavailable() -> None:
    """Nothing listening on the port stays a DatabaseUnavailable (the daemon retries)."""
    with pytest.raises(DatabaseUnavailable):
        await Store.connect(
            "postgresql://postgres:hunter2@127.0.0.1:9/app", DEFAULT_TABLE, connect_timeout_s=5
        )
