"""`relayd check`: can this relay run here? One line per check, in the order a relay needs
them: configuration, database, schema, privileges, LISTEN, sink, clock, and how a crashed
relay's claims are recovered. A check whose
prerequisite failed is reported as skipped, never as passed; the privileges line is
reported even when the schema check failed, if it found a privilege missing (often why).
The privileges are the relay role's, or the operator's (`--role operator`).

Exit code (through the CLI): 0 when every check passed or only warned, 1 when one failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from relayd.core.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    ConfigError,
    DatabaseUnavailable,
    SchemaError,
    StatementError,
)
from relayd.engine.liveness import NoProof, probe, runtime_dir
from relayd.operator.command import Needs, command_store
from relayd.operator.render import printable
from relayd.settings import Settings, describe_config_source, load_settings
from relayd.sinks import SinkHealth
from relayd.store.privileges import COMMANDS, Role, hint, role_privileges

if TYPE_CHECKING:
    from relayd.operator.command import Commands
    from relayd.store import Store

# Host and database clocks further apart than this are reported. Leases use the database's
# clock only, so a skew never breaks fencing; it misleads people reading timestamps.
CLOCK_WARN_S = 1.0
_CONNECT_TIMEOUT_S = 5.0


class Verdict(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class CheckLine:
    name: str
    verdict: Verdict
    detail: str

    def render(self) -> str:
        # A detail may quote the sink's manifest or the server's words.
        return printable(f"{self.verdict.value:<8}{self.name:<12}{self.detail}")

    def as_json(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}


def failed(lines: list[CheckLine]) -> bool:
    return any(line.verdict is Verdict.FAIL for line in lines)


def check_command(args: argparse.Namespace) -> int:
    """`relayd check [--role relay|operator] [--json]`: one line per check."""
    settings = load_settings(args.config)
    source = describe_config_source(args.config)
    lines = asyncio.run(run_checks(settings, source, Role(args.role)))
    if args.json:
        sys.stdout.write(json.dumps([line.as_json() for line in lines], indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(line.render() for line in lines) + "\n")
    return EXIT_FAILURE if failed(lines) else EXIT_OK


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd check`, beside its handler."""
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
    check.set_defaults(handler=check_command)


async def run_checks(
    settings: Settings, config_source: str, role: Role = Role.RELAY
) -> list[CheckLine]:
    """Every check, in order; stops asking the database once it is out of reach. The
    privileges checked are those of `role` (relayd/store/privileges.py)."""
    lines = [CheckLine("config", Verdict.OK, config_source)]
    try:
        _ = settings.dsn  # a missing DSN is this check's finding, not a usage error
    except ConfigError as exc:
        lines.append(CheckLine("config", Verdict.FAIL, str(exc)))
        return lines + _skipped("database", "schema", "privileges", "listen", "sink", "clock")
    connect_timeout_s = min(settings.database.connect_timeout_s, _CONNECT_TIMEOUT_S)
    async with contextlib.AsyncExitStack() as stack:
        try:
            store = await stack.enter_async_context(
                command_store(settings, needs=Needs.NOTHING, connect_timeout_s=connect_timeout_s)
            )
        except (ConfigError, DatabaseUnavailable) as exc:
            lines.append(CheckLine("database", Verdict.FAIL, _database_failure(exc)))
            lines += _skipped("schema", "privileges", "listen")
            return [*lines, await _sink_line(settings), *_skipped("clock"), _recovery(settings)]
        lines += await _database_lines(store, settings, role)
    lines.insert(-1, await _sink_line(settings))  # before the clock line
    return [*lines, _recovery(settings)]


def _recovery(settings: Settings) -> CheckLine:
    """How a relay restarted after a crash gets its dead predecessor's claims back: at once,
    with a proof of life (relayd/engine/liveness.py), or once their lease ends."""
    found = probe(runtime_dir(settings.relay.runtime_dir, os.environ))
    if isinstance(found, NoProof):
        detail = (
            f"no proof of life ({found.reason}): a crashed relay's claims wait out "
            f"relay.lease_s ({settings.relay.lease_s:g}s)"
        )
    else:
        detail = (
            f"proof of life in {found}: a relay restarted after a crash takes its "
            "predecessor's claims back at once"
        )
    return CheckLine("recovery", Verdict.OK, detail)


async def _database_lines(store: Store, settings: Settings, role: Role) -> list[CheckLine]:
    sent_s = time.time()
    identity = await store.check_identity()
    received_s = time.time()
    lines = [
        CheckLine(
            "database",
            Verdict.OK,
            f"reachable: database {identity['database']} as {identity['username']} "
            f"(PostgreSQL {identity['server_version']})",
        )
    ]
    if identity["in_recovery"]:
        lines[0] = CheckLine(
            "database", Verdict.FAIL, "the server is a standby (read-only): point at the primary"
        )
    privileges, lacking = await _privileges(store, settings, role)
    schema = await _attempt("schema", lambda: _schema(store))
    lines.append(schema)
    if schema.verdict is Verdict.OK or lacking:
        lines.append(privileges)
    else:
        lines += _skipped("privileges")
    lines.append(await _listen(store, settings, migrated=schema.verdict is Verdict.OK))
    # The database's clock read halfway through the round trip, against ours.
    skew_s = identity["epoch_s"] - (sent_s + received_s) / 2
    verdict = Verdict.WARN if abs(skew_s) > CLOCK_WARN_S else Verdict.OK
    lines.append(
        CheckLine(
            "clock",
            verdict,
            f"this host is {abs(skew_s):.3f}s {'behind' if skew_s > 0 else 'ahead of'} "
            "the database (leases use the database's clock)",
        )
    )
    return lines


async def _attempt(name: str, check: Callable[[], Awaitable[str]]) -> CheckLine:
    try:
        return CheckLine(name, Verdict.OK, await check())
    except SchemaError as exc:
        return CheckLine(name, Verdict.FAIL, str(exc))
    except (DatabaseUnavailable, StatementError) as exc:
        return CheckLine(name, Verdict.FAIL, f"{exc}")


async def _schema(store: Store) -> str:
    from relayd.store.migrations import require_current  # noqa: PLC0415 - asyncpg only when checking

    await require_current(store)
    versions = await store.applied_versions()
    return f"{store.table} is migrated (version {max(versions):04d})"


async def _privileges(store: Store, settings: Settings, role: Role) -> tuple[CheckLine, bool]:
    """The privileges line for `role`, and whether it found a privilege missing: that is
    reported even when the schema check failed, since a missing grant is often why."""
    table = store.table
    wanted = role_privileges(role, cleanup=settings.cleanup.enabled)
    try:
        held = await store.check_privileges(wanted)
        sees_writers = await store.check_sees_writers()
    except (DatabaseUnavailable, StatementError) as exc:
        return CheckLine("privileges", Verdict.FAIL, str(exc)), False
    answers = list(zip(wanted, held, strict=True))
    missing = [p.display(table) for p, ok in answers if ok is False]
    if missing:
        detail = f"the {role} role lacks {', '.join(missing)}: {hint(role)}"
        return CheckLine("privileges", Verdict.FAIL, detail), True
    absent = sorted({p.obj.display(table) for p, ok in answers if ok is None})
    if absent:
        detail = f"{', '.join(absent)} missing: run `relayd migrate`"
        return CheckLine("privileges", Verdict.FAIL, detail), False
    detail = f"the {len(wanted)} privileges of the {role} role ({COMMANDS[role]}) are held"
    if role is Role.RELAY and not sees_writers:
        detail = (
            f"{detail}, but not pg_read_all_stats: without it relayd cannot see when other "
            "roles' transactions started, so every claim reads the whole claim index (see "
            "docs/performance.md)"
        )
        return CheckLine("privileges", Verdict.WARN, detail), False
    return CheckLine("privileges", Verdict.OK, detail), False


async def _listen(store: Store, settings: Settings, *, migrated: bool) -> CheckLine:
    """How idle relays learn of new rows; a warning when the outbox's NOTIFY trigger (once
    it is migrated) is not what outbox.notify_trigger says `relayd migrate` leaves."""
    polling = f"relays poll every {settings.relay.poll_interval_s:g}s"
    wanted = settings.outbox.notify_trigger
    try:
        if migrated:
            state = await store.notify_trigger_state()
            fires = state is not None and state != "D"  # 'D': disabled by hand
            if wanted and not fires:
                return CheckLine(
                    "listen",
                    Verdict.WARN,
                    f"{store.table} has no NOTIFY trigger that fires, though "
                    f"outbox.notify_trigger = true: {polling}; `relayd migrate` creates it",
                )
            if fires and not wanted:
                return CheckLine(
                    "listen",
                    Verdict.WARN,
                    f"{store.table} still has its NOTIFY trigger, though outbox.notify_trigger "
                    "= false: producers cannot PREPARE TRANSACTION; `relayd migrate` drops it",
                )
        if not wanted:
            detail = f"not used (outbox.notify_trigger = false, no NOTIFY trigger): {polling}"
        elif not settings.relay.listen:
            detail = f"not used (relay.listen = false): {polling}"
        else:
            await store.check_listen()
            trigger = "; the NOTIFY trigger is in place" if migrated else ""
            detail = f"LISTEN on channel {store.table.channel} works{trigger}"
    except (DatabaseUnavailable, StatementError) as exc:
        return CheckLine("listen", Verdict.FAIL, str(exc))
    return CheckLine("listen", Verdict.OK, detail)


async def _sink_line(settings: Settings) -> CheckLine:
    try:
        target = settings.sink.target
        sink = settings.sink.build(_Ignored())
    except ConfigError as exc:
        return CheckLine("sink", Verdict.FAIL, str(exc))
    await sink.start()
    try:
        async with asyncio.timeout(settings.sink.timeout_s):
            ok, detail = await sink.check()
    except TimeoutError:
        ok, detail = False, f"no answer within sink.timeout_s ({settings.sink.timeout_s:g}s)"
    finally:
        await sink.close()
    if ok:
        detail = f"{detail}; {sink.capabilities.ambiguous}"
    return CheckLine("sink", Verdict.OK if ok else Verdict.FAIL, f"{target}: {detail}")


class _Ignored(SinkHealth):
    """`relayd check` has no breaker to feed."""

    def sink_accepted(self) -> None:
        pass

    def sink_answered(self) -> None:
        pass

    def sink_failed(self, *, severe: bool, reason: str) -> None:
        pass

    def sink_reconnected(self) -> None:
        pass


def _database_failure(exc: ConfigError | DatabaseUnavailable) -> str:
    if isinstance(exc, ConfigError):
        return str(exc)
    return f"unreachable: {exc}"


def _skipped(*names: str) -> list[CheckLine]:
    reason = "not checked: an earlier check failed"
    return [CheckLine(name, Verdict.SKIPPED, reason) for name in names]
