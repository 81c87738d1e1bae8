"""`relayd grants`: the GRANT script a database role needs on the configured outbox, from the
one list of what each role needs (relayd/store/privileges.py), which `relayd check` checks too."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from relayd.core.errors import EXIT_OK, ConfigError
from relayd.settings import load_settings
from relayd.store.privileges import DEFAULT_GRANTEE, Role, grant_script

if TYPE_CHECKING:
    from relayd.operator.command import Commands


def grants_command(args: argparse.Namespace) -> int:
    """`relayd grants --role ROLE [--to NAME] [--json]`."""
    settings = load_settings(args.config, sink_files=False)
    role = Role(args.role)
    try:
        script = grant_script(
            role,
            settings.outbox.outbox_table,
            DEFAULT_GRANTEE[role] if args.to is None else args.to,
            cleanup=settings.cleanup.enabled,
        )
    except ValueError as exc:
        raise ConfigError("--to", str(exc)) from None
    if args.json:
        sys.stdout.write(json.dumps(script.as_json(), indent=2) + "\n")
    else:
        sys.stdout.write(script.text())
    return EXIT_OK


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd grants`, beside its handler."""
    grants = commands.add_parser(
        "grants",
        parents=[common],
        help="print the GRANT script a role needs on the configured outbox",
    )
    grants.add_argument(
        "--role",
        required=True,
        choices=[role.value for role in Role],
        help="relay (relayd run), operator (status, dlq, held, pause, resume, keys, doctor), "
        "migrator (relayd migrate) or producer (an application's appends: relayd.producer)",
    )
    grants.add_argument(
        "--to",
        metavar="ROLE",
        help="the database role to grant to (default: relayd, relayd_operator, "
        "relayd_migrator, relayd_producer)",
    )
    grants.add_argument("--json", action="store_true", help="machine-readable output")
    grants.set_defaults(handler=grants_command)
