"""`relayd migrate`: create or upgrade the outbox table, idempotently, as the migrator role.
The migrations and how they are applied are relayd/store/migrations.py's, which `relayd run`
uses too; this is the command and what it prints."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING, Any

from relayd.core.errors import EXIT_OK
from relayd.settings import load_settings

if TYPE_CHECKING:
    from relayd.operator.command import Commands


def migrate_command(args: argparse.Namespace) -> int:
    """`relayd migrate [--json]`."""
    from relayd.store.migrations import connect_and_migrate  # noqa: PLC0415 - asyncpg only when migrating

    settings = load_settings(args.config, sink_files=False)

    async def apply() -> dict[str, Any]:
        report = await connect_and_migrate(
            settings.dsn,
            settings.outbox.outbox_table,
            connect_timeout_s=settings.database.connect_timeout_s,
            statement_timeout_s=max(settings.database.statement_timeout_s, 300.0),
            notify_trigger=settings.outbox.notify_trigger,
            key_column=settings.outbox.ordering_key_column,
        )
        return {
            "table": settings.outbox.table,
            "applied": [f"{m.version:04d}_{m.name}" for m in report.applied],
            "already_applied": [f"{m.version:04d}_{m.name}" for m in report.already],
            "notify_trigger": report.notify_trigger,
            "notify_trigger_changed": report.notify_trigger_changed,
        }

    result = asyncio.run(apply())
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
        return EXIT_OK
    if result["applied"]:
        out.write(f"{result['table']}: applied {', '.join(result['applied'])}\n")
    else:
        count = len(result["already_applied"])
        out.write(
            f"{result['table']}: up to date ({count} migration{'s' * (count != 1)} applied)\n"
        )
    if result["notify_trigger_changed"]:
        done = "created" if result["notify_trigger"] else "dropped"
        setting = str(result["notify_trigger"]).lower()
        out.write(f"{result['table']}: NOTIFY trigger {done} (outbox.notify_trigger = {setting})\n")
    return EXIT_OK


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd migrate`, beside its handler."""
    migrate = commands.add_parser(
        "migrate", parents=[common], help="create or upgrade the outbox table (idempotent)"
    )
    migrate.add_argument("--json", action="store_true", help="machine-readable output")
    migrate.set_defaults(handler=migrate_command)
