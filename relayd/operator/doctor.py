"""`relayd doctor`: the outbox's health inside PostgreSQL, for an operator wondering why relayd
slowed down. Dead tuples and the last vacuum of the table, the sessions (and slots, standbys,
prepared transactions) holding back the xmin horizon — the usual cause: vacuum cannot remove
the rows relayd published, and every claim steps over them —, whether the claim still uses
its index, and the table's and indexes' sizes.

Each finding carries a verdict (`ok`, `warn`, `fail`), so `--json` can drive an alert; the CLI
exits 1 only for `fail` (the claim does not use its index).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from relayd.core.errors import EXIT_FAILURE, EXIT_OK
from relayd.operator.check import Verdict
from relayd.operator.command import Needs, command_store
from relayd.operator.render import age, iso, printable
from relayd.settings import load_settings

if TYPE_CHECKING:
    from relayd.operator.command import Commands
    from relayd.store import Store

# A transaction older than this holding the horizon is worth a warning: an outbox publishes
# and settles rows every second, and each leaves a dead tuple vacuum cannot remove meanwhile.
HORIZON_WARN_S = 60.0
# Dead tuples worth a warning: this many, and more than this share of the live ones.
DEAD_TUPLES_WARN = 10_000
DEAD_SHARE_WARN = 0.2
# A slot, standby or prepared transaction this many transactions behind is worth a warning.
SLOT_WARN_XIDS = 10_000
_HOLDERS_SHOWN = 10
_KIB = 1024


@dataclass(frozen=True, slots=True)
class Finding:
    verdict: Verdict
    topic: str
    detail: str


@dataclass
class Diagnosis:
    table: dict[str, Any] = field(default_factory=dict)
    indexes: list[dict[str, Any]] = field(default_factory=list)
    horizon: list[dict[str, Any]] = field(default_factory=list)
    claim_plan: Any = None  # EXPLAIN (FORMAT JSON)'s document
    findings: list[Finding] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(f.verdict is Verdict.FAIL for f in self.findings)

    def as_json(self) -> str:
        return json.dumps(
            {
                "table": self.table,
                "indexes": self.indexes,
                "horizon": self.horizon,
                "claim_plan": self.claim_plan,
                "findings": [
                    {"verdict": f.verdict.value, "topic": f.topic, "detail": f.detail}
                    for f in self.findings
                ],
            },
            indent=2,
            default=_json_default,
        )

    def render(self) -> str:
        lines = [f"{f.verdict.value:<8}{f.topic:<12}{f.detail}" for f in self.findings]
        if self.horizon:
            lines += ["", "sessions and slots holding back the xmin horizon, oldest first:"]
            lines += [
                f"  {h['kind']:<22}{h['name']:<32}xmin age {h['xmin_age_xids']:>10,} xids"
                + (f", transaction open {h['xact_age_s']:,.0f}s" if h.get("xact_age_s") else "")
                for h in self.horizon
            ]
        if self.indexes:
            lines += ["", "indexes:"]
            lines += [
                f"  {i['name']:<48}{_size(i['bytes']):>10}  scans {i['idx_scan']:,}"
                for i in self.indexes
            ]
        # Session names, hosts and slot names are other clients' text.
        return "\n".join(printable(line) for line in lines)


def doctor_command(args: argparse.Namespace) -> int:
    """`relayd doctor [--json]`: exit 1 only for a `fail` finding."""
    settings = load_settings(args.config, sink_files=False)

    async def examine() -> Diagnosis:
        async with command_store(settings, needs=Needs.NOTHING) as store:
            return await diagnose(
                store, lease_s=settings.relay.lease_s, batch_size=settings.relay.batch_size
            )

    diagnosis = asyncio.run(examine())
    sys.stdout.write((diagnosis.as_json() if args.json else diagnosis.render()) + "\n")
    return EXIT_FAILURE if diagnosis.failed else EXIT_OK


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd doctor`, beside its handler."""
    doctor = commands.add_parser(
        "doctor",
        parents=[common],
        help="the outbox's health in PostgreSQL: vacuum, the xmin horizon, the claim's plan",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(handler=doctor_command)


async def diagnose(store: Store, *, lease_s: float, batch_size: int) -> Diagnosis:
    diagnosis = Diagnosis()
    table = await store.doctor_table()
    if table is None:
        diagnosis.findings.append(
            Finding(Verdict.FAIL, "table", f"{store.table} not found: run `relayd migrate`")
        )
        return diagnosis
    diagnosis.table = dict(table)
    diagnosis.findings.append(_vacuum_finding(diagnosis.table))
    diagnosis.findings.append(
        Finding(
            Verdict.OK,
            "size",
            f"table {_size(table['table_bytes'])}, with indexes and TOAST "
            f"{_size(table['total_bytes'])}",
        )
    )
    diagnosis.indexes = [dict(r) for r in await store.doctor_indexes()]
    diagnosis.horizon = [
        {"kind": "session", "name": _session_name(dict(r)), **dict(r)}
        for r in await store.doctor_xmin_holders(_HOLDERS_SHOWN)
    ] + [dict(r) for r in await store.doctor_horizon_others()]
    diagnosis.findings.append(_horizon_finding(diagnosis.horizon))
    plan = await store.explain_claim(batch_size, lease_s)
    diagnosis.claim_plan = json.loads(plan) if isinstance(plan, str) else plan
    analysed = table["last_analyze"] is not None or table["last_autoanalyze"] is not None
    diagnosis.findings.append(_plan_finding(diagnosis.claim_plan, store, analysed=analysed))
    return diagnosis


def _vacuum_finding(table: dict[str, Any]) -> Finding:
    live, dead = table["n_live_tup"], table["n_dead_tup"]
    last = max(
        (t for t in (table["last_vacuum"], table["last_autovacuum"]) if t is not None),
        default=None,
    )
    since_s = None if last is None else (datetime.now(UTC) - last).total_seconds()
    when = "never vacuumed" if since_s is None else f"last vacuumed {age(since_s)} ago"
    detail = f"{live:,} live rows, {dead:,} dead tuples; {when}"
    if dead > DEAD_TUPLES_WARN and dead > DEAD_SHARE_WARN * max(live, 1):
        return Finding(Verdict.WARN, "vacuum", detail + " (dead tuples slow every claim)")
    return Finding(Verdict.OK, "vacuum", detail)


def _horizon_finding(horizon: list[dict[str, Any]]) -> Finding:
    old = [h for h in horizon if _holds_long(h)]
    if not old:
        return Finding(Verdict.OK, "horizon", "no transaction holds the xmin horizon back for long")
    names = ", ".join(f"{h['kind']} {h['name']}" for h in old[:3])
    return Finding(
        Verdict.WARN,
        "horizon",
        f"held back by {names}: vacuum cannot remove dead rows while it lasts",
    )


def _holds_long(holder: dict[str, Any]) -> bool:
    if holder["kind"] == "session":
        return bool((holder.get("xact_age_s") or 0) > HORIZON_WARN_S)
    return bool(holder["xmin_age_xids"] > SLOT_WARN_XIDS)


def plan_scans(plan: Any) -> set[tuple[str, str]]:
    """(node type, relation or index) of every scan in an EXPLAIN (FORMAT JSON) plan."""
    found: set[tuple[str, str]] = set()
    stack = [plan]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if "Node Type" in node:
                where = node.get("Index Name") or node.get("Relation Name") or ""
                found.add((str(node["Node Type"]), str(where)))
            stack.extend(node.values())
    return found


def _plan_finding(plan: Any, store: Store, *, analysed: bool) -> Finding:
    index = f"{store.table.name}_relayd_claim"
    scans = plan_scans(plan)
    reads_index = any(where == index for _, where in scans)
    # Only scans of the outbox matter (the claim also reads pg_stat_activity's catalogs).
    sequential = ("Seq Scan", store.table.name) in scans
    if reads_index and not sequential:
        return Finding(Verdict.OK, "claim", f"the claim reads its index {index}")
    if not analysed:
        # Without statistics the planner guesses from the table's size: a plan to look at
        # again once the table is analysed, not a fault.
        return Finding(
            Verdict.WARN,
            "claim",
            f"{store.table} is not analysed yet, so the plan shown is a guess: autovacuum "
            f"analyses it as rows arrive, or run ANALYZE {store.table}, then doctor again",
        )
    return Finding(
        Verdict.FAIL,
        "claim",
        f"the claim does not read its index {index} (a sequential scan on every claim): "
        "check the index exists and is valid (`relayd migrate` creates it)",
    )


def _session_name(row: dict[str, Any]) -> str:
    who = f"{row.get('username') or '?'}@{row.get('database') or '?'}"
    return f"pid {row['pid']} {who} ({row.get('application_name') or '-'}, {row.get('state')})"


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < _KIB:
            return f"{value:.0f} {unit}"
        value /= _KIB
    return f"{value:.1f} TB"


def _json_default(value: object) -> str | None:
    if isinstance(value, datetime):
        return iso(value)
    return str(value)
