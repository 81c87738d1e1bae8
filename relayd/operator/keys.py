"""`relayd keys`: the parked keys of ordered delivery, listed, and retried, skipped or released
one at a time, each action in one transaction with one audit row.

The actions are relayd/operator/keys_actions.py's, which another front end may call alike;
this module parses, prints and chooses the exit code: 0 done, 1 when the key is not parked
(nothing changed), 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from relayd.core.envelope import MAX_TYPE_CHARS, TYPE_PATTERN
from relayd.core.errors import EXIT_FAILURE, EXIT_OK
from relayd.operator.command import (
    BadInput,
    Needs,
    check_text,
    command_store,
    fail,
    operator_command,
    parse_count,
    quote,
    resolve_actor,
)
from relayd.operator.keys_actions import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    NotParked,
    check_key,
    outcome_json,
    parked_key_json,
    parked_keys,
    release_key,
    retry_key,
    skip_key,
)
from relayd.operator.render import age, columns, printable, stamp
from relayd.settings import load_settings
from relayd.store.records import HeadState, KeyAction, KeyOutcome, ParkedKey

if TYPE_CHECKING:
    from relayd.operator.command import Commands
    from relayd.store import Store

_MAX_REASON_CHARS = 1000
_ERROR_CHARS = 200  # the parking error in the list's last column; --json has it whole


def _key_arg(value: str) -> str:
    try:
        return check_key(value)
    except ValueError as exc:
        raise BadInput(f"KEY: {exc}") from None


def _route_arg(value: str | None) -> str | None:
    """`--route TYPE`: the event type of the heads that parked (a route of the sink)."""
    if value is None:
        return None
    if not TYPE_PATTERN.match(value) or len(value) > MAX_TYPE_CHARS:
        raise BadInput(
            f"--route: {quote(value)} is not an event type "
            f"({TYPE_PATTERN.pattern}, at most {MAX_TYPE_CHARS} characters)"
        )
    return value


@operator_command("keys list")
def list_command(args: argparse.Namespace) -> int:
    """`relayd keys list [--parked] [--route TYPE] [--limit N] [--json]`: the parked keys,
    parked longest first. Only parked keys are listed (`--parked` says so explicitly): a key
    whose rows flow needs no operator, and there may be millions of them."""
    route = _route_arg(args.route)
    limit = parse_count(args.limit, "--limit", DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
    settings = load_settings(args.config, sink_files=False)

    async def fetch() -> list[ParkedKey]:
        async with command_store(settings, needs=Needs.ORDERED) as store:
            return await parked_keys(store, route=route, limit=limit)

    keys = asyncio.run(fetch())
    if args.json:
        sys.stdout.write(json.dumps({"parked_keys": [parked_key_json(k) for k in keys]}) + "\n")
    else:
        render_list(keys, sys.stdout, limit=limit, route=route)
    return EXIT_OK


def _action_command(args: argparse.Namespace, action: KeyAction, name: str) -> int:
    key = _key_arg(args.key)
    reason = None if args.reason is None else check_text(args.reason, "--reason", _MAX_REASON_CHARS)
    if action is KeyAction.SKIP and reason is None:
        raise BadInput("--reason: required: say why this row may be passed over")
    actor = resolve_actor(args.actor)
    settings = load_settings(args.config, sink_files=False)

    async def act(store: Store) -> KeyOutcome:
        if action is KeyAction.RETRY:
            return await retry_key(store, key, actor=actor, reason=reason, dry_run=args.dry_run)
        if action is KeyAction.SKIP:
            assert reason is not None  # noqa: S101 - checked above
            return await skip_key(store, key, actor=actor, reason=reason, dry_run=args.dry_run)
        return await release_key(store, key, actor=actor, reason=reason, dry_run=args.dry_run)

    async def run() -> KeyOutcome:
        async with command_store(settings, needs=Needs.ORDERED) as store:
            return await act(store)

    try:
        outcome = asyncio.run(run())
    except NotParked as exc:
        fail(
            printable(f"{name}: {exc}: nothing changed (`relayd keys list` shows the parked keys)")
        )
        return EXIT_FAILURE
    if args.json:
        sys.stdout.write(json.dumps(outcome_json(outcome)) + "\n")
    else:
        render_outcome(outcome, sys.stdout, actor=actor)
    return EXIT_OK


@operator_command("keys retry")
def retry_command(args: argparse.Namespace) -> int:
    """`relayd keys retry KEY [--reason TEXT] [--dry-run]`."""
    return _action_command(args, KeyAction.RETRY, "keys retry")


@operator_command("keys skip")
def skip_command(args: argparse.Namespace) -> int:
    """`relayd keys skip KEY --reason TEXT [--dry-run]`."""
    return _action_command(args, KeyAction.SKIP, "keys skip")


@operator_command("keys release")
def release_command(args: argparse.Namespace) -> int:
    """`relayd keys release KEY [--reason TEXT] [--dry-run]`."""
    return _action_command(args, KeyAction.RELEASE, "keys release")


# --- what it prints -------------------------------------------------------------------------


def render_list(keys: Sequence[ParkedKey], out: TextIO, *, limit: int, route: str | None) -> None:
    if not keys:
        where = "" if route is None else f" on route {route}"
        out.write(printable(f"no key is parked{where}") + "\n")
        return
    table = [["KEY", "ROUTE", "PARKED_AT", "FOR", "HEAD", "ATTEMPTS", "WAITING", "REASON", "ERROR"]]
    for parked in keys:
        head = parked.event_id
        if parked.head_state is not HeadState.PENDING:
            head += f" ({parked.head_state.value})"
        waiting = f"{parked.waiting_bound}+" if parked.waiting_capped else str(parked.waiting)
        error = printable(parked.error or "-")
        table.append(
            [
                parked.key,
                parked.route or "-",
                stamp(parked.parked_at),
                age(parked.parked_age_s),
                head,
                "-" if parked.attempts is None else str(parked.attempts),
                waiting,
                parked.reason,
                error if len(error) <= _ERROR_CHARS else error[: _ERROR_CHARS - 3] + "...",
            ]
        )
    for line in columns(table, right=(5, 6)):
        out.write(line + "\n")
    noun = "parked key" if len(keys) == 1 else "parked keys"
    more = "; there may be more: raise --limit" if len(keys) == limit else ""
    out.write(
        f"{len(keys)} {noun}, parked longest first (keys whose rows flow are not listed){more}\n"
    )


# Per action: what it did, and what it would do.
_VERBS = {
    KeyAction.RETRY: ("retried", "would retry"),
    KeyAction.SKIP: ("skipped", "would skip"),
    KeyAction.RELEASE: ("released", "would release"),
}


def render_outcome(outcome: KeyOutcome, out: TextIO, *, actor: str) -> None:
    done, would = _VERBS[outcome.action]
    head = f"its head {outcome.event_id}"
    if outcome.head_state is not HeadState.PENDING:
        what = f"{head} is {outcome.head_state.value} already: the key goes on from its next row"
    elif outcome.action is KeyAction.RETRY:
        what = (
            f"{head} has its attempts back ({outcome.attempts_before} -> "
            f"{outcome.attempts_after}) and is the next row of the key the relays take"
        )
    elif outcome.action is KeyAction.SKIP:
        what = (
            f"{head} is dead-lettered ({outcome.reason}) and the key goes on from its next row "
            f"(`relayd dlq show {outcome.event_id}`)"
        )
    else:
        what = (
            f"{head} is tried again with its {outcome.attempts_before} attempts: "
            "one more failure parks the key again"
        )
    line = f"key {outcome.key} (route {outcome.route or '-'}): {what}"
    if outcome.dry_run:
        line = f"dry run, nothing changed: {would} {line}"
    else:
        line = f"{done} {line}; audit #{outcome.audit_id} by {actor}"
    out.write(printable(line) + "\n")


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd keys list|retry|skip|release`, beside their handlers."""
    keys = commands.add_parser(
        "keys",
        parents=[common],
        help="parked keys of ordered delivery: list them, retry, skip or release one",
    )
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    keys_list = keys_commands.add_parser(
        "list", parents=[common], help="the parked keys, parked longest first"
    )
    keys_list.add_argument(
        "--parked",
        action="store_true",
        help="parked keys only (the default and only listing: keys whose rows flow need no one)",
    )
    keys_list.add_argument(
        "--route", metavar="TYPE", help="the keys parked by heads of this event type"
    )
    keys_list.add_argument("--limit", metavar="N", help="at most N keys (50)")
    keys_list.add_argument("--json", action="store_true", help="machine-readable output")
    keys_list.set_defaults(handler=list_command)

    acting = argparse.ArgumentParser(add_help=False)
    acting.add_argument("key", metavar="KEY", help="the parked key, as its rows carry it")
    acting.add_argument("--dry-run", action="store_true", help="change nothing; say what would")
    acting.add_argument("--actor", metavar="NAME", help="who acts, for the audit (the OS user)")
    acting.add_argument("--json", action="store_true", help="machine-readable output")
    for name, handler, summary, reason in (
        (
            "retry",
            retry_command,
            "give the head its attempts back and un-park the key",
            "why (optional; audited)",
        ),
        (
            "skip",
            skip_command,
            "dead-letter the head and un-park the key: its next row becomes its head",
            "why (required; audited)",
        ),
        (
            "release",
            release_command,
            "un-park the key; the head keeps its attempts (one more failure parks it again)",
            "why (optional; audited)",
        ),
    ):
        verb = keys_commands.add_parser(name, parents=[common, acting], help=summary)
        verb.add_argument("--reason", metavar="TEXT", help=reason)
        verb.set_defaults(handler=handler)
