"""The fault suite's history checker: once a scenario has healed and drained, it reads the
outbox, the sink's ledger and a transition history, and reports every breach of relayd's
contract (docs/contract.md), with each id's timeline. It reports ids that are:

- lost (C1): neither published nor dead (discarded rows are dead), or deleted unpublished;
- unexpected: created on the sink (`created >= 1`) under an id the outbox never had;
- duplicated (C2): created on the sink more than once, or overwritten;
- falsely published (C2): published, but the sink never created the job, no longer holds it
  (and did not purge it), or holds it with another id, type, effective queue or args, or
  without the meta the envelope carries (`deduplicated` rows need not be on the sink);
- stale token (C3): changed by a transition the fenced SQL could not have made (below).

`install_history` adds row triggers that append to `relayd_test.transitions` every INSERT and
DELETE of the outbox, and every UPDATE that changes lease_owner, attempts, available_at,
published_at, dead_at or discarded_at: old and new values, clock_timestamp(), the
transaction's now() and txid_current(), and a serial. Row locks serialise the updates of a
row and an aborted transaction takes its history rows with it, so a row's transitions in
serial order are exactly its committed changes.

The stale-token rule follows relayd/store/sql/. `claim` sets lease_owner to a fresh
token, adds one attempt and moves available_at to now() + lease_s, only where published_at
and dead_at are null and available_at <= now(). `settle_published` (published_at),
`settle_dead` (dead_at), `settle_retry` (available_at, attempts - 0 or 1) and `release`
(available_at, attempts - 1) also set lease_owner to NULL, only where lease_owner is the
claim's token. `dlq_redrive` (dead_at NULL, attempts 0, lease_owner NULL), `dlq_discard`
(discarded_at) and the migrations (dead_at, invalid_envelope) need no lease. A settle carries
its token only in its WHERE clause, so no trigger can tell which token a writer held; what
is checked is the lease discipline the fence implies. Every recorded UPDATE must be:

1. a claim (a new token in lease_owner) of a row pending and due (OLD.available_at <= the
   claim's now(): free, or an expired lease taken over) that adds one attempt; or
2. the settle of the lease in force: OLD.lease_owner is the latest claim's token,
   NEW.lease_owner is NULL, and the row was still pending; or
3. an operator's redrive or discard, or a migration's dead letter; or
4. a lease or a backoff ended by hand (tests do it instead of waiting): only available_at
   of a pending row moved, back to no later than now().

Anything else is stale: above all a change with no lease in force, which is what a relay
whose UPDATE lacks the owner predicate writes once its claim's lease was settled. An old
owner's unfenced settle landing on a newer lease looks, by value, like the newer owner's
settle; it shows when that owner settles too (one lease, two settles: the second flagged).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import asyncpg

from relayd.core import jsonvalue
from relayd.core.rows import OutboxTable
from tests.support import DEFAULT_TABLE


class Kind(enum.StrEnum):
    """A class of violation, in the order the report lists them."""

    LOST = "lost"
    UNEXPECTED = "unexpected"
    DUPLICATED = "duplicated"
    FALSELY_PUBLISHED = "falsely published"
    STALE = "stale token"


HISTORY_TABLE = "relayd_test.transitions"
_MIGRATE_ERROR = "dead-lettered by relayd migrate"
_SHOWN_IDS = 50  # ids listed per kind in format()
_SHOWN_TIMELINES = 20  # timelines in format()
_SHOWN_CHARS = 300  # of a job or an error in a timeline

_HISTORY_DDL = """
CREATE SCHEMA IF NOT EXISTS relayd_test;
CREATE TABLE IF NOT EXISTS relayd_test.transitions (
    serial bigserial PRIMARY KEY, outbox text NOT NULL, event_id uuid NOT NULL, op text NOT NULL,
    at timestamptz NOT NULL, tx_now timestamptz NOT NULL, txid bigint NOT NULL,
    old_lease_owner  uuid,        new_lease_owner  uuid,
    old_attempts     integer,     new_attempts     integer,
    old_available_at timestamptz, new_available_at timestamptz,
    old_published_at timestamptz, new_published_at timestamptz,
    old_dead_at      timestamptz, new_dead_at      timestamptz,
    old_discarded_at timestamptz, new_discarded_at timestamptz,
    dead_reason text, last_error text
);
CREATE INDEX IF NOT EXISTS transitions_by_row
    ON relayd_test.transitions (outbox, event_id, serial);
-- OLD is NULL in an INSERT trigger and NEW in a DELETE one: their fields read as NULL.
-- SECURITY DEFINER: a relay running as a restricted role still writes the history.
CREATE OR REPLACE FUNCTION relayd_test.record_transition() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO relayd_test.transitions VALUES (DEFAULT,
        TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, coalesce(NEW.event_id, OLD.event_id), TG_OP,
        clock_timestamp(), now(), txid_current(),
        OLD.lease_owner, NEW.lease_owner, OLD.attempts, NEW.attempts,
        OLD.available_at, NEW.available_at, OLD.published_at, NEW.published_at,
        OLD.dead_at, NEW.dead_at, OLD.discarded_at, NEW.discarded_at,
        CASE TG_OP WHEN 'DELETE' THEN OLD.dead_reason ELSE NEW.dead_reason END,
        CASE TG_OP WHEN 'DELETE' THEN OLD.last_error ELSE NEW.last_error END);
    RETURN NULL;
END
$$;
"""

# Only updates that change a recorded column are recorded.
_TRIGGERS_DDL = """
DROP TRIGGER IF EXISTS relayd_test_history_insert ON {t};
DROP TRIGGER IF EXISTS relayd_test_history_update ON {t};
DROP TRIGGER IF EXISTS relayd_test_history_delete ON {t};
CREATE TRIGGER relayd_test_history_insert AFTER INSERT ON {t}
    FOR EACH ROW EXECUTE FUNCTION relayd_test.record_transition();
CREATE TRIGGER relayd_test_history_delete AFTER DELETE ON {t}
    FOR EACH ROW EXECUTE FUNCTION relayd_test.record_transition();
CREATE TRIGGER relayd_test_history_update AFTER UPDATE ON {t} FOR EACH ROW
    WHEN ((OLD.lease_owner, OLD.attempts, OLD.available_at, OLD.published_at, OLD.dead_at,
           OLD.discarded_at)
          IS DISTINCT FROM (NEW.lease_owner, NEW.attempts, NEW.available_at, NEW.published_at,
                            NEW.dead_at, NEW.discarded_at))
    EXECUTE FUNCTION relayd_test.record_transition();
"""

_HISTORY_READY = f"""
SELECT to_regclass('{HISTORY_TABLE}') IS NOT NULL
   AND (SELECT count(*) FROM pg_trigger
        WHERE tgrelid = to_regclass($1) AND tgname LIKE 'relayd\\_test\\_history\\_%') = 3
"""

# The final state of every row, in the order a timeline shows it.
_OUTBOX = """
SELECT event_id::text AS event_id, attempts, lease_owner, available_at, last_attempt_at,
       published_at, sink_state, dead_at, dead_reason, discarded_at, discard_reason,
       created_at, last_error, job::text AS job,
       coalesce(job #>> '{{options,queue}}', job ->> 'queue', 'default') AS queue
FROM {t}
"""

_TRANSITIONS = f"SELECT * FROM {HISTORY_TABLE} WHERE outbox = $1 ORDER BY serial"


async def install_history(
    conn: asyncpg.Connection, table: OutboxTable | str = DEFAULT_TABLE
) -> None:
    """Create `relayd_test.transitions` and the outbox's history triggers (idempotent)."""
    async with conn.transaction():
        await conn.execute(_HISTORY_DDL)
        await conn.execute(_TRIGGERS_DDL.format(t=_outbox(table).qualified))


@dataclass(frozen=True, slots=True)
class RowState:
    """The columns of an outbox row the history records."""

    lease_owner: uuid.UUID | None
    attempts: int
    available_at: datetime
    published_at: datetime | None
    dead_at: datetime | None
    discarded_at: datetime | None


@dataclass(frozen=True, slots=True)
class Transition:
    """One recorded change of an outbox row (`old` None: an INSERT; `new` None: a DELETE);
    `dead_reason` and `last_error` are the row's after it (before it, for a DELETE)."""

    serial: int
    event_id: str
    op: str
    at: datetime  # clock_timestamp()
    tx_now: datetime  # now(): what the statement's own conditions compared with
    txid: int
    old: RowState | None
    new: RowState | None
    dead_reason: str | None
    last_error: str | None

    @property
    def changed(self) -> tuple[str, ...]:
        """The recorded columns whose value changed (none for an INSERT or a DELETE)."""
        if self.old is None or self.new is None:
            return ()
        names = (f.name for f in dataclasses.fields(RowState))
        return tuple(n for n in names if getattr(self.old, n) != getattr(self.new, n))

    @property
    def effect(self) -> str:
        """What the change did: insert, delete, claim, published, dead, redrive,
        retry/release (the lease ended without an end state), discard or update."""
        o, n = self.old, self.new
        if o is None or n is None:
            return self.op.lower()
        effects = (
            ("claim", n.lease_owner is not None and n.lease_owner != o.lease_owner),
            ("published", o.published_at is None and n.published_at is not None),
            ("dead", o.dead_at is None and n.dead_at is not None),
            ("redrive", o.dead_at is not None and n.dead_at is None),
            ("retry/release", o.lease_owner is not None and n.lease_owner is None),
            ("discard", self.changed == ("discarded_at",)),
        )
        return next((name for name, applies in effects if applies), "update")


def _transition(record: asyncpg.Record) -> Transition:
    def state(prefix: str) -> RowState | None:
        if record[f"{prefix}attempts"] is None:  # NOT NULL in the outbox: no such side
            return None
        return RowState(**{f.name: record[prefix + f.name] for f in dataclasses.fields(RowState)})

    plain = ("serial", "op", "at", "tx_now", "txid", "dead_reason", "last_error")
    return Transition(
        event_id=str(record["event_id"]),
        old=state("old_"),
        new=state("new_"),
        **{name: record[name] for name in plain},
    )


@dataclass(frozen=True, slots=True)
class Finding:
    """One violation: its kind, the id, why, and (stale token) the transition at fault."""

    kind: Kind
    event_id: str
    detail: str
    serial: int | None = None


@dataclass(frozen=True)
class Timeline:
    """Everything known of one id: the outbox row's final state (None: not in the outbox),
    the sink's ledger entry (None: none) and the recorded transitions, in order."""

    row: Mapping[str, Any] | None
    ledger: Mapping[str, Any] | None
    transitions: tuple[Transition, ...]


@dataclass(frozen=True)
class Report:
    """The checker's verdict: the ids of each kind of violation, every finding with its
    detail, and the timeline of each id involved."""

    lost: frozenset[str]
    unexpected: frozenset[str]
    duplicated: frozenset[str]
    falsely_published: frozenset[str]
    stale_token: frozenset[str]
    findings: tuple[Finding, ...]
    timelines: Mapping[str, Timeline]  # by event id
    rows: int  # outbox rows read
    sink_jobs: int  # ids the sink created
    transitions: int  # transitions recorded for this outbox

    @property
    def violations(self) -> tuple[Finding, ...]:
        return self.findings

    @property
    def ok(self) -> bool:
        return not self.findings

    def format(self) -> str:
        """The verdict for a human: the ids by kind, then each id's timeline."""
        head = (
            f"history check: {len(self.findings)} violation(s) over {self.rows} outbox rows, "
            f"{self.sink_jobs} sink jobs, {self.transitions} transitions"
        )
        if self.ok:
            return f"{head}: clean"
        lines = [head]
        for kind in Kind:
            ids = sorted({f.event_id for f in self.findings if f.kind is kind})
            more = f" ... and {len(ids) - _SHOWN_IDS} more" if len(ids) > _SHOWN_IDS else ""
            if ids:
                lines.append(f"{kind} ({len(ids)}): {', '.join(ids[:_SHOWN_IDS])}{more}")
        for event_id in list(self.timelines)[:_SHOWN_TIMELINES]:
            lines += ["", self.timeline_text(event_id)]
        if len(self.timelines) > _SHOWN_TIMELINES:
            lines += ["", f"... {len(self.timelines) - _SHOWN_TIMELINES} more timelines"]
        return "\n".join(lines)

    def timeline_text(self, event_id: str) -> str:
        """One id's violations, outbox row, ledger entry and transitions, as text."""
        timeline = self.timelines[event_id]
        mine = [f for f in self.findings if f.event_id == event_id]
        flagged = {f.serial: f.detail for f in mine if f.serial is not None}
        lines = [f"--- {event_id} ---", *(f"  {f.kind}: {f.detail}" for f in mine)]
        lines += [*_row_lines(timeline.row), *_ledger_lines(timeline.ledger)]
        lines.append(f"  history ({len(timeline.transitions)} transitions):")
        for t in timeline.transitions:
            lines.append(f"    {_transition_line(t)}")
            if t.serial in flagged:
                lines.append(f"      ^ {Kind.STALE}: {flagged[t.serial]}")
        return "\n".join(lines)


def assert_clean(report: Report) -> None:
    """Fail with the report's text unless it found nothing."""
    if not report.ok:
        raise AssertionError(report.format())


async def fetch_ledger(url: str) -> dict[str, Any]:
    """The ledger of the emulator at base `url` (GET /_emulator/ledger)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url.rstrip('/')}/_emulator/ledger") as answer,
    ):
        answer.raise_for_status()
        ledger: dict[str, Any] = await answer.json()
    return ledger


async def check(
    conn: asyncpg.Connection,
    ledger: Mapping[str, Any] | str,
    *,
    table: OutboxTable | str = DEFAULT_TABLE,
    waiting: AbstractSet[str] = frozenset(),
) -> Report:
    """Check the outbox `table`, the sink's `ledger` (the parsed JSON of /_emulator/ledger,
    or the emulator's base URL) and the history `install_history` recorded; run it once the
    scenario has drained. `waiting`: rows that must still be pending (the rows of parked
    keys, from their head on), which are not lost for being so."""
    outbox = _outbox(table)
    parsed = await fetch_ledger(ledger) if isinstance(ledger, str) else ledger
    jobs: Mapping[str, Mapping[str, Any]] = parsed["jobs"]
    if not await conn.fetchval(_HISTORY_READY, outbox.qualified):
        raise RuntimeError(f"no history on {outbox}: run install_history() before the scenario")
    rows = {r["event_id"]: dict(r) for r in await conn.fetch(_OUTBOX.format(t=outbox.qualified))}
    records = await conn.fetch(_TRANSITIONS, str(outbox))
    history: dict[str, list[Transition]] = defaultdict(list)
    for transition in map(_transition, records):
        history[transition.event_id].append(transition)
    findings = [
        *_lost({i: row for i, row in rows.items() if i not in waiting}, history),
        *_unexpected(jobs, rows.keys() | history.keys()),
        *_duplicated(jobs),
        *_falsely_published(rows.values(), jobs),
        *(f for transitions in history.values() for f in _stale(transitions)),
    ]
    order = list(Kind)
    findings.sort(key=lambda f: (order.index(f.kind), f.event_id, f.serial or 0))
    ids = {kind: frozenset(f.event_id for f in findings if f.kind is kind) for kind in Kind}
    return Report(
        lost=ids[Kind.LOST],
        unexpected=ids[Kind.UNEXPECTED],
        duplicated=ids[Kind.DUPLICATED],
        falsely_published=ids[Kind.FALSELY_PUBLISHED],
        stale_token=ids[Kind.STALE],
        findings=tuple(findings),
        timelines={
            i: Timeline(rows.get(i), jobs.get(i), tuple(history.get(i, ())))
            for i in sorted({f.event_id for f in findings})
        },
        rows=len(rows),
        sink_jobs=sum(1 for entry in jobs.values() if entry.get("created", 0) >= 1),
        transitions=len(records),
    )


def _outbox(table: OutboxTable | str) -> OutboxTable:
    return table if isinstance(table, OutboxTable) else OutboxTable.parse(table)


def _lost(
    rows: Mapping[str, Mapping[str, Any]], history: Mapping[str, Sequence[Transition]]
) -> Iterable[Finding]:
    for event_id, row in rows.items():
        if row["published_at"] is None and row["dead_at"] is None:
            yield Finding(Kind.LOST, event_id, "pending: neither published nor dead")
    for event_id, transitions in history.items():
        for t in transitions if event_id not in rows else ():
            if t.old is not None and t.new is None and t.old.published_at is None:
                state = "dead" if t.old.dead_at is not None else "pending"
                yield Finding(Kind.LOST, event_id, f"deleted by #{t.serial} while {state}")


def _unexpected(
    jobs: Mapping[str, Mapping[str, Any]], known: AbstractSet[str]
) -> Iterable[Finding]:
    for event_id, entry in jobs.items():
        if entry.get("created", 0) >= 1 and event_id not in known:
            detail = f"created {entry['created']} time(s) on the sink; the outbox never had it"
            yield Finding(Kind.UNEXPECTED, event_id, detail)


def _duplicated(jobs: Mapping[str, Mapping[str, Any]]) -> Iterable[Finding]:
    for event_id, entry in jobs.items():
        created, overwrites = entry.get("created", 0), entry.get("overwrites", 0)
        if created > 1 or overwrites > 0:
            detail = f"created {created} times, overwritten {overwrites} times on the sink"
            yield Finding(Kind.DUPLICATED, event_id, detail)


def _falsely_published(
    rows: Iterable[Mapping[str, Any]], jobs: Mapping[str, Mapping[str, Any]]
) -> Iterable[Finding]:
    for row in rows:
        if row["published_at"] is None:
            continue
        entry = jobs.get(row["event_id"])
        problem = None
        if entry is None or entry.get("created", 0) < 1:
            if row["sink_state"] != "deduplicated":
                problem = "the sink never created it"
        elif entry.get("job") is None:
            problem = None if entry.get("purged") else "the sink holds no job under its id"
        elif differ := _differences(row, entry):
            problem = f"the sink's job differs: {', '.join(differ)}"
        if problem is not None:
            detail = f"published (sink_state {row['sink_state']}) but {problem}"
            yield Finding(Kind.FALSELY_PUBLISHED, row["event_id"], detail)


def _differences(row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    """The producer's fields the sink echoes on which its job differs from the envelope:
    id, type, the effective queue, args, and the meta keys the envelope carries; values
    compared by meaning (relayd.jsonvalue.equal: key order ignored, 1 == 1.0, true != 1)."""
    try:
        envelope = jsonvalue.loads(row["job"], bounded=False)
    except jsonvalue.JsonError:
        return ["the envelope (unreadable)"]
    job: Mapping[str, Any] = entry["job"]
    found = [name for name in ("id", "type") if job.get(name) != envelope.get(name)]
    if (entry.get("queue") or "default") != row["queue"]:
        found.append("queue")
    if not jsonvalue.equal(job.get("args"), envelope.get("args")):
        found.append("args")
    sent, held = envelope.get("meta"), job.get("meta")
    held = held if isinstance(held, dict) else {}
    if isinstance(sent, dict) and any(
        key not in held or not jsonvalue.equal(held[key], value) for key, value in sent.items()
    ):
        found.append("meta")
    return found


# --- the stale-token rule (see the module docstring) ---------------------------------------


def _stale(transitions: Sequence[Transition]) -> Iterable[Finding]:
    """Walk one row's transitions in order, tracking its latest claim and what ended it."""
    claim: Transition | None = None
    ended: Transition | None = None
    for t in transitions:
        problem = _fencing_problem(t, claim, ended)
        if problem is not None:
            yield Finding(Kind.STALE, t.event_id, f"#{t.serial} {t.effect}: {problem}", t.serial)
        if t.old is None or t.new is None:
            continue
        if t.effect == "claim":
            claim, ended = t, None
        elif t.old.lease_owner is not None and t.new.lease_owner is None:
            ended = t


def _fencing_problem(
    t: Transition, claim: Transition | None, ended: Transition | None
) -> str | None:
    """Why `t` is none of the four legitimate kinds of change, or None if it is one."""
    o, n = t.old, t.new
    if o is None or n is None:
        return None  # an insert, or a delete (lost when the row was not published)
    if t.effect == "claim":
        return _claim_problem(t, o, n)
    if _operator_action(t, o, n) or _due_by_hand(t, o, n):
        return None
    changed = ", ".join(t.changed)
    if o.lease_owner is None:
        return f"changed {changed} with no lease in force: {_lease_story(claim, ended)}"
    if n.lease_owner is not None:
        return (
            f"changed {changed} of a row leased to {_token(o.lease_owner)} and kept the lease "
            "(no relayd statement does that)"
        )
    return _settle_problem(o, claim)


def _settle_problem(o: RowState, claim: Transition | None) -> str | None:
    """The lease ended: the row must have been pending, under the latest claim's token."""
    if o.published_at is not None or o.dead_at is not None:
        return f"settled a row already {'published' if o.published_at else 'dead'}"
    if claim is not None and claim.new is not None and claim.new.lease_owner != o.lease_owner:
        return (
            f"settled the lease of {_token(o.lease_owner)}, but the latest claim "
            f"#{claim.serial} gave {_token(claim.new.lease_owner)}: a change went unrecorded"
        )
    return None


def _claim_problem(t: Transition, o: RowState, n: RowState) -> str | None:
    """A new token: the claim's own conditions must have held, and it adds one attempt."""
    reasons = []
    if o.published_at is not None or o.dead_at is not None:
        reasons.append(f"the row was already {'published' if o.published_at else 'dead'}")
    # A keyed row waits at 'infinity', unleased, for its turn (docs/ordering.md).
    waiting_turn = o.lease_owner is None and o.available_at == datetime.max
    if _utc(o.available_at) > _utc(t.tx_now) and not waiting_turn:
        held = f"the lease of {_token(o.lease_owner)}" if o.lease_owner else "the row"
        reasons.append(f"{held} ran until {_time(o.available_at)}, after now() {_time(t.tx_now)}")
    if n.attempts != o.attempts + 1:
        reasons.append(f"attempts went {o.attempts} -> {n.attempts} (a claim adds one)")
    if not reasons:
        return None
    return f"token {_token(n.lease_owner)} took the row although " + "; ".join(reasons)


def _operator_action(t: Transition, o: RowState, n: RowState) -> bool:
    """A dlq redrive or discard, or a migration's dead letter: legitimate without a lease."""
    redrive = t.effect == "redrive" and n.lease_owner is None and n.attempts == 0
    discard = t.effect == "discard" and o.dead_at is not None
    migrate = (
        t.effect == "dead"
        and t.dead_reason == "invalid_envelope"
        and (t.last_error or "").startswith(_MIGRATE_ERROR)
    )
    return redrive or discard or migrate


def _due_by_hand(t: Transition, o: RowState, n: RowState) -> bool:
    """Only available_at moved, back to no later than now(), on a pending row: a lease or a
    backoff a test ended instead of waiting for it (with or without the lease in force)."""
    return (
        t.changed == ("available_at",)
        and o.published_at is None
        and o.dead_at is None
        and _utc(n.available_at) < _utc(o.available_at)
        and _utc(n.available_at) <= _utc(t.tx_now)
    )


def _lease_story(claim: Transition | None, ended: Transition | None) -> str:
    if claim is None or claim.new is None:
        return "the recorded history has no claim of this row"
    lease = f"the lease of claim #{claim.serial} ({_token(claim.new.lease_owner)})"
    if ended is None:
        return f"{lease} ended without a recorded settle"
    return f"{lease} was already ended by #{ended.serial} ({ended.effect})"


def _utc(value: datetime) -> datetime:
    """Comparable whatever asyncpg returned (its infinities are naive)."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _time(value: datetime) -> str:
    return _utc(value).astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]


def _token(value: uuid.UUID | None) -> str:
    return "-" if value is None else str(value)[:8]


def _show(value: Any) -> str:
    if isinstance(value, datetime):
        return _time(value)
    if value is None or isinstance(value, uuid.UUID):
        return _token(value)
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _row_lines(row: Mapping[str, Any] | None) -> list[str]:
    if row is None:
        return ["  outbox: no such row"]
    shown = {k: v for k, v in row.items() if k not in ("event_id", "job", "last_error", "queue")}
    lines = ["  outbox: " + ", ".join(f"{k} {_show(v)}" for k, v in shown.items())]
    if row["last_error"]:
        lines.append(f"          last_error {_show(row['last_error'])}")
    return [*lines, f"          job {_show(row['job'])}"]


def _ledger_lines(entry: Mapping[str, Any] | None) -> list[str]:
    if entry is None:
        return ["  sink:   no ledger entry"]
    counts = ", ".join(f"{k} {v}" for k, v in entry.items() if k != "job")
    job = entry.get("job")
    shown = "-" if job is None else _show(json.dumps(job, sort_keys=True))
    return [f"  sink:   {counts}", f"          job {shown}"]


def _transition_line(t: Transition) -> str:
    head = f"#{t.serial} {_time(t.at)} txid {t.txid} {t.effect:<13} "
    state = t.new or t.old
    if t.changed or state is None:  # an update
        return head + ", ".join(
            f"{k} {_show(getattr(t.old, k))} -> {_show(getattr(t.new, k))}" for k in t.changed
        )
    names = (f.name for f in dataclasses.fields(RowState))
    return head + ", ".join(f"{k} {_show(getattr(state, k))}" for k in names)
