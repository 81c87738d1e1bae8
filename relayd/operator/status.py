"""`relayd status` (the command and `GET /v1/status`): the backlog, dead letters, pauses, the
parked keys and the relays running now, built from one bounded read of the database in one
snapshot.

The counting rules are the backlog's (relayd/core/backlog.py). This module owns the report's two
renderings: the JSON shape scripts rely on (docs/observe.md) and the human table. The SQL
is in `relayd/store/sql/sampling.sql`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from relayd.core.backlog import BACKLOG_BOUND, Backlog
from relayd.core.errors import EXIT_OK
from relayd.operator.command import Needs, command_store
from relayd.operator.pause import pause_json
from relayd.operator.render import age, columns, iso, printable, stamp
from relayd.settings import load_settings
from relayd.store.records import Pause

if TYPE_CHECKING:
    from relayd.operator.command import Commands
    from relayd.store import Store

# How many queues and types `relayd status` lists.
TOP_N = 10
# How many of the keys parked longest it lists (`relayd keys list` shows every one).
PARKED_N = 5
# A relay whose heartbeat is older than this many sample intervals is marked stale.
STALE_INTERVALS = 3


# --- the command --------------------------------------------------------------------------


def status_command(args: argparse.Namespace) -> int:
    """`relayd status [--json]`: read-only, from one snapshot."""
    settings = load_settings(args.config, sink_files=False)

    async def read() -> StatusReport:
        async with command_store(settings, needs=Needs.CURRENT) as store:
            return await build_report(
                store,
                sample_interval_s=settings.metrics.sample_interval_s,
                lease_s=settings.relay.lease_s,
            )

    report = asyncio.run(read())
    if args.json:
        sys.stdout.write(json.dumps(report_json(report), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(report))
    return EXIT_OK


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd status`, beside its handler."""
    status = commands.add_parser(
        "status",
        parents=[common],
        help="show the backlog, dead letters, pauses, parked keys and the relays running now "
        "(read-only)",
    )
    status.add_argument(
        "--json", action="store_true", help="print JSON (the shape in docs/observe.md)"
    )
    status.set_defaults(handler=status_command)


# --- the report ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Count:
    name: str
    rows: int


@dataclass(frozen=True, slots=True)
class HeldByPause:
    """A pause, and how many of the first due rows (in claim order) it holds: the rows the
    backlog counts as paused."""

    pause: Pause
    rows: int


@dataclass(frozen=True, slots=True)
class Instance:
    """A relay's heartbeat row (relayd_instances)."""

    instance_id: str
    host: str
    pid: int
    version: str
    started_at: datetime
    last_seen: datetime
    last_seen_age_s: float
    breaker_state: str
    in_flight: int
    stale: bool
    housekeeping: Mapping[str, Mapping[str, Any]]  # failing chores: error, since
    # Why its breaker is not closed, in the sink's words (None: closed).
    breaker_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Parked:
    """A parked key, as `relayd status` lists the oldest few."""

    key: str
    route: str
    reason: str
    parked_at: datetime
    age_s: float


@dataclass(frozen=True, slots=True)
class StatusReport:
    """Everything `relayd status` shows, read in one database snapshot."""

    outbox: str
    backlog: Backlog
    dead_by_reason: list[Count]
    dead_counted: int  # the dead letters `dead_by_reason` covers (the oldest, up to the bound)
    top_queues: list[Count]
    top_types: list[Count]
    top_counted: int  # the pending rows the top lists cover (the first, in claim order)
    pauses: list[HeldByPause]
    instances: list[Instance]
    stale_after_s: float
    parked: list[Parked] = field(default_factory=list)  # the keys parked longest, a few


async def build_report(  # noqa: PLR0913 - keyword-only bounds, tests make them small
    store: Store,
    *,
    sample_interval_s: float,
    lease_s: float,
    bound: int = BACKLOG_BOUND,
    top: int = TOP_N,
    parked: int = PARKED_N,
) -> StatusReport:
    """Read the report; relays silent for more than `STALE_INTERVALS` sample intervals (of
    this reader's configuration) are marked stale. `lease_s` is relay.lease_s."""
    rows = await store.status_rows(bound, top, lease_s, parked)
    stale_after_s = round(STALE_INTERVALS * sample_interval_s, 3)
    tops: dict[str, list[Count]] = {"queue": [], "type": []}
    top_counted = 0
    for row in rows["backlog_top"]:
        tops[row["kind"]].append(Count(row["name"], int(row["rows"])))
        top_counted = int(row["sampled_rows"])
    dead_by_reason = [Count(r["reason"], int(r["rows"])) for r in rows["dead_by_reason"]]
    return StatusReport(
        outbox=str(store.table),
        backlog=Backlog.from_sample(rows["backlog_sample"][0], bound),
        dead_by_reason=dead_by_reason,
        dead_counted=sum(count.rows for count in dead_by_reason),
        top_queues=tops["queue"],
        top_types=tops["type"],
        top_counted=top_counted,
        pauses=_held_by_pause(rows["pauses_list"], rows["pauses_held"]),
        instances=[
            Instance(
                instance_id=r["instance_id"],
                host=r["host"],
                pid=r["pid"],
                version=r["version"],
                started_at=r["started_at"],
                last_seen=r["last_seen"],
                last_seen_age_s=max(r["last_seen_age_s"], 0.0),
                breaker_state=r["breaker_state"],
                in_flight=r["in_flight"],
                stale=r["last_seen_age_s"] > stale_after_s,
                housekeeping=_housekeeping(r["housekeeping"]),
                breaker_reason=r["breaker_reason"],
            )
            for r in rows["instances_list"]
        ],
        stale_after_s=stale_after_s,
        parked=[
            Parked(r["ordering_key"], r["type"], r["reason"], r["parked_at"], max(r["age_s"], 0.0))
            for r in rows["parked_keys_oldest"]
        ],
    )


def _held_by_pause(
    pauses: Sequence[Mapping[str, Any]], held: Sequence[Mapping[str, Any]]
) -> list[HeldByPause]:
    rows = {(r["queue"], r["type"]): int(r["rows"]) for r in held}
    return [
        HeldByPause(
            Pause(r["queue"], r["type"], r["reason"], r["paused_by"], r["paused_at"]),
            rows.get((r["queue"], r["type"]), 0),
        )
        for r in pauses
    ]


def _housekeeping(text: str | None) -> Mapping[str, Mapping[str, Any]]:
    """The heartbeat's housekeeping column; anything but an object of objects reads as {}
    (a report must not fail on a row another version of relayd wrote)."""
    try:
        data = json.loads(text or "{}")
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)}


# --- JSON: the shape scripts rely on (docs/observe.md#relayd-status) ------------------


def report_json(report: StatusReport) -> dict[str, Any]:
    """The report as JSON-ready data. Times are ISO 8601 with a UTC offset; an age is null
    when there is no such row, or when it is infinite (a time parked at -infinity)."""
    backlog = report.backlog
    return {
        "outbox": report.outbox,
        "at": iso(backlog.at),
        "backlog": {
            "rows": {
                "ready": backlog.ready,
                "paused": backlog.paused,
                "scheduled": backlog.scheduled,
                "leased": backlog.leased,
                "dead": backlog.dead,
            },
            "estimated": sorted(backlog.estimated),
            "counted_up_to": backlog.bound,
            "oldest_claimable_age_s": _finite(backlog.oldest_claimable_age_s),
            "oldest_pending_age_s": _finite(backlog.oldest_pending_age_s),
        },
        "dead_letters": {
            "by_reason": [{"reason": c.name, "rows": c.rows} for c in report.dead_by_reason],
            "counted": report.dead_counted,
        },
        "top": {
            "counted": report.top_counted,
            "queues": [{"name": c.name, "rows": c.rows} for c in report.top_queues],
            "types": [{"name": c.name, "rows": c.rows} for c in report.top_types],
        },
        "paused": backlog.any_pause,
        "pauses": [pause_json(held.pause) | {"held_rows": held.rows} for held in report.pauses],
        "instances": [
            {
                "instance_id": i.instance_id,
                "host": i.host,
                "pid": i.pid,
                "version": i.version,
                "started_at": iso(i.started_at),
                "last_seen": iso(i.last_seen),
                "last_seen_age_s": round(i.last_seen_age_s, 3),
                "stale": i.stale,
                "breaker_state": i.breaker_state,
                "breaker_reason": i.breaker_reason,
                "in_flight": i.in_flight,
                "housekeeping": dict(i.housekeeping),
            }
            for i in report.instances
        ],
        "stale_after_s": report.stale_after_s,
        "parked_keys": {
            "count": backlog.parked,
            "by_route": [
                {"route": route, "keys": keys}
                for route, keys in sorted(backlog.parked_keys.items())
            ],
            "oldest_age_s": _finite(backlog.oldest_parked_age_s),
            "oldest": [
                {
                    "key": p.key,
                    "route": p.route,
                    "reason": p.reason,
                    "parked_at": iso(p.parked_at),
                    "age_s": round(p.age_s, 3),
                }
                for p in report.parked
            ],
        },
    }


def _finite(value: float | None) -> float | None:
    # A negative age (a time ahead of the database's clock, even +infinity) is 0, as in
    # the gauges; an infinite one (a time parked at -infinity) has no JSON number.
    if value is None or math.isnan(value):
        return None
    value = max(value, 0.0)
    return round(value, 3) if math.isfinite(value) else None


# --- the human table ------------------------------------------------------------------------

_STATE_NOTES = {
    "ready": "claimable now",
    "paused": "due, held by a pause",
    "scheduled": "waiting out a backoff",
    "leased": "claimed, in flight",
    "dead": "dead-lettered, not discarded",
}


def render_text(report: StatusReport) -> str:
    """The report for a terminal."""
    backlog = report.backlog
    lines = [f"{report.outbox} at {stamp(backlog.at)}", "", "Backlog"]
    counts = {
        "ready": backlog.ready,
        "paused": backlog.paused,
        "scheduled": backlog.scheduled,
        "leased": backlog.leased,
        "dead": backlog.dead,
    }
    state_rows = [
        [state, ("~" if state in backlog.estimated else "") + f"{rows:,}", _STATE_NOTES[state]]
        for state, rows in counts.items()
    ]
    state_rows.append(
        ["oldest claimable", age(backlog.oldest_claimable_age_s), "since its available_at"]
    )
    state_rows.append(["oldest pending", age(backlog.oldest_pending_age_s), "since its created_at"])
    lines += columns(state_rows, indent="  ", right=(1,))
    lines.append(
        f"  (each state counted exactly up to {backlog.bound:,} rows"
        + ("; ~ is PostgreSQL's estimate)" if backlog.estimated else ")")
    )

    lines += ["", "Dead letters by reason" + _over(report.dead_counted, backlog, "oldest")]
    lines += _counts(report.dead_by_reason)
    lines += [
        "",
        f"Top queues, over the first {report.top_counted:,} pending rows in claim order"
        + (" (the bound)" if report.top_counted >= backlog.bound else ""),
    ]
    lines += _counts(report.top_queues)
    lines += ["Top types, over the same rows"]
    lines += _counts(report.top_types)

    lines += ["", "Pauses" + ("" if report.pauses else ": none")]
    if report.pauses:
        pauses = sorted(report.pauses, key=lambda held: held.pause.paused_at)
        lines += columns(
            [
                ["queue", "type", "held", "reason", "by", "since"],
                *(
                    [
                        held.pause.queue,
                        held.pause.type,
                        f"{held.rows:,}",
                        held.pause.reason,
                        held.pause.paused_by,
                        stamp(held.pause.paused_at),
                    ]
                    for held in pauses
                ),
            ],
            indent="  ",
            right=(2,),
        )
        lines.append(
            f"  (held: due rows it holds among the first {backlog.bound:,} in claim order, "
            "counted as paused above; `relayd held list` shows them, and those in a backoff)"
        )

    lines += ["", *_parked_lines(report)]

    stale = f"stale: no heartbeat for more than {age(report.stale_after_s)}"
    lines += ["", f"Relays ({stale})" if report.instances else "Relays: none running"]
    if report.instances:
        header = ["instance", "host", "pid", "version", "started", "last seen", "breaker"]
        lines += columns(
            [
                [*header, "in flight", ""],
                *(
                    [
                        i.instance_id,
                        i.host,
                        str(i.pid),
                        i.version,
                        stamp(i.started_at),
                        f"{age(i.last_seen_age_s)} ago",
                        i.breaker_state,
                        str(i.in_flight),
                        "STALE" if i.stale else "",
                    ]
                    for i in report.instances
                ),
            ],
            indent="  ",
            right=(2, 7),
        )
        for i in report.instances:
            if i.breaker_reason is not None:
                lines.append(f"  {i.instance_id}: breaker {i.breaker_state}: {i.breaker_reason}")
            for chore, failure in sorted(i.housekeeping.items()):
                lines.append(
                    f"  {i.instance_id}: housekeeping {chore} failing since "
                    f"{failure.get('since', '?')}: {failure.get('error', '?')}"
                )
    return "\n".join(printable(line.rstrip()) for line in lines) + "\n"


def _parked_lines(report: StatusReport) -> list[str]:
    """The parked keys: how many, and the few parked longest."""
    count = report.backlog.parked
    if not count:
        return ["Parked keys: none"]
    noun = "key" if count == 1 else "keys"
    lines = [f"Parked keys: {count:,} ordered {noun} whose rows wait for an operator"]
    lines += columns(
        [
            ["key", "route", "parked for", "reason"],
            *([p.key, p.route, age(p.age_s), p.reason] for p in report.parked),
        ],
        indent="  ",
    )
    shown = "the one" if count == 1 else f"the {len(report.parked)} parked longest"
    lines.append(
        f"  ({shown}; `relayd keys list` shows every one with its head, "
        "`relayd keys retry|skip|release KEY` acts on one)"
    )
    return lines


def _over(counted: int, backlog: Backlog, which: str) -> str:
    if counted >= backlog.bound:
        return f", over the {which} {backlog.bound:,} (the bound)"
    return ""


def _counts(counts: Sequence[Count]) -> list[str]:
    if not counts:
        return ["  (none)"]
    return columns([[c.name, f"{c.rows:,}"] for c in counts], indent="  ", right=(1,))
