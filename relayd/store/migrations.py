"""Schema migrations: `migrations/NNNN_*.sql`, applied in order under an advisory lock.

The files ship inside the wheel as `relayd/_migrations` (pyproject force-include); from a
source checkout they are read from the repository's `migrations/` directory.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

from relayd.core.errors import MigrationError, SchemaError
from relayd.core.rows import OutboxTable
from relayd.store import MigrationStep, Store, render

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# Checksums of earlier texts of a migration that differ from today's in comments only: an
# outbox migrated with one of them is up to date, not "applied from a different file".
_EARLIER_CHECKSUMS: dict[int, frozenset[str]] = {
    1: frozenset({"083b83243a35e052565553f82639fe8db236bb39ce94c9de5389237b1ed40e65"}),
}


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    template: str

    @property
    def checksum(self) -> str:
        """Of the template, so the same file checks the same for every outbox table."""
        return hashlib.sha256(self.template.encode()).hexdigest()

    def sql(self, table: OutboxTable) -> str:
        return render(self.template, table)

    def step(self, table: OutboxTable) -> MigrationStep:
        accepted = _EARLIER_CHECKSUMS.get(self.version, frozenset()) | {self.checksum}
        return MigrationStep(self.version, self.name, self.checksum, accepted, self.sql(table))


@dataclass(frozen=True, slots=True)
class MigrationReport:
    applied: list[Migration]
    already: list[Migration]
    notify_trigger: bool  # whether the outbox now has its NOTIFY trigger
    notify_trigger_changed: bool  # created or dropped by this run


def migrations_dir() -> Traversable:
    """Where the migration files are: inside the installed package, else the source tree."""
    packaged = resources.files("relayd").joinpath("_migrations")
    if packaged.is_dir():
        return packaged
    source = Path(__file__).resolve().parents[2] / "migrations"
    if source.is_dir():
        return source
    raise MigrationError("no migrations found (neither relayd/_migrations nor ./migrations)")


def load_migrations(directory: Traversable | None = None) -> list[Migration]:
    """Every `NNNN_name.sql`, in version order; a gap or a duplicate version is an error."""
    directory = migrations_dir() if directory is None else directory
    found: list[Migration] = []
    for entry in directory.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must run 1..N without gaps, found {versions}")
    return found


async def migrate(
    store: Store,
    migrations: list[Migration] | None = None,
    *,
    notify_trigger: bool = True,
    key_column: str | None = None,
) -> MigrationReport:
    """Apply what the ledger lacks, then give the outbox its NOTIFY trigger or take it away
    (`outbox.notify_trigger`), and its key-from-column trigger (`outbox.ordering_key_column`);
    refuse (applying nothing) if an applied file changed."""
    migrations = load_migrations() if migrations is None else migrations
    ledger, applied_now, changed = await store.apply_migrations(
        [m.step(store.table) for m in migrations],
        notify_trigger=notify_trigger,
        key_column=key_column,
    )
    by_version = {m.version: m for m in migrations}
    applied = [by_version[v] for v in applied_now]
    already = [by_version[e.version] for e in ledger if e.version in by_version]
    return MigrationReport(
        applied=applied,
        already=already,
        notify_trigger=notify_trigger,
        notify_trigger_changed=changed,
    )


async def require_current(store: Store, migrations: list[Migration] | None = None) -> None:
    """`SchemaError` unless every migration this relayd ships is applied to the outbox (a
    relay on an older schema would fail at its first claim instead)."""
    await store.check_schema()
    shipped = [m.version for m in (load_migrations() if migrations is None else migrations)]
    applied = set(await store.applied_versions())
    missing = [v for v in shipped if v not in applied]
    if missing:
        raise SchemaError(
            f"outbox table {store.table} lacks migration "
            f"{', '.join(f'{v:04d}' for v in missing)}: run `relayd migrate`"
        )


async def connect_and_migrate(  # noqa: PLR0913 - the command's settings, by keyword
    dsn: str,
    table: OutboxTable,
    *,
    connect_timeout_s: float = 10.0,
    statement_timeout_s: float = 300.0,
    notify_trigger: bool = True,
    key_column: str | None = None,
) -> MigrationReport:
    """Connect, migrate `table`, close: what `relayd migrate` does. Adopting a large outbox
    may take a while, hence a statement timeout of at least five minutes by default."""
    store = await Store.connect(
        dsn,
        table,
        max_size=2,
        connect_timeout_s=connect_timeout_s,
        statement_timeout_s=statement_timeout_s,
    )
    try:
        return await migrate(store, notify_trigger=notify_trigger, key_column=key_column)
    finally:
        await store.close()
