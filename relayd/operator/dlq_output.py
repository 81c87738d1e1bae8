"""What `relayd dlq` prints: the list table, one dead letter, an action's summary and its
progress line, and the JSON rows."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TextIO

from relayd.core import jsonvalue
from relayd.operator.dlq_actions import ActionSummary
from relayd.operator.render import columns, iso, printable, stamp
from relayd.store.records import DeadLetterRow, DlqAction

# Ids printed by name in a human summary; past that, counts only.
_IDS_SHOWN = 20
_CELL_CHARS = 32  # queue and type in the `dlq list` table


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
            stamp(row.dead_at),
            _cell(row.dead_reason, _CELL_CHARS),
            _cell(row.queue, _CELL_CHARS),
            _cell(row.type, _CELL_CHARS),
            str(row.attempts),
        ]
        if include_discarded:
            cells.append(stamp(row.discarded_at))
        # Whole, in the last column: the cause is often at the end of the text (at most
        # 512 bytes), and cutting it would leave only the status (--json has it too).
        cells.append(_clean(row.last_error) or "-")
        table.append(cells)
    for line in columns(table):
        out.write(line + "\n")
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
        ("created_at", stamp(row.created_at)),
        ("last_attempt_at", stamp(row.last_attempt_at)),
        ("dead_at", stamp(row.dead_at)),
        ("discarded_at", stamp(row.discarded_at)),
    ]
    if row.discarded_at is not None:
        fields.append(("discard_reason", _clean(row.discard_reason) or "-"))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        out.write(f"{name.ljust(width)}  {value}\n")
    out.write("envelope:\n")
    out.write("\n".join(printable(line) for line in pretty_job(row.job or "").splitlines()) + "\n")


def pretty_job(text: str) -> str:
    """The envelope indented; as stored if it cannot be read back (nesting beyond bounds,
    an integer too long for Python's JSON writer)."""
    try:
        return json.dumps(jsonvalue.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return text


def write_summary(summary: ActionSummary, out: TextIO, *, actor: str, as_json: bool) -> None:
    """An action's summary on `out`: its JSON for scripts, else the human lines."""
    if as_json:
        out.write(json.dumps(summary.as_json()) + "\n")
    else:
        render_summary(summary, out, actor=actor)


def render_summary(summary: ActionSummary, out: TextIO, *, actor: str) -> None:
    if summary.refused:
        _render_refusal(summary, out)
        return
    held = summary.action is DlqAction.DISCARD_HELD
    if summary.matched == 0:
        out.write(f"no {'held rows' if held else 'dead letters'} match: nothing to do\n")
        return
    verbs = _VERBS[summary.action]
    done, skip = (verbs[1], "would skip") if summary.dry_run else (verbs[0], "skipped")
    noun = ("held row" if held else "dead letter") + ("" if summary.changed == 1 else "s")
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
        out.write(printable(f"  {skip} {result.event_id}: {result.detail}") + "\n")
    if len(summary.skipped) > _IDS_SHOWN:
        more = len(summary.skipped) - _IDS_SHOWN
        out.write(f"  ... and {more} more (--json lists them all)\n")


def _render_refusal(summary: ActionSummary, out: TextIO) -> None:
    """A redrive refused whole: the rows of ordered keys it would deliver out of order."""
    total = summary.out_of_order_total
    if total == 1:
        rows = "1 dead letter belongs to an ordered key whose later rows were delivered while "
        rows += "it was dead: redriven, it would arrive after them"
    else:
        rows = f"{total} dead letters belong to ordered keys whose later rows were delivered "
        rows += "while they were dead: redriven, they would arrive after them"
    out.write(f"refused, nothing changed: {rows}\n")
    for row in summary.out_of_order:
        n = row.delivered_after
        later = "1 later row" if n == 1 else f"{n} later rows"
        out.write(
            printable(f"  {row.event_id} (key {row.key}): {later} of its key delivered") + "\n"
        )
    if total > len(summary.out_of_order):
        out.write(f"  ... and {total - len(summary.out_of_order)} more\n")
    out.write(
        "  --out-of-order redrives them all the same; or leave them dead (`relayd dlq discard`)\n"
    )


# Per action: the past tense, the dry run's conditional, and the label of the ids line.
_VERBS = {
    DlqAction.REDRIVE: ("redrove", "would redrive", "redriven"),
    DlqAction.DISCARD: ("discarded", "would discard", "discarded"),
    DlqAction.DISCARD_HELD: ("discarded", "would discard", "discarded"),
}


class Progress:
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


def row_json(row: DeadLetterRow, *, with_job: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {
        "event_id": row.event_id,
        "state": row.state,
        "dead_at": iso(row.dead_at),
        "dead_reason": row.dead_reason,
        "queue": row.queue,
        "type": row.type,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "created_at": iso(row.created_at),
        "last_attempt_at": iso(row.last_attempt_at),
        "discarded_at": iso(row.discarded_at),
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


def _clean(value: str | None) -> str | None:
    """Stored text, safe on a terminal (relayd/operator/render.py)."""
    return None if value is None else printable(value)


def _cell(value: str | None, most: int) -> str:
    text = _clean(value) or "-"
    return text if len(text) <= most else text[: most - 3] + "..."
