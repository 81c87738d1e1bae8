"""The `relayd` command line: subcommands, their output, and exit codes.

Exit codes: 0 success, 1 failure (database unreachable, schema missing, a run that crashed),
2 usage or configuration error (one line on stderr naming the key).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from relayd import __version__
from relayd.config import Settings, load_settings
from relayd.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    ConfigError,
    DatabaseUnavailable,
    ListenError,
    MigrationError,
    SchemaError,
    StatementError,
)

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        _fail(f"config error: {exc}")
        return EXIT_USAGE
    except (SchemaError, MigrationError, ListenError) as exc:
        _fail(str(exc))
        return EXIT_FAILURE
    except DatabaseUnavailable as exc:
        _fail(f"database unavailable: {exc}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        metavar="PATH",
        help="TOML file (default: $RELAYD_CONFIG, else /etc/relayd/config.toml)",
    )
    parser = argparse.ArgumentParser(
        prog="relayd",
        description="Publish committed PostgreSQL outbox rows to an Open Job Spec server.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"relayd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", parents=[common], help="run the relay until signalled")
    run.set_defaults(handler=_run)

    migrate = commands.add_parser(
        "migrate", parents=[common], help="create or upgrade the outbox table (idempotent)"
    )
    migrate.add_argument("--json", action="store_true", help="machine-readable output")
    migrate.set_defaults(handler=_migrate)

    config = commands.add_parser("config", parents=[common], help="inspect the configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser(
        "show", parents=[common], help="print the effective configuration, secrets redacted"
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(handler=_config_show)

    status = commands.add_parser(
        "status",
        parents=[common],
        help="show the backlog, dead letters, pauses and the relays running now (read-only)",
    )
    status.add_argument(
        "--json", action="store_true", help="print JSON (the shape in docs/operations.md)"
    )
    status.set_defaults(handler=_status)

    demo = commands.add_parser(
        "demo", help="run the main job end to end on an embedded PostgreSQL and the emulator"
    )
    demo.add_argument("--rows", type=int, default=10_000, help="orders to commit (10,000)")
    demo.set_defaults(handler=_demo)

    emulator = commands.add_parser(
        "emulator", help="serve the in-memory OJS emulator (for demos and tests)"
    )
    emulator.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    emulator.add_argument(
        "--duplicate-mode",
        choices=("spec409", "overwrite", "pk500"),
        default="spec409",
        help="a reused job id: 409 (conformance), silent overwrite (redis, lite), 500 (postgres)",
    )
    emulator.add_argument(
        "--queue-source",
        choices=("options", "top_level", "either"),
        default="options",
        help="where the job's queue is read (OJS binding, the top-level-queue gateway, or both)",
    )
    emulator.add_argument("--batch-atomic", action=argparse.BooleanOptionalAction, default=True)
    emulator.add_argument(
        "--batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve POST /ojs/v1/jobs/batch and advertise it in the manifest",
    )
    emulator.add_argument("--auth-token-file", metavar="PATH")
    emulator.add_argument("--retention-s", type=float, metavar="SECONDS")
    emulator.set_defaults(handler=_emulator)

    return parser


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config)


def _fail(message: str) -> None:
    print(f"relayd: {message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from relayd.daemon import run_daemon  # noqa: PLC0415 - keeps `config show` light

    settings = _settings(args)
    return asyncio.run(run_daemon(settings))


def _migrate(args: argparse.Namespace) -> int:
    from relayd.migrate import connect_and_migrate  # noqa: PLC0415

    settings = _settings(args)

    async def apply() -> dict[str, Any]:
        report = await connect_and_migrate(
            settings.dsn,
            settings.outbox.outbox_table,
            connect_timeout_s=settings.database.connect_timeout_s,
            statement_timeout_s=max(settings.database.statement_timeout_s, 300.0),
        )
        return {
            "table": settings.outbox.table,
            "applied": [f"{m.version:04d}_{m.name}" for m in report.applied],
            "already_applied": [f"{m.version:04d}_{m.name}" for m in report.already],
        }

    result = asyncio.run(apply())
    if args.json:
        print(json.dumps(result))
    elif result["applied"]:
        print(f"{result['table']}: applied {', '.join(result['applied'])}")
    else:
        count = len(result["already_applied"])
        print(f"{result['table']}: up to date ({count} migration{'s' * (count != 1)} applied)")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from relayd.status import (  # noqa: PLC0415
        StatusReport,
        build_report,
        render_text,
        report_json,
    )
    from relayd.store import Store  # noqa: PLC0415

    settings = _settings(args)
    table = settings.outbox.outbox_table

    async def read() -> StatusReport:
        # No waiting for PostgreSQL here, unlike `relayd run`: an operator asked now.
        store = await Store.connect(
            settings.dsn,
            table,
            max_size=2,
            connect_timeout_s=settings.database.connect_timeout_s,
            statement_timeout_s=settings.database.statement_timeout_s,
        )
        try:
            await store.check_schema()
            try:
                return await build_report(
                    store,
                    sample_interval_s=settings.metrics.sample_interval_s,
                    lease_s=settings.relay.lease_s,
                )
            except StatementError as exc:
                # The relay tables of migration 0003 are missing, most likely.
                raise SchemaError(f"{table}: {exc}: run `relayd migrate`") from None
        finally:
            await store.close()

    report = asyncio.run(read())
    if args.json:
        print(json.dumps(report_json(report), indent=2))
    else:
        print(render_text(report), end="")
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from relayd.demo import run_demo  # noqa: PLC0415 - needs the `embedded` extra

    if args.rows < 1:
        raise ConfigError("--rows", "must be at least 1")
    return run_demo(args.rows)


def _emulator(args: argparse.Namespace) -> int:
    from relayd.config import parse_listen  # noqa: PLC0415
    from relayd.testing.emulator import config_from_options, serve  # noqa: PLC0415

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        raise ConfigError("--listen", str(exc)) from None
    try:
        config = config_from_options(
            duplicate_mode=args.duplicate_mode,
            queue_source=args.queue_source,
            batch_atomic=args.batch_atomic,
            batch_enqueue=args.batch,
            auth_token_file=args.auth_token_file,
            retention_s=args.retention_s,
        )
    except ValueError as exc:
        raise ConfigError("emulator", str(exc)) from None
    serve(host, port, config)
    return EXIT_OK


def _config_show(args: argparse.Namespace) -> int:
    data = _settings(args).redacted()
    print(json.dumps(data, indent=2) if args.json else to_toml(data))
    return EXIT_OK


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    """Render the (flat, two-level) settings as TOML; unset keys become comments."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))
