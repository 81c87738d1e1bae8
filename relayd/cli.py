"""The `relayd` command line: subcommands, their output, and exit codes.

Exit codes: 0 success, 1 failure (database unreachable, schema missing, a privilege missing,
a run that crashed), 2 usage or configuration error (one line on stderr naming the key),
141 the reader of stdout went away (`relayd dlq list | head`: nothing on stderr, as when a
Unix tool dies of SIGPIPE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from relayd import __version__
from relayd.config import Settings, describe_config_source, example_config, load_settings
from relayd.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    ConfigError,
    DatabaseUnavailable,
    ListenError,
    MigrationError,
    PrivilegeError,
    SchemaError,
    StatementError,
)
from relayd.privileges import Role, hint

Handler = Callable[[argparse.Namespace], int]

# What a shell reports for a process killed by SIGPIPE.
EXIT_READER_GONE = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            # What is still buffered is written now, so that a reader gone shows here rather
            # than as a complaint of the interpreter's last flush.
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        return _reader_gone()


def _dispatch(argv: Sequence[str] | None) -> int:
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
    except StatementError as exc:
        if isinstance(exc, PrivilegeError):
            _fail(f"{exc}; {hint(_ROLES.get(args.command, Role.OPERATOR))}")
        else:
            _fail(f"the database refused the statement {exc}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


# The role whose grants a command needs (the others are the operator's).
_ROLES = {"run": Role.RELAY, "migrate": Role.MIGRATOR}


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it):
    a BrokenPipeError from anything else (a socket) is not the reader going away."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _fd, events in poller.poll(0))
    except (OSError, ValueError):  # no stdout, or not a file descriptor
        return False


def _reader_gone() -> int:
    """Exit quietly when the reader of our output went away, as Unix tools do. Whatever is
    still buffered cannot be written: stdout becomes /dev/null, so that the interpreter's
    flush at exit does not complain either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_READER_GONE


_CONFIG_HELP = "TOML file (default: $RELAYD_CONFIG, else /etc/relayd/config.toml)"


def build_parser() -> argparse.ArgumentParser:
    # `--config` is accepted before and after the subcommand. The subcommands' copy has no
    # default of its own: with one, `relayd --config X migrate` would silently drop X.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=_CONFIG_HELP)
    parser = argparse.ArgumentParser(
        prog="relayd",
        description="Publish committed PostgreSQL outbox rows to an Open Job Spec server.",
    )
    parser.add_argument("--config", metavar="PATH", help=_CONFIG_HELP)
    parser.add_argument("--version", action="version", version=f"relayd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", parents=[common], help="run the relay until signalled")
    run.set_defaults(handler=_run)

    check = commands.add_parser(
        "check",
        parents=[common],
        help="can relayd run here? configuration, database, schema, privileges, sink, clock",
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument(
        "--role",
        choices=(Role.RELAY.value, Role.OPERATOR.value),
        default=Role.RELAY.value,
        help="whose privileges to check: relayd run's (relay, the default) or the operator "
        "commands' (operator)",
    )
    check.set_defaults(handler=_check)
    _add_grants_command(commands, common)

    doctor = commands.add_parser(
        "doctor",
        parents=[common],
        help="the outbox's health in PostgreSQL: vacuum, the xmin horizon, the claim's plan",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(handler=_doctor)

    migrate = commands.add_parser(
        "migrate", parents=[common], help="create or upgrade the outbox table (idempotent)"
    )
    migrate.add_argument("--json", action="store_true", help="machine-readable output")
    migrate.set_defaults(handler=_migrate)

    _add_operator_commands(commands, common)

    config = commands.add_parser("config", parents=[common], help="inspect the configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser(
        "show", parents=[common], help="print the effective configuration, secrets redacted"
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(handler=_config_show)
    example = config_commands.add_parser(
        "example", help="print the example configuration (every key, its default and meaning)"
    )
    example.set_defaults(handler=_config_example)

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
    demo.add_argument(
        "--keep",
        action="store_true",
        help="then keep PostgreSQL and the emulator running, print the configuration for "
        "`relayd dlq list --config PATH` and the like, and wait for Ctrl-C",
    )
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
    emulator.add_argument(
        "--tls-cert", metavar="PATH", help="serve HTTPS with this PEM certificate (chain)"
    )
    emulator.add_argument("--tls-key", metavar="PATH", help="the PEM private key of --tls-cert")
    emulator.set_defaults(handler=_emulator)

    healthcheck = commands.add_parser(
        "healthcheck",
        parents=[common],
        help="ask the running daemon's /healthz (at http.listen): exit 0 if healthy, else 1",
    )
    healthcheck.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS")
    healthcheck.set_defaults(handler=_healthcheck)

    return parser


def _add_grants_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    grants = commands.add_parser(
        "grants",
        parents=[common],
        help="print the GRANT script a role needs on the configured outbox",
    )
    grants.add_argument(
        "--role",
        required=True,
        choices=[role.value for role in Role],
        help="relay (relayd run), operator (status, dlq, pause, resume, doctor) or migrator "
        "(relayd migrate)",
    )
    grants.add_argument(
        "--to",
        metavar="ROLE",
        help="the database role to grant to (default: relayd, relayd_operator, relayd_migrator)",
    )
    grants.add_argument("--json", action="store_true", help="machine-readable output")
    grants.set_defaults(handler=_grants)


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config)


def _fail(message: str) -> None:
    print(f"relayd: {message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from relayd.daemon import run_daemon  # noqa: PLC0415 - keeps `config show` light

    settings = _settings(args)
    return _event_loop_runner()(run_daemon(settings))


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    """uvloop where it is installed (a dependency on every platform it supports): it cuts
    relayd's CPU per row by about a quarter (bench/README.md); asyncio's own loop elsewhere."""
    try:
        import uvloop  # noqa: PLC0415 - only `relayd run` needs it
    except ImportError:
        return asyncio.run
    return uvloop.run


def _check(args: argparse.Namespace) -> int:
    from relayd.check import failed, run_checks  # noqa: PLC0415

    settings = _settings(args)
    lines = asyncio.run(run_checks(settings, describe_config_source(args.config), Role(args.role)))
    if args.json:
        print(json.dumps([line.as_json() for line in lines], indent=2))
    else:
        print("\n".join(line.render() for line in lines))
    return EXIT_FAILURE if failed(lines) else EXIT_OK


def _grants(args: argparse.Namespace) -> int:
    from relayd.privileges import DEFAULT_GRANTEE, grant_script  # noqa: PLC0415

    settings = _settings(args)
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
        print(json.dumps(script.as_json(), indent=2))
    else:
        print(script.text(), end="")
    return EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    from relayd.doctor import diagnose  # noqa: PLC0415
    from relayd.store import Store  # noqa: PLC0415

    settings = _settings(args)

    async def examine() -> Any:
        store = await Store.for_command(settings)
        try:
            return await diagnose(
                store, lease_s=settings.relay.lease_s, batch_size=settings.relay.batch_size
            )
        finally:
            await store.close()

    diagnosis = asyncio.run(examine())
    print(diagnosis.as_json() if args.json else diagnosis.render())
    return EXIT_FAILURE if diagnosis.failed else EXIT_OK


def _migrate(args: argparse.Namespace) -> int:
    from relayd.migrate import connect_and_migrate  # noqa: PLC0415

    settings = _settings(args)

    async def apply() -> dict[str, Any]:
        report = await connect_and_migrate(
            settings.dsn,
            settings.outbox.outbox_table,
            connect_timeout_s=settings.database.connect_timeout_s,
            statement_timeout_s=max(settings.database.statement_timeout_s, 300.0),
            notify_trigger=settings.outbox.notify_trigger,
        )
        return {
            "table": settings.outbox.table,
            "applied": [f"{m.version:04d}_{m.name}" for m in report.applied],
            "already_applied": [f"{m.version:04d}_{m.name}" for m in report.already],
            "notify_trigger": report.notify_trigger,
            "notify_trigger_changed": report.notify_trigger_changed,
        }

    result = asyncio.run(apply())
    if args.json:
        print(json.dumps(result))
        return EXIT_OK
    if result["applied"]:
        print(f"{result['table']}: applied {', '.join(result['applied'])}")
    else:
        count = len(result["already_applied"])
        print(f"{result['table']}: up to date ({count} migration{'s' * (count != 1)} applied)")
    if result["notify_trigger_changed"]:
        done = "created" if result["notify_trigger"] else "dropped"
        setting = str(result["notify_trigger"]).lower()
        print(f"{result['table']}: NOTIFY trigger {done} (outbox.notify_trigger = {setting})")
    return EXIT_OK


def _add_operator_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    """`dlq`, `held`, `pause` and `resume`: operator actions on the outbox, each audited. The
    handlers (relayd/deadletters.py, relayd/held.py, relayd/pauses.py) check their own option
    values, so that a bad one is a single line and exit 2."""
    from relayd import deadletters, held, pauses  # noqa: PLC0415 - kept with the commands it adds

    deadletters.add_commands(commands, common)
    held.add_commands(commands, common)
    pauses.add_commands(commands, common)


def _status(args: argparse.Namespace) -> int:
    from relayd.migrate import require_current  # noqa: PLC0415
    from relayd.status import (  # noqa: PLC0415
        StatusReport,
        build_report,
        render_text,
        report_json,
    )
    from relayd.store import Store  # noqa: PLC0415

    settings = _settings(args)

    async def read() -> StatusReport:
        store = await Store.for_command(settings)
        try:
            await require_current(store)
            return await build_report(
                store,
                sample_interval_s=settings.metrics.sample_interval_s,
                lease_s=settings.relay.lease_s,
            )
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
    return run_demo(args.rows, keep=args.keep)


def _emulator(args: argparse.Namespace) -> int:
    from relayd.config import parse_listen  # noqa: PLC0415
    from relayd.testing.emulator import config_from_options, serve  # noqa: PLC0415
    from relayd.testing.emulator.app import tls_context  # noqa: PLC0415

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        raise ConfigError("--listen", str(exc)) from None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert", "give --tls-cert and --tls-key together")
    ssl_context = None
    if args.tls_cert is not None:
        try:
            ssl_context = tls_context(args.tls_cert, args.tls_key)
        except OSError as exc:  # ssl.SSLError is an OSError too
            raise ConfigError("--tls-cert", f"cannot load the certificate and key: {exc}") from None
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
    serve(host, port, config, ssl_context=ssl_context)
    return EXIT_OK


def _healthcheck(args: argparse.Namespace) -> int:
    from relayd.healthcheck import probe  # noqa: PLC0415 - urllib only, no event loop

    try:
        healthy, said = probe(_settings(args), args.timeout)
    except ConfigError as exc:  # exit 1, not 2: a container runtime reserves 2
        healthy, said = False, f"config error: {exc}"
    if healthy:
        print(f"relayd: healthy: {said}")
        return EXIT_OK
    _fail(f"unhealthy: {said}")
    return EXIT_FAILURE


def _config_show(args: argparse.Namespace) -> int:
    settings = _settings(args)
    data = settings.redacted()
    source = describe_config_source(args.config)
    if args.json:
        print(json.dumps(data, indent=2))
        print(f"relayd: {source}", file=sys.stderr)  # stdout stays pure JSON
        return EXIT_OK
    # The output loads back as the same configuration, except a password given inline: read
    # back as `***` it would be wrong, so that DSN is shown only as a comment.
    withheld: dict[tuple[str, str], str] = {}
    dsn = settings.database.dsn
    if dsn is not None and data["database"]["dsn"] != dsn.get_secret_value():
        withheld["database", "dsn"] = "its password is not printed: keep the DSN in dsn_file"
    print(f"# {source}\n{to_toml(data, withheld)}", end="")
    return EXIT_OK


def _config_example(_args: argparse.Namespace) -> int:
    print(example_config(), end="")
    return EXIT_OK


def to_toml(
    data: dict[str, dict[str, Any]], withheld: dict[tuple[str, str], str] | None = None
) -> str:
    """Render the (flat, two-level) settings as TOML that loads back as the same values;
    unset keys, and the `withheld` ones (with the reason), become comments."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            reason = (withheld or {}).get((section, key))
            if value is None:
                lines.append(f"# {key} = (unset)")
            elif reason is not None:
                lines.append(f"# {key} = {_toml_value(value)}  ({reason})")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):  # sink.servers; sink.routes as inline tables
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        pairs = (f"{key} = {_toml_value(item)}" for key, item in value.items() if item is not None)
        return "{" + ", ".join(pairs) + "}"
    # A TOML basic string: JSON's escapes are TOML's too, but TOML refuses the surrogate
    # pairs JSON writes outside the BMP (so no ensure_ascii), and wants DEL escaped.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
