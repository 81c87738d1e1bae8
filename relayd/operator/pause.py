"""`relayd pause` and `relayd resume`: stop and restart claiming, for one queue or every one,
one job type or every one, on every relay of the outbox at once.

A pause is a row of `relayd_pauses`, database state: the claim statement skips paused queues,
so every running relay obeys from its next claim, and a relay started later obeys too. A
pause needs no relay to be running. Resuming also sends a NOTIFY on the outbox's channel
(the insert trigger's), so idle relays claim at once instead of at their next poll. Both
write one audit row, in the same transaction as the change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from typing import TYPE_CHECKING, Any, TextIO

from relayd.core.envelope import MAX_QUEUE_CHARS, MAX_TYPE_CHARS, QUEUE_PATTERN, TYPE_PATTERN
from relayd.core.errors import EXIT_OK
from relayd.operator.command import (
    BadInput,
    check_text,
    command_store,
    operator_command,
    resolve_actor,
)
from relayd.operator.render import iso, printable, stamp
from relayd.settings import load_settings
from relayd.store.records import EVERY_QUEUE, EVERY_TYPE, Pause, QueueUse, describe_pause

if TYPE_CHECKING:
    from relayd.operator.command import Commands
    from relayd.store import Store

_MAX_REASON_CHARS = 1000
# How many rows `pause --queue` reads at most looking for one that routes to the queue: no
# index holds the effective queue, and an outbox keeps its published rows for days.
QUEUE_USE_ROWS = 1_000_000


# A pause's wildcard when no queue (or no type) is named: EVERY_QUEUE and EVERY_TYPE alike.
_EVERY = "*"


def queue_arg(value: str | None) -> str:
    """`--queue Q` as stored: an OJS queue name, or `'*'` (every queue) when absent."""
    return _name_arg(value, "--queue", "queue name", QUEUE_PATTERN, MAX_QUEUE_CHARS)


def type_arg(value: str | None) -> str:
    """`--type T` as stored: an OJS job type, or `'*'` (every type) when absent."""
    return _name_arg(value, "--type", "job type", TYPE_PATTERN, MAX_TYPE_CHARS)


def _name_arg(
    value: str | None, option: str, what: str, pattern: re.Pattern[str], most: int
) -> str:
    """A queue or type name, checked; absent, the pause's wildcard ('*': every one)."""
    if value is None:
        return _EVERY
    if value == _EVERY:
        raise BadInput(f"{option}: leave it out to act on every {option.removeprefix('--')}")
    if not pattern.match(value) or len(value) > most:
        raise BadInput(
            f"{option}: {value[:60]!r} is not a {what} "
            f"({pattern.pattern}, at most {most} characters)"
        )
    return value


async def pause_queue(store: Store, queue: str, job_type: str, *, reason: str, actor: str) -> bool:
    """Pause `queue` and `job_type` (each `'*'` for every one) on every relay of the
    store's outbox, with its audit row: what `relayd pause` and the console run. True if the
    pause is new, False if it was there already (its reason is then updated)."""
    return await store.pause(queue, job_type, reason, actor)


async def queue_use(store: Store, queue: str) -> QueueUse | None:
    """Whether a row of the outbox routes to `queue` (None for every queue). Looked at once a
    pause is written: a pause ahead of a deploy is legitimate, so an unused queue is only
    worth a warning (a typo would hold nothing)."""
    return None if queue == EVERY_QUEUE else await store.queue_use(queue, QUEUE_USE_ROWS)


async def resume_queue(
    store: Store, queue: str, job_type: str, *, actor: str, reason: str | None
) -> Pause | None:
    """Lift the pause of exactly `queue` and `job_type`, with its audit row, and wake idle
    relays: what `relayd resume` and the console run. The pause lifted, or None if there was
    none."""
    return await store.resume(queue, job_type, actor, reason)


@operator_command("pause")
def pause_command(args: argparse.Namespace) -> int:
    """`relayd pause [--queue Q] [--type T] --reason TEXT`."""
    queue, job_type = queue_arg(args.queue), type_arg(args.type)
    if args.reason is None:
        raise BadInput("--reason: required: say why, for the audit trail and the other operators")
    reason = check_text(args.reason, "--reason", _MAX_REASON_CHARS)
    actor = resolve_actor(args.actor)
    settings = load_settings(args.config, sink_files=False)

    async def pause() -> tuple[bool, list[Pause], QueueUse | None]:
        async with command_store(settings) as store:
            inserted = await pause_queue(store, queue, job_type, reason=reason, actor=actor)
            return inserted, await store.pauses(), await queue_use(store, queue)

    inserted, pauses, use = asyncio.run(pause())
    warning = unused_queue_warning(queue, job_type, use, settings.outbox.table)
    if warning is not None:
        sys.stderr.write(f"relayd: warning: {warning}\n")
    if args.json:
        data = {
            "queue": queue,
            "type": job_type,
            "paused": True,
            "updated": not inserted,
            "warning": warning,
            "pauses": [pause_json(p) for p in pauses],
        }
        sys.stdout.write(json.dumps(data) + "\n")
        return EXIT_OK
    what = describe_pause(queue, job_type)
    if inserted:
        sys.stdout.write(
            f"paused {what} of {settings.outbox.table}: every relay stops claiming "
            "it from its next claim\n"
        )
    else:
        sys.stdout.write(f"{what} was paused already: reason updated\n")
    _render_pauses(pauses, sys.stdout)
    return EXIT_OK


@operator_command("resume")
def resume_command(args: argparse.Namespace) -> int:
    """`relayd resume [--queue Q] [--type T] [--reason TEXT]`."""
    queue, job_type = queue_arg(args.queue), type_arg(args.type)
    reason = None if args.reason is None else check_text(args.reason, "--reason", _MAX_REASON_CHARS)
    actor = resolve_actor(args.actor)
    settings = load_settings(args.config, sink_files=False)

    async def resume() -> tuple[Pause | None, list[Pause]]:
        async with command_store(settings) as store:
            lifted = await resume_queue(store, queue, job_type, actor=actor, reason=reason)
            return lifted, await store.pauses()

    lifted, pauses = asyncio.run(resume())
    if args.json:
        data = {
            "queue": queue,
            "type": job_type,
            "resumed": lifted is not None,
            "lifted": None if lifted is None else pause_json(lifted),
            "pauses": [pause_json(p) for p in pauses],
        }
        sys.stdout.write(json.dumps(data) + "\n")
        return EXIT_OK
    what = describe_pause(queue, job_type)
    if lifted is None:
        hint = _not_paused_hint(queue, job_type, pauses)
        sys.stdout.write(f"{what} was not paused: nothing to resume{hint}\n")
    else:
        sys.stdout.write(
            printable(
                f"resumed {what} of {settings.outbox.table} (paused since "
                f"{stamp(lifted.paused_at)} by {lifted.paused_by}: {lifted.reason}); "
                "idle relays woken"
            )
            + "\n"
        )
    _render_pauses(pauses, sys.stdout)
    return EXIT_OK


def _not_paused_hint(queue: str, job_type: str, pauses: list[Pause]) -> str:
    """Which pause holds what the operator named, when it is not that exact one."""
    holding = next((p for p in pauses if p.holds(queue, job_type)), None)
    if holding is None:
        return ""
    command = "relayd resume"
    if holding.queue != EVERY_QUEUE:
        command += f" --queue {holding.queue}"
    if holding.type != EVERY_TYPE:
        command += f" --type {holding.type}"
    return printable(f" ({holding.describe()} is paused: `{command}` lifts that)")


def unused_queue_warning(queue: str, job_type: str, use: QueueUse | None, table: str) -> str | None:
    if use is None or use.used:
        return None
    resume = f"relayd resume --queue {queue}"
    if job_type != EVERY_TYPE:
        resume += f" --type {job_type}"
    if use.rows_read < QUEUE_USE_ROWS:
        where = f"no row of {table} routes to queue {queue} (all {use.rows_read:,} rows read)"
    else:
        where = f"none of the first {use.rows_read:,} rows of {table} routes to queue {queue}"
    return f"{where}: paused all the same; if the name is wrong, `{resume}`"


def _render_pauses(pauses: list[Pause], out: TextIO) -> None:
    if not pauses:
        out.write("nothing is paused now\n")
        return
    out.write("paused now:\n")
    for pause in pauses:
        out.write(
            printable(
                f"  {pause.describe()}: {pause.reason} "
                f"(by {pause.paused_by} since {stamp(pause.paused_at)})"
            )
            + "\n"
        )


def pause_json(pause: Pause) -> dict[str, Any]:
    """A pause in `--json` output (`relayd pause`, `resume` and `status` alike)."""
    return {
        "queue": pause.queue,
        "type": pause.type,
        "reason": pause.reason,
        "paused_by": pause.paused_by,
        "paused_at": iso(pause.paused_at),
    }


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd pause` and `relayd resume`, beside their handlers."""
    pause = commands.add_parser(
        "pause",
        parents=[common],
        help="stop claiming a queue or a job type, or everything, on every relay",
    )
    pause.add_argument("--queue", help="one queue (default: every queue)")
    pause.add_argument("--type", help="one job type (default: every type)")
    pause.add_argument("--reason", metavar="TEXT", help="why (required; audited)")
    pause.add_argument("--actor", metavar="NAME", help="who acts, for the audit (the OS user)")
    pause.add_argument("--json", action="store_true", help="machine-readable output")
    pause.set_defaults(handler=pause_command)
    resume = commands.add_parser("resume", parents=[common], help="lift a pause")
    resume.add_argument("--queue", help="one queue (default: the pause of every queue)")
    resume.add_argument("--type", help="one job type (default: the pause of every type)")
    resume.add_argument("--reason", metavar="TEXT", help="why (optional; audited)")
    resume.add_argument("--actor", metavar="NAME", help="who acts, for the audit (the OS user)")
    resume.add_argument("--json", action="store_true", help="machine-readable output")
    resume.set_defaults(handler=resume_command)
