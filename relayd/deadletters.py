"""`relayd dlq`: inspect dead letters, redrive them or discard them, in bounded batches, with
one audit row per action; and what every operator command shares (the store, the actor,
one-line errors).

A redriven row keeps its `last_attempt_at`. A dead row that was ever attempted may already be
on the sink (the answer to its last POST may have been lost), and a non-null
`last_attempt_at` is exactly what makes the relay's next claim reconcile it with a GET
before any POST (docs/contract.md#c2): it is created at most once, even on a sink that
silently overwrites a reused id. Discarded rows stay in the table (docs/contract.md#c7).

Bulk actions walk the dead-letter index in `(dead_at, event_id)` order with a keyset
cursor, one short transaction per batch (`Store.act_on_dead_letters`), and stop at the
rows dead-lettered before the command started: a redriven row that dies again at once is
not met again by the same walk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import getpass
import json
import os
import re
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TextIO

from relayd import jsonvalue
from relayd.config import Settings, load_settings
from relayd.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, StatementError
from relayd.models import DeadReason
from relayd.operator_models import (
    AUDIT_MAX_IDS,
    AuditEntry,
    DeadLetterBatch,
    DeadLetterFilter,
    DeadLetterPage,
    DeadLetterRow,
    DlqAction,
    RowOutcome,
    RowResult,
)

if TYPE_CHECKING:
    import argparse

    from relayd.store import Store

Handler = Callable[["argparse.Namespace"], int]

# Rows per batch: one statement and one short transaction each.
DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 10_000
DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 10_000
# Ids printed by name in a human summary; past that, counts only.
_IDS_SHOWN = 20
_MAX_REASON_CHARS = 1000
_MAX_ACTOR_CHARS = 200
_MAX_FILTER_CHARS = 1000
_ERROR_CHARS = 60  # last_error in the `dlq list` table
_CELL_CHARS = 32  # queue and type in the `dlq list` table
_QUOTED_CHARS = 60  # an operator's input quoted in an error line

# --- what every operator command shares ---------------------------------------------------


class BadInput(ValueError):
    """An option or argument the command cannot use: one line on stderr, exit 2."""


def operator_command(name: str) -> Callable[[Handler], Handler]:
    """Turn a command's expected failures into one stderr line and its exit code: bad input
    2, a statement PostgreSQL refused (a missing grant, say) 1. Configuration,
    schema and connection failures are `relayd.cli.main`'s (2, 1 and 1)."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except BadInput as exc:
                fail(f"{name}: {exc}")
                return EXIT_USAGE
            except StatementError as exc:
                fail(f"{name}: the database refused the statement {exc}")
                return EXIT_FAILURE

        return run

    return decorate


def fail(message: str) -> None:
    sys.stderr.write(f"relayd: {message}\n")


@contextlib.asynccontextmanager
async def operator_store(settings: Settings) -> AsyncIterator[Store]:
    """A small pool on the outbox for one command; `SchemaError` unless migration 0003 ran."""
    from relayd.store import Store  # noqa: PLC0415 - asyncpg only for commands that use it

    store = await Store.connect(
        settings.dsn,
        settings.outbox.outbox_table,
        max_size=2,
        connect_timeout_s=settings.database.connect_timeout_s,
        statement_timeout_s=settings.database.statement_timeout_s,
    )
    try:
        await store.check_operator_schema()
        yield store
    finally:
        await store.close()


def resolve_actor(given: str | None) -> str:
    """Who acts, for the audit trail: `--actor NAME`, else the OS user."""
    if given is not None:
        return check_text(given, "--actor", _MAX_ACTOR_CHARS)
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (a bare container)
        return f"uid {os.getuid()}"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_text(value: str, option: str, most: int) -> str:
    """A free-text option: not blank, at most `most` characters, on one line."""
    text = value.strip()
    if not text:
        raise BadInput(f"{option}: must not be empty")
    if len(text) > most:
        raise BadInput(f"{option}: at most {most} characters, got {len(text)}")
    if _CONTROL.search(text):
        raise BadInput(f"{option}: must be one line without control characters")
    return text


def parse_count(value: str | None, option: str, default: int, most: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise BadInput(f"{option}: expected a whole number, got {_quote(value)}") from None
    if not 1 <= number <= most:
        raise BadInput(f"{option}: must be from 1 to {most}, got {number}")
    return number


def _quote(value: str) -> str:
    """An operator's input, quoted in an error line: bounded, controls escaped by repr."""
    return repr(value if len(value) <= _QUOTED_CHARS else value[: _QUOTED_CHARS - 3] + "...")


# --- times: one parser for --since and --until --------------------------------------------

_DURATION = re.compile(r"(\d+)([smhdw])")
_DURATIONS = re.compile(r"(?:\d+[smhdw])+")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_WHEN_HINT = (
    "expected an ISO 8601 time (2025-01-31, 2025-01-31T12:00:00Z, 2025-01-31T13:00+01:00) "
    "or a duration before now (30m, 2h, 7d, 1h30m)"
)


@dataclass(frozen=True, slots=True)
class When:
    """A `--since`/`--until` value: an absolute time, or a duration before the database's
    now (resolved once the command has asked the database for its clock)."""

    at: datetime | None = None
    ago: timedelta = timedelta(0)

    def resolve(self, now: datetime, option: str) -> datetime:
        if self.at is not None:
            return self.at
        try:
            return now - self.ago
        except OverflowError:
            raise BadInput(f"{option}: {self.ago.days} days ago is before year 1") from None


def parse_when(text: str, option: str) -> When:
    """`30m`, `2h`, `7d`, `1h30m` (before now), or an ISO 8601 time; a time without an
    offset is UTC. `BadInput` naming the option otherwise."""
    value = text.strip()
    if _DURATIONS.fullmatch(value):
        try:
            seconds = sum(int(n) * _UNIT_S[unit] for n, unit in _DURATION.findall(value))
            return When(ago=timedelta(seconds=seconds))
        except (OverflowError, ValueError):  # past timedelta's range, or int()'s digit limit
            raise BadInput(f"{option}: {_quote(text)} is too long ago") from None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{option}: {_WHEN_HINT}; got {_quote(text)}") from None
    return When(at=at if at.tzinfo is not None else at.replace(tzinfo=UTC))


# --- which dead letters -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FilterArgs:
    """The filter options as given, checked but not yet resolved against the clock."""

    queue: str | None = None
    type: str | None = None
    dead_reason: str | None = None
    since: When | None = None
    until: When | None = None
    error_contains: str | None = None

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def resolve(self, now: datetime) -> DeadLetterFilter:
        since = None if self.since is None else self.since.resolve(now, "--since")
        until = None if self.until is None else self.until.resolve(now, "--until")
        if since is not None and until is not None and since >= until:
            raise BadInput(
                f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})"
            )
        return DeadLetterFilter(
            queue=self.queue,
            type=self.type,
            dead_reason=self.dead_reason,
            since=since,
            until=until,
            error_contains=self.error_contains,
        )


def filter_args(args: argparse.Namespace, reason_option: str = "--reason") -> FilterArgs:
    """The filter options of `dlq list`, `dlq retry` and `dlq discard`, checked."""
    reason = args.dead_reason
    known = [r.value for r in DeadReason]
    if reason is not None and reason not in known:
        raise BadInput(
            f"{reason_option}: {_quote(reason)} is not a dead reason ({', '.join(known)})"
        )
    return FilterArgs(
        queue=_optional_text(args.queue, "--queue"),
        type=_optional_text(args.type, "--type"),
        dead_reason=reason,
        since=None if args.since is None else parse_when(args.since, "--since"),
        until=None if args.until is None else parse_when(args.until, "--until"),
        error_contains=_optional_text(args.error_contains, "--error-contains"),
    )


def _optional_text(value: str | None, option: str) -> str | None:
    return None if value is None else check_text(value, option, _MAX_FILTER_CHARS)


def parse_ids(values: Sequence[str]) -> list[str]:
    """Event ids as PostgreSQL prints them (lowercase), duplicates dropped, order kept."""
    ids: dict[str, None] = {}
    for value in values:
        try:
            ids[str(uuid.UUID(value.strip()))] = None
        except ValueError:
            raise BadInput(f"ID: not a UUID: {_quote(value)}") from None
    return list(ids)


# --- actions in bounded batches -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Selection:
    """The rows an action is for: the named `ids`, or every dead letter (not discarded)
    matching `filters` and dead-lettered before `until`."""

    ids: list[str] | None
    filters: DeadLetterFilter
    until: datetime

    def audit_filters(self) -> dict[str, Any]:
        if self.ids is not None:
            return {"named_ids": len(self.ids)}
        return {"all": True} | self.filters.as_json() | {"until": self.until.isoformat()}


@dataclass
class ActionSummary:
    """What an action did (or, dry, would do), batch after batch."""

    action: DlqAction
    dry_run: bool
    selection: dict[str, Any]
    counts: Counter[RowOutcome] = field(default_factory=Counter)
    changed_ids: list[str] = field(default_factory=list)  # the first AUDIT_MAX_IDS only
    skipped: list[RowResult] = field(default_factory=list)
    batches: int = 0
    audit_id: int | None = None

    @property
    def changed(self) -> int:
        return self.counts[RowOutcome.REDRIVEN] + self.counts[RowOutcome.DISCARDED]

    @property
    def matched(self) -> int:
        """Rows selected by the filters, or named."""
        return sum(self.counts.values())

    def add(self, results: Sequence[RowResult], audit_id: int | None, *, examined: int) -> None:
        if examined:  # the read that only finds the end of the index is no batch
            self.batches += 1
        self.audit_id = audit_id
        for result in results:
            self.counts[result.outcome] += 1
            if result.outcome.changed:
                if len(self.changed_ids) < AUDIT_MAX_IDS:
                    self.changed_ids.append(result.event_id)
            else:
                self.skipped.append(result)

    def as_json(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "dry_run": self.dry_run,
            "selection": self.selection,
            "matched": self.matched,
            "counts": {outcome.value: n for outcome, n in sorted(self.counts.items())},
            "changed_ids": self.changed_ids if self.changed <= AUDIT_MAX_IDS else None,
            "skipped": [
                {"event_id": r.event_id, "outcome": r.outcome.value, "reason": r.detail}
                for r in self.skipped
            ],
            "batches": self.batches,
            "audit_id": self.audit_id,
        }


@dataclass(frozen=True, slots=True)
class ActionPlan:
    """A dead-letter action to carry out: what, on which rows, audited as whom."""

    action: DlqAction
    selection: Selection
    audit: AuditEntry
    batch_size: int = DEFAULT_BATCH_SIZE
    dry_run: bool = False


async def act(
    store: Store, plan: ActionPlan, on_batch: Callable[[ActionSummary], None] | None = None
) -> ActionSummary:
    """Redrive or discard the selected dead letters, `plan.batch_size` rows per transaction.

    Each batch commits on its own (a dry run rolls each back) with its share of the audit
    row, so an interrupted action leaves every batch it finished done and audited. A row
    that cannot be acted on is skipped and reported, never failing its batch.
    """
    selection, size = plan.selection, plan.batch_size
    summary = ActionSummary(plan.action, plan.dry_run, selection.audit_filters())
    audit = dataclasses.replace(plan.audit, filters=summary.selection)

    async def one_batch(target: DeadLetterPage | list[str]) -> DeadLetterBatch:
        batch = await store.act_on_dead_letters(
            plan.action, target, audit=audit, audit_id=summary.audit_id, dry_run=plan.dry_run
        )
        summary.add(batch.results, batch.audit_id, examined=batch.examined)
        if on_batch is not None:
            on_batch(summary)
        return batch

    if selection.ids is not None:
        for start in range(0, len(selection.ids), size):
            await one_batch(selection.ids[start : start + size])
        return summary
    page = DeadLetterPage(selection.filters, until=selection.until, limit=size)
    while True:
        batch = await one_batch(page)
        after = batch.next_after
        if batch.examined < size or after is None or _beyond(after[0], selection.until):
            return summary  # the index is read up to the walk's end
        page = dataclasses.replace(page, after=after)


def _beyond(dead_at: datetime, until: datetime) -> bool:
    if dead_at.tzinfo is None:  # asyncpg reads PostgreSQL's infinities as naive extremes
        return dead_at == datetime.max
    return dead_at >= until


def walk_end(filters: DeadLetterFilter, now: datetime) -> datetime:
    """Where a bulk walk stops: `--until`, and never past the command's start."""
    return now if filters.until is None else min(filters.until, now)


# --- the commands -------------------------------------------------------------------------


@operator_command("dlq list")
def list_command(args: argparse.Namespace) -> int:
    """`relayd dlq list`: dead letters matching the filters, newest first."""
    wanted = filter_args(args)
    limit = parse_count(args.limit, "--limit", DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
    settings = load_settings(args.config)

    async def fetch() -> list[DeadLetterRow]:
        async with operator_store(settings) as store:
            filters = wanted.resolve(await store.operator_now())
            return await store.list_dead_letters(
                filters, limit=limit, include_discarded=args.include_discarded
            )

    rows = asyncio.run(fetch())
    out = sys.stdout
    if args.json:
        out.write(json.dumps({"dead_letters": [_row_json(r) for r in rows]}) + "\n")
    else:
        render_list(rows, out, limit=limit, include_discarded=args.include_discarded)
    return EXIT_OK


@operator_command("dlq show")
def show_command(args: argparse.Namespace) -> int:
    """`relayd dlq show ID`: one dead letter, its envelope pretty-printed."""
    [event_id] = parse_ids([args.id])
    settings = load_settings(args.config)

    async def fetch() -> DeadLetterRow | None:
        async with operator_store(settings) as store:
            return await store.dead_letter(event_id)

    row = asyncio.run(fetch())
    if row is None:
        fail(f"dlq show: {event_id} is not a dead letter: no such row in {settings.outbox.table}")
        return EXIT_FAILURE
    if row.published_at is not None:
        fail(f"dlq show: {event_id} is not a dead letter: published at {_iso(row.published_at)}")
        return EXIT_FAILURE
    if row.dead_at is None:
        fail(f"dlq show: {event_id} is not a dead letter: it is pending")
        return EXIT_FAILURE
    if args.json:
        sys.stdout.write(json.dumps(_row_json(row, with_job=True)) + "\n")
    else:
        render_show(row, sys.stdout)
    return EXIT_OK


@operator_command("dlq retry")
def retry_command(args: argparse.Namespace) -> int:
    """`relayd dlq retry (ID... | --all) [filters] [--dry-run]`: redrive dead letters."""
    return _action_command(args, DlqAction.REDRIVE, "dlq retry", reason=None)


@operator_command("dlq discard")
def discard_command(args: argparse.Namespace) -> int:
    """`relayd dlq discard (ID... | --all) --reason TEXT [filters] [--dry-run]`."""
    if args.discard_reason is None:
        raise BadInput("--reason: required: say why these rows are discarded")
    reason = check_text(args.discard_reason, "--reason", _MAX_REASON_CHARS)
    return _action_command(args, DlqAction.DISCARD, "dlq discard", reason=reason)


def _action_command(
    args: argparse.Namespace, action: DlqAction, name: str, *, reason: str | None
) -> int:
    # `dlq discard --reason` is the discard's own reason; there the filter is --dead-reason.
    wanted = filter_args(args, "--reason" if reason is None else "--dead-reason")
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
    settings = load_settings(args.config)
    progress = _Progress(name, sys.stderr) if sys.stderr.isatty() else None

    async def run() -> ActionSummary:
        async with operator_store(settings) as store:
            now = await store.operator_now()
            filters = wanted.resolve(now)
            selection = Selection(ids or None, filters, walk_end(filters, now))
            plan = ActionPlan(action, selection, audit, batch_size, dry_run=args.dry_run)
            return await act(store, plan, progress)

    try:
        summary = asyncio.run(run())
    finally:
        if progress is not None:
            progress.done()
    if args.json:
        sys.stdout.write(json.dumps(summary.as_json()) + "\n")
    else:
        render_summary(summary, sys.stdout, actor=audit.actor)
    # Named rows are each an instruction: one not carried out is a failure (the others
    # were still acted on); one discarded already is where it was asked to be. With --all,
    # skipped rows are reported, not failed.
    failed = [r for r in summary.skipped if r.outcome is not RowOutcome.ALREADY_DISCARDED]
    return EXIT_FAILURE if ids and failed else EXIT_OK


class _Progress:
    """One self-overwriting line on a terminal while a long action runs."""

    def __init__(self, name: str, out: TextIO) -> None:
        self._name = name
        self._out = out
        self._shown = False

    def __call__(self, summary: ActionSummary) -> None:
        self._shown = True
        verbs = _VERBS[summary.action]
        done, skip = (verbs[1], "would skip") if summary.dry_run else (verbs[2], "skipped")
        self._out.write(
            f"\r{self._name}: batch {summary.batches}, {summary.matched:,} matched: "
            f"{done} {summary.changed:,}, {skip} {len(summary.skipped):,}"
        )
        self._out.flush()

    def done(self) -> None:
        if self._shown:
            self._out.write("\n")


# --- output -------------------------------------------------------------------------------


def render_list(
    rows: Sequence[DeadLetterRow], out: TextIO, *, limit: int, include_discarded: bool
) -> None:
    if not rows:
        out.write("no dead letters match\n")
        return
    header = ["EVENT_ID", "DEAD_AT", "REASON", "QUEUE", "TYPE", "ATTEMPTS"]
    if include_discarded:
        header.append("DISCARDED_AT")
    header.append("LAST_ERROR")
    table = [header]
    for row in rows:
        cells = [
            row.event_id,
            _short_time(row.dead_at),
            _cell(row.dead_reason, _CELL_CHARS),
            _cell(row.queue, _CELL_CHARS),
            _cell(row.type, _CELL_CHARS),
            str(row.attempts),
        ]
        if include_discarded:
            cells.append(_short_time(row.discarded_at))
        cells.append(_cell(row.last_error, _ERROR_CHARS))
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    for line in table:
        padded = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        out.write("  ".join([*padded, line[-1]]).rstrip() + "\n")
    more = "; there may be more: raise --limit or narrow the filters" if len(rows) == limit else ""
    noun = "dead letter" if len(rows) == 1 else "dead letters"
    out.write(f"{len(rows)} {noun}, newest first{more}\n")


def render_show(row: DeadLetterRow, out: TextIO) -> None:
    fields: list[tuple[str, str]] = [
        ("event_id", row.event_id),
        ("state", "dead letter, discarded" if row.discarded_at else "dead letter"),
        ("dead_reason", row.dead_reason or "-"),
        ("last_error", _clean(row.last_error) or "-"),
        ("attempts", str(row.attempts)),
        ("queue", _clean(row.queue) or "-"),
        ("type", _clean(row.type) or "-"),
        ("created_at", _iso(row.created_at)),
        ("last_attempt_at", _iso(row.last_attempt_at)),
        ("dead_at", _iso(row.dead_at)),
        ("discarded_at", _iso(row.discarded_at)),
    ]
    if row.discarded_at is not None:
        fields.append(("discard_reason", _clean(row.discard_reason) or "-"))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        out.write(f"{name.ljust(width)}  {value}\n")
    out.write("envelope:\n")
    out.write(pretty_job(row.job or "") + "\n")


def pretty_job(text: str) -> str:
    """The envelope indented; as stored if it cannot be read back (nesting beyond bounds,
    an integer too long for Python's JSON writer)."""
    try:
        return json.dumps(jsonvalue.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return text


def render_summary(summary: ActionSummary, out: TextIO, *, actor: str) -> None:
    if summary.matched == 0:
        out.write("no dead letters match: nothing to do\n")
        return
    verbs = _VERBS[summary.action]
    done, skip = (verbs[1], "would skip") if summary.dry_run else (verbs[0], "skipped")
    noun = "dead letter" if summary.changed == 1 else "dead letters"
    batches = "1 batch" if summary.batches == 1 else f"{summary.batches} batches"
    head = f"{done} {summary.changed} {noun} in {batches}"
    if summary.skipped:
        head += f", {skip} {len(summary.skipped)}"
    if summary.dry_run:
        head = f"dry run, nothing changed: {head}"
    elif summary.audit_id is not None:
        head += f"; audit #{summary.audit_id} by {actor}"
    out.write(head + "\n")
    if 0 < summary.changed <= _IDS_SHOWN:
        label = verbs[1] if summary.dry_run else verbs[2]
        out.write(f"  {label}: {', '.join(summary.changed_ids)}\n")
    for result in summary.skipped[:_IDS_SHOWN]:
        out.write(f"  {skip} {result.event_id}: {result.detail}\n")
    if len(summary.skipped) > _IDS_SHOWN:
        more = len(summary.skipped) - _IDS_SHOWN
        out.write(f"  ... and {more} more (--json lists them all)\n")


# Per action: the past tense, the dry run's conditional, and the label of the ids line.
_VERBS = {
    DlqAction.REDRIVE: ("redrove", "would redrive", "redriven"),
    DlqAction.DISCARD: ("discarded", "would discard", "discarded"),
}


def _row_json(row: DeadLetterRow, *, with_job: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {
        "event_id": row.event_id,
        "state": row.state,
        "dead_at": _iso_or_none(row.dead_at),
        "dead_reason": row.dead_reason,
        "queue": row.queue,
        "type": row.type,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "created_at": _iso_or_none(row.created_at),
        "last_attempt_at": _iso_or_none(row.last_attempt_at),
        "discarded_at": _iso_or_none(row.discarded_at),
        "discard_reason": row.discard_reason,
    }
    if with_job:
        try:
            data["job"] = jsonvalue.loads(row.job or "")
            json.dumps(data["job"])  # an integer beyond Python's JSON writer: send the text
        except (ValueError, TypeError):
            data["job"] = None
            data["job_text"] = row.job
    return data


def _iso_or_none(value: datetime | None) -> str | None:
    return None if value is None else _iso(value)


def _iso(value: datetime | None) -> str:
    """A time as ISO 8601 in UTC; asyncpg reads PostgreSQL's infinities as naive extremes."""
    if value is None:
        return "-"
    if value.tzinfo is None:
        return "infinity" if value == datetime.max else "-infinity"
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _short_time(value: datetime | None) -> str:
    """A time for a table column: to the second, UTC."""
    if value is None or value.tzinfo is None:
        return _iso(value)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clean(value: str | None) -> str | None:
    """Stored text, safe on a terminal: control characters become spaces."""
    return None if value is None else _CONTROL.sub(" ", value)


def _cell(value: str | None, most: int) -> str:
    text = _clean(value) or "-"
    return text if len(text) <= most else text[: most - 3] + "..."
