"""`relayd held`: the pending rows a pause holds (the claim skips them), listed, and discarded
where an operator decides they will never be sent.

The poison-storm guard pauses a queue and type whose rows the sink rejects; those rows stay
pending, so `relayd dlq` cannot reach them. If the sink was right (a producer's bad release),
`relayd held discard` takes them out: each is dead-lettered and discarded at once
(`dead_reason` held_discarded, the operator's reason), kept in the table (C7), in bounded
batches with one audit row, like `relayd dlq discard`; `relayd dlq retry ID` brings one back.
If the sink was wrong, fix it and `relayd resume`: the rows flow again.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from relayd.core.errors import EXIT_FAILURE, EXIT_OK
from relayd.operator.command import (
    BadInput,
    check_text,
    command_store,
    operator_command,
    parse_count,
    parse_ids,
    resolve_actor,
)
from relayd.operator.dlq_actions import DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE, ActionSummary
from relayd.operator.dlq_output import Progress, write_summary
from relayd.operator.pause import queue_arg, type_arg
from relayd.operator.render import columns, iso
from relayd.settings import load_settings
from relayd.store.records import AuditEntry, DlqAction, HeldFilter, HeldPage, HeldRow

if TYPE_CHECKING:
    from relayd.operator.command import Commands
    from relayd.store import Store

DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 10_000
_MAX_TEXT_CHARS = 1000


def _filters(args: argparse.Namespace) -> HeldFilter:
    return HeldFilter(
        queue=None if args.queue is None else queue_arg(args.queue),
        type=None if args.type is None else type_arg(args.type),
        error_contains=None
        if args.error_contains is None
        else check_text(args.error_contains, "--error-contains", _MAX_TEXT_CHARS),
    )


@operator_command("held list")
def list_command(args: argparse.Namespace) -> int:
    """`relayd held list [--queue Q] [--type T] [--error-contains TEXT]`: held rows, in the
    order the claim would take them once resumed."""
    filters = _filters(args)
    limit = parse_count(args.limit, "--limit", DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
    settings = load_settings(args.config, sink_files=False)

    async def fetch() -> list[HeldRow]:
        async with command_store(settings) as store:
            return await store.held_rows(filters, limit=limit)

    rows = asyncio.run(fetch())
    if args.json:
        sys.stdout.write(json.dumps({"held": [_row_json(row) for row in rows]}) + "\n")
    else:
        _render_list(rows, sys.stdout, limit=limit)
    return EXIT_OK


@operator_command("held discard")
def discard_command(args: argparse.Namespace) -> int:
    """`relayd held discard (ID... | --all) --reason TEXT [filters] [--dry-run]`."""
    if args.reason is None:
        raise BadInput("--reason: required: say why these rows will never be sent")
    reason = check_text(args.reason, "--reason", _MAX_TEXT_CHARS)
    filters = _filters(args)
    ids = parse_ids(args.ids)
    if ids and args.all:
        raise BadInput("give IDs or --all, not both")
    if ids and _filters_json(filters):
        raise BadInput("filters select rows for --all only; with IDs, name every row")
    if not ids and not args.all:
        raise BadInput("name the held rows: IDs, or --all (narrowed by filters)")
    batch_size = parse_count(args.batch_size, "--batch-size", DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE)
    selection: dict[str, Any] = (
        {"named_ids": len(ids)} if ids else {"all": True, "held": True} | _filters_json(filters)
    )
    audit = AuditEntry(
        actor=resolve_actor(args.actor),
        action=DlqAction.DISCARD_HELD.value,
        filters=selection,
        reason=reason,
        keep_all_ids=bool(ids),
    )
    settings = load_settings(args.config, sink_files=False)
    progress = Progress("held discard", sys.stderr) if sys.stderr.isatty() else None
    summary = ActionSummary(DlqAction.DISCARD_HELD, args.dry_run, selection)

    async def run() -> None:
        async with command_store(settings) as store:
            await discard(
                store,
                ids or filters,
                summary,
                audit=audit,
                batch_size=batch_size,
                dry_run=args.dry_run,
                on_batch=progress,
            )

    try:
        asyncio.run(run())
    finally:
        if progress is not None:
            progress.done()
    write_summary(summary, sys.stdout, actor=audit.actor, as_json=args.json)
    return EXIT_FAILURE if ids and summary.skipped else EXIT_OK


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd held list` and `relayd held discard`, beside their handlers."""
    held_parser = commands.add_parser(
        "held",
        parents=[common],
        help="pending rows a pause holds (the poison-storm guard's): list, or discard them",
    )
    held_filters = argparse.ArgumentParser(add_help=False)
    held_filters.add_argument("--queue", help="the effective queue")
    held_filters.add_argument("--type", help="the job's type")
    held_filters.add_argument(
        "--error-contains", metavar="TEXT", help="last_error contains TEXT (any case)"
    )
    held_commands = held_parser.add_subparsers(
        dest="held_command", required=True, metavar="COMMAND"
    )
    held_list = held_commands.add_parser(
        "list", parents=[common, held_filters], help="held rows, in claim order"
    )
    held_list.add_argument("--limit", metavar="N", help="at most N rows (50)")
    held_list.add_argument("--json", action="store_true", help="machine-readable output")
    held_list.set_defaults(handler=list_command)
    held_discard = held_commands.add_parser(
        "discard",
        parents=[common, held_filters],
        help="dead-letter and discard held rows that must never be sent (kept, audited)",
    )
    held_discard.add_argument("ids", nargs="*", metavar="ID", help="the held rows, by event_id")
    held_discard.add_argument("--all", action="store_true", help="every held row the filters match")
    held_discard.add_argument("--reason", metavar="TEXT", help="why (required; audited)")
    held_discard.add_argument(
        "--dry-run", action="store_true", help="change nothing; say what would"
    )
    held_discard.add_argument("--batch-size", metavar="N", help="rows per transaction (500)")
    held_discard.add_argument(
        "--actor", metavar="NAME", help="who acts, for the audit (the OS user)"
    )
    held_discard.add_argument("--json", action="store_true", help="machine-readable output")
    held_discard.set_defaults(handler=discard_command)


async def discard(  # noqa: PLR0913 - the action's parts, each named at the one call
    store: Store,
    target: Sequence[str] | HeldFilter,
    summary: ActionSummary,
    *,
    audit: AuditEntry,
    batch_size: int,
    dry_run: bool,
    on_batch: Callable[[ActionSummary], None] | None = None,
) -> None:
    """Discard the named held rows, or every held row `target` selects, `batch_size` rows per
    transaction, each batch committed (a dry run: rolled back) with its share of the audit
    row. A row that is not held, or still in flight, is skipped and reported."""

    async def one_batch(page: HeldPage | list[str]) -> tuple[int, tuple[Any, str] | None]:
        batch = await store.discard_held(
            page, audit=audit, audit_id=summary.audit_id, dry_run=dry_run
        )
        summary.add(batch.results, batch.audit_id, examined=batch.examined)
        if on_batch is not None:
            on_batch(summary)
        return batch.examined, batch.next_after

    if not isinstance(target, HeldFilter):
        for start in range(0, len(target), batch_size):
            await one_batch(list(target[start : start + batch_size]))
        return
    page = HeldPage(target, limit=batch_size)
    while True:
        examined, after = await one_batch(page)
        if examined < batch_size or after is None:
            return
        page = dataclasses.replace(page, after=after)


def _render_list(rows: Sequence[HeldRow], out: TextIO, *, limit: int) -> None:
    if not rows:
        out.write("no held rows match\n")
        return
    table = [["EVENT_ID", "QUEUE", "TYPE", "ATTEMPTS", "STATE", "LAST_ERROR"]]
    for row in rows:
        table.append(
            [
                row.event_id,
                row.queue or "-",
                row.type or "-",
                str(row.attempts),
                "in flight" if row.in_flight else "held",
                row.last_error or "-",  # whole: the last column, its cause at its end
            ]
        )
    for line in columns(table):
        out.write(line + "\n")
    more = "; there may be more: raise --limit or narrow the filters" if len(rows) == limit else ""
    noun = "held row" if len(rows) == 1 else "held rows"
    out.write(f"{len(rows)} {noun}, in claim order{more}\n")


def _filters_json(filters: HeldFilter) -> dict[str, Any]:
    """The set filters, for the audit trail and `--json` output."""
    return {
        name: value
        for name in ("queue", "type", "error_contains")
        if (value := getattr(filters, name)) is not None
    }


def _row_json(row: HeldRow) -> dict[str, Any]:
    return {
        "event_id": row.event_id,
        "queue": row.queue,
        "type": row.type,
        "attempts": row.attempts,
        "in_flight": row.in_flight,
        "last_error": row.last_error,
        "created_at": iso(row.created_at),
        "available_at": iso(row.available_at),
        "last_attempt_at": iso(row.last_attempt_at),
    }
