"""Which dead letters: the filter options (their parser, their checks, their values on the
database's clock, their JSON) and the `--since`/`--until` time parser. A filter is added
here, to `DeadLetterFilter` and to the SQL that applies it (`dlq_list`, `dlq_page`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from relayd.core.outcomes import DeadReason
from relayd.operator.command import BadInput, check_text, quote
from relayd.operator.render import iso
from relayd.store.records import DeadLetterFilter

_MAX_FILTER_CHARS = 1000

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
            raise BadInput(f"{option}: {quote(text)} is too long ago") from None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{option}: {_WHEN_HINT}; got {quote(text)}") from None
    return When(at=at if at.tzinfo is not None else at.replace(tzinfo=UTC))


# --- which dead letters -------------------------------------------------------------------


def filter_options() -> argparse.ArgumentParser:
    """The filter options of `dlq list`, `dlq retry` and `dlq discard`, as a parent parser
    (`--reason` is not one of them: it is the note an action records in the audit trail)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--queue", help="the effective queue: options.queue, else queue, else default"
    )
    options.add_argument("--type", help="the job's type")
    options.add_argument(
        "--dead-reason",
        metavar="REASON",
        help=f"why the row was dead-lettered: {', '.join(r.value for r in DeadReason)}",
    )
    options.add_argument(
        "--since",
        metavar="WHEN",
        help="dead-lettered at or after WHEN: an ISO 8601 time (UTC without an offset) "
        "or a duration before now (30m, 2h, 7d)",
    )
    options.add_argument("--until", metavar="WHEN", help="dead-lettered before WHEN")
    options.add_argument(
        "--error-contains", metavar="TEXT", help="last_error contains TEXT (any case)"
    )
    return options


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
            raise BadInput(f"--since ({iso(since)}) must be before --until ({iso(until)})")
        return DeadLetterFilter(
            queue=self.queue,
            type=self.type,
            dead_reason=self.dead_reason,
            since=since,
            until=until,
            error_contains=self.error_contains,
        )


def filter_args(args: argparse.Namespace) -> FilterArgs:
    """The filter options of `dlq list`, `dlq retry` and `dlq discard`, checked."""
    reason = args.dead_reason
    known = [r.value for r in DeadReason]
    if reason is not None and reason not in known:
        raise BadInput(f"--dead-reason: {quote(reason)} is not a dead reason ({', '.join(known)})")
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


def filters_json(filters: DeadLetterFilter) -> dict[str, Any]:
    """The set filters, for the audit trail and `--json` output."""
    data: dict[str, Any] = {}
    for name in ("queue", "type", "dead_reason", "error_contains"):
        value = getattr(filters, name)
        if value is not None:
            data[name] = value
    for name in ("since", "until"):
        value = getattr(filters, name)
        if value is not None:
            data[name] = iso(value)
    return data
