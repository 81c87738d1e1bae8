"""`relayd dlq`: inspect dead letters, redrive them or discard them, in bounded batches, with
one audit row per action.

A redriven row keeps its `last_attempt_at`. A dead row that was ever attempted may already be
on the sink (the answer to its last POST may have been lost), and a non-null
`last_attempt_at` is exactly what makes the relay's next claim reconcile it with a GET
before any POST (docs/contract.md#c2): it is created at most once, even on a sink that
silently overwrites a reused id. Discarded rows stay in the table (docs/contract.md#c7).

Bulk actions walk the dead-letter index in `(dead_at, event_id)` order with a keyset
cursor, one short transaction per batch (`Store.act_on_dead_letters`), and stop at the
rows dead-lettered before the command started: a redriven row that dies again at once is
not met again by the same walk.

A redriven row of an ordered key goes back to its place in the key (the claim takes it as
the key's head). If later rows of its key were delivered while it was dead, it would arrive
after them: `dlq retry` then refuses the whole command, changing nothing and naming those
rows, unless `--out-of-order` (relayd/operator/dlq_actions.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING

from relayd.core.errors import EXIT_FAILURE, EXIT_OK
from relayd.core.outcomes import DeadReason
from relayd.operator.command import (
    BadInput,
    Needs,
    check_text,
    command_store,
    fail,
    operator_command,
    parse_count,
    parse_ids,
    quote,
    resolve_actor,
)
from relayd.operator.dlq_actions import (
    DEFAULT_BATCH_SIZE,
    MAX_BATCH_SIZE,
    ActionSummary,
    DlqRequest,
    Selection,
    act,
    walk_end,
)
from relayd.operator.dlq_filters import filter_args, filter_options
from relayd.operator.dlq_output import (
    Progress,
    render_list,
    render_show,
    row_json,
    write_summary,
)
from relayd.operator.render import stamp
from relayd.settings import load_settings
from relayd.store.records import AuditEntry, DeadLetterRow, DlqAction, RowOutcome

if TYPE_CHECKING:
    from relayd.operator.command import Commands

DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 10_000
_MAX_REASON_CHARS = 1000
_DEAD_REASONS = frozenset(reason.value for reason in DeadReason)


@operator_command("dlq list")
def list_command(args: argparse.Namespace) -> int:
    """`relayd dlq list`: dead letters matching the filters, newest first."""
    if args.reason is not None:
        # `--reason` once filtered here; it is now only ever the note an action records,
        # which a listing has none of: an old script is told the new name, not "unknown".
        raise BadInput("--reason: dlq list records nothing; filter with --dead-reason REASON")
    wanted = filter_args(args)
    limit = parse_count(args.limit, "--limit", DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
    settings = load_settings(args.config, sink_files=False)

    async def fetch() -> list[DeadLetterRow]:
        async with command_store(settings) as store:
            filters = wanted.resolve(await store.operator_now())
            return await store.list_dead_letters(
                filters, limit=limit, include_discarded=args.include_discarded
            )

    rows = asyncio.run(fetch())
    out = sys.stdout
    if args.json:
        out.write(json.dumps({"dead_letters": [row_json(r) for r in rows]}) + "\n")
    else:
        render_list(rows, out, limit=limit, include_discarded=args.include_discarded)
    return EXIT_OK


@operator_command("dlq show")
def show_command(args: argparse.Namespace) -> int:
    """`relayd dlq show ID`: one dead letter, its envelope pretty-printed."""
    [event_id] = parse_ids([args.id])
    settings = load_settings(args.config, sink_files=False)

    async def fetch() -> DeadLetterRow | None:
        async with command_store(settings) as store:
            return await store.dead_letter(event_id)

    row = asyncio.run(fetch())
    if row is None:
        fail(f"dlq show: {event_id} is not a dead letter: no such row in {settings.outbox.table}")
        return EXIT_FAILURE
    if row.published_at is not None:
        fail(f"dlq show: {event_id} is not a dead letter: published at {stamp(row.published_at)}")
        return EXIT_FAILURE
    if row.dead_at is None:
        fail(f"dlq show: {event_id} is not a dead letter: it is pending")
        return EXIT_FAILURE
    if args.json:
        sys.stdout.write(json.dumps(row_json(row, with_job=True)) + "\n")
    else:
        render_show(row, sys.stdout)
    return EXIT_OK


@operator_command("dlq retry")
def retry_command(args: argparse.Namespace) -> int:
    """`relayd dlq retry (ID... | --all) [--reason TEXT] [filters] [--dry-run]`: redrive
    dead letters."""
    reason = None
    if args.reason is not None:
        reason = check_text(args.reason, "--reason", _MAX_REASON_CHARS)
        if reason in _DEAD_REASONS and args.dead_reason is None:
            # `--reason max_attempts` selected rows before it became a note: a script
            # written then would now redrive every dead letter. Refused, naming the filter.
            raise BadInput(
                f"--reason: {quote(reason)} names a dead reason, but --reason is the note "
                f"the retry records; to select those rows, use --dead-reason {reason}"
            )
    return _action_command(
        args, DlqAction.REDRIVE, "dlq retry", reason=reason, out_of_order=args.out_of_order
    )


@operator_command("dlq discard")
def discard_command(args: argparse.Namespace) -> int:
    """`relayd dlq discard (ID... | --all) --reason TEXT [filters] [--dry-run]`."""
    if args.reason is None:
        raise BadInput("--reason: required: say why these rows are discarded")
    reason = check_text(args.reason, "--reason", _MAX_REASON_CHARS)
    return _action_command(args, DlqAction.DISCARD, "dlq discard", reason=reason)


def _action_command(
    args: argparse.Namespace,
    action: DlqAction,
    name: str,
    *,
    reason: str | None,
    out_of_order: bool = False,
) -> int:
    wanted = filter_args(args)
    ids = parse_ids(args.ids)
    if ids and args.all:
        raise BadInput("give IDs or --all, not both")
    if ids and wanted.any:
        raise BadInput("filters select rows for --all only; with IDs, name every row")
    if not ids and not args.all:
        # A bare `relayd dlq retry` never acts on anything: bulk takes a deliberate --all.
        raise BadInput("name the dead letters: IDs, or --all (narrowed by filters)")
    batch_size = parse_count(args.batch_size, "--batch-size", DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE)
    audit = AuditEntry(
        actor=resolve_actor(args.actor),
        action=action.value,
        reason=reason,
        keep_all_ids=bool(ids),
    )
    settings = load_settings(args.config, sink_files=False)
    progress = Progress(name, sys.stderr) if sys.stderr.isatty() else None

    # A redrive reads ordered delivery's columns (migration 0011): a row of an ordered key
    # goes back to its place in the key, or is refused out of order.
    needs = Needs.ORDERED if action is DlqAction.REDRIVE else Needs.OPERATOR

    async def run() -> ActionSummary:
        async with command_store(settings, needs=needs) as store:
            now = await store.operator_now()
            filters = wanted.resolve(now)
            selection = Selection(ids or None, filters, walk_end(filters, now))
            request = DlqRequest(
                action,
                selection,
                audit,
                batch_size,
                dry_run=args.dry_run,
                out_of_order=out_of_order,
            )
            return await act(store, request, progress)

    try:
        summary = asyncio.run(run())
    finally:
        if progress is not None:
            progress.done()
    write_summary(summary, sys.stdout, actor=audit.actor, as_json=args.json)
    if summary.refused:
        total = summary.out_of_order_total
        rows = "1 dead letter" if total == 1 else f"{total} dead letters"
        fail(
            f"{name}: refused, nothing changed: {rows} of ordered keys would be delivered "
            "after later rows of their key; --out-of-order redrives them all the same"
        )
        return EXIT_FAILURE
    # Named rows are each an instruction: one not carried out is a failure (the others
    # were still acted on); one discarded already is where it was asked to be. With --all,
    # skipped rows are reported, not failed.
    failed = [r for r in summary.skipped if r.outcome is not RowOutcome.ALREADY_DISCARDED]
    return EXIT_FAILURE if ids and failed else EXIT_OK


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd dlq list|show|retry|discard`, beside their handlers."""
    filters = filter_options()
    acting = argparse.ArgumentParser(add_help=False)
    acting.add_argument("ids", nargs="*", metavar="ID", help="the dead letters, by event_id")
    acting.add_argument(
        "--all", action="store_true", help="every dead letter the filters match (not discarded)"
    )
    acting.add_argument("--dry-run", action="store_true", help="change nothing; say what would")
    acting.add_argument("--batch-size", metavar="N", help="rows per transaction (500)")
    acting.add_argument("--actor", metavar="NAME", help="who acts, for the audit (the OS user)")
    acting.add_argument("--json", action="store_true", help="machine-readable output")

    dlq = commands.add_parser(
        "dlq", parents=[common], help="inspect dead letters, redrive or discard them"
    )
    dlq_commands = dlq.add_subparsers(dest="dlq_command", required=True, metavar="COMMAND")
    dlq_list = dlq_commands.add_parser(
        "list", parents=[common, filters], help="dead letters, newest first"
    )
    dlq_list.add_argument("--reason", help=argparse.SUPPRESS)  # the old filter: said so
    dlq_list.add_argument("--limit", metavar="N", help="at most N rows (50)")
    dlq_list.add_argument(
        "--include-discarded", action="store_true", help="also rows discarded already"
    )
    dlq_list.add_argument("--json", action="store_true", help="machine-readable output")
    dlq_list.set_defaults(handler=list_command)
    dlq_show = dlq_commands.add_parser(
        "show", parents=[common], help="one dead letter with its envelope"
    )
    dlq_show.add_argument("id", metavar="ID", help="its event_id")
    dlq_show.add_argument("--json", action="store_true", help="machine-readable output")
    dlq_show.set_defaults(handler=show_command)
    dlq_retry = dlq_commands.add_parser(
        "retry",
        parents=[common, filters, acting],
        help="redrive dead letters: pending again, reconciled with a GET before any POST",
    )
    dlq_retry.add_argument(
        "--reason", metavar="TEXT", help="why (optional; audited, as every action's --reason)"
    )
    dlq_retry.add_argument(
        "--out-of-order",
        action="store_true",
        help="redrive rows of ordered keys even if later rows of their key were delivered",
    )
    dlq_retry.set_defaults(handler=retry_command)
    dlq_discard = dlq_commands.add_parser(
        "discard",
        parents=[common, filters, acting],
        help="mark dead letters as discarded (kept, out of the dead-letter queue)",
    )
    dlq_discard.add_argument("--reason", metavar="TEXT", help="why (required; audited)")
    dlq_discard.set_defaults(handler=discard_command)
