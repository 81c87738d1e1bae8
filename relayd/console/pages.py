"""The console's pages, each from the function its command uses: the overview is `relayd
status`'s report, the dead letters `relayd dlq`'s filters over a keyset page, the pauses and
parked keys `relayd pause`'s and `relayd keys`' reads, an event's timeline its row and the
audit rows naming it."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from relayd.console import views
from relayd.console.app import console_of, refuse, render
from relayd.core.outcomes import DeadReason
from relayd.operator.command import BadInput, parse_ids
from relayd.operator.dlq_filters import FilterArgs, filter_args
from relayd.operator.keys_actions import parked_keys
from relayd.store.records import DeadLetterFilter, EventRecord

PAGE_ROWS = 50
# The most dead letters a page reads to find its rows: a filter that matches few of them
# shows what it found there, and its next page reads on.
PAGE_WINDOW = 1000
PARKED_SHOWN = 200
# The dead-letter filters as the page's query names them, and the option each stands for.
FILTER_FIELDS = {
    "dead_reason": "dead_reason",
    "queue": "queue",
    "type": "type",
    "since": "since",
    "until": "until",
    "text": "error_contains",
}


async def overview(request: web.Request) -> web.StreamResponse:
    return render(request, "overview.html", **await _status(request))


async def overview_figures(request: web.Request) -> web.StreamResponse:
    """The overview's figures alone, which its script fetches to refresh them in place."""
    return render(request, "_figures.html", **await _status(request))


async def _status(request: web.Request) -> dict[str, Any]:
    report = await console_of(request).status.latest()
    backlog = report.backlog
    states = [
        ("ready", backlog.ready, "claimable now"),
        ("paused", backlog.paused, "due, held by a pause"),
        ("scheduled", backlog.scheduled, "waiting out a backoff"),
        ("leased", backlog.leased, "claimed, in flight"),
        ("dead", backlog.dead, "dead-lettered, not discarded"),
    ]
    return {"report": report, "backlog": backlog, "states": states}


def query_filters(query: dict[str, str]) -> tuple[FilterArgs, dict[str, str]]:
    """The dead-letter filters of a page's query (or a form), checked by `relayd dlq`'s own
    parser; blank fields are unset. Also the set fields, to carry to the next page. A
    `BadInput` names the page's field, not the command's option."""
    given = {name: (query.get(name) or "").strip() for name in FILTER_FIELDS}
    given = {name: value for name, value in given.items() if value}
    values = {option: given.get(name) for name, option in FILTER_FIELDS.items()}
    with _fields_named():
        return filter_args(argparse.Namespace(**values)), given


def resolve_filters(wanted: FilterArgs, now: datetime) -> DeadLetterFilter:
    """`wanted` on the database's clock (`since=2h`); a `BadInput` names the page's field."""
    with _fields_named():
        return wanted.resolve(now)


@contextlib.contextmanager
def _fields_named() -> Iterator[None]:
    try:
        yield
    except BadInput as exc:
        message = str(exc)
        for name, option in FILTER_FIELDS.items():
            message = message.replace(f"--{option.replace('_', '-')}", name)
        raise BadInput(message) from None


async def dead_letters(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    query = dict(request.query)
    context: dict[str, Any] = {"reasons": [r.value for r in DeadReason], "rows": []}
    try:
        wanted, given = query_filters(query)
        before = views.parse_cursor(query["before"]) if query.get("before") else None
    except (BadInput, ValueError) as exc:
        return render(
            request, "dead_letters.html", status=400, error=str(exc), given=query, **context
        )
    now = await console.store.operator_now()
    try:
        filters = resolve_filters(wanted, now)
    except BadInput as exc:
        return render(
            request, "dead_letters.html", status=400, error=str(exc), given=given, **context
        )
    rows, after = await console.store.console_dlq(
        filters, before=before, limit=PAGE_ROWS, window=PAGE_WINDOW
    )
    next_href = first_href = None
    if after is not None:
        next_href = "/dead-letters?" + urlencode(given | {"before": views.cursor(*after)})
    if before is not None:
        first_href = "/dead-letters?" + urlencode(given)
    return render(
        request,
        "dead_letters.html",
        error=None,
        given=given,
        filtered=bool(given),
        paged=before is not None,
        next_href=next_href,
        first_href=first_href,
        window=PAGE_WINDOW,
        resolved=_resolved(filters),
        **(context | {"rows": rows}),
    )


def _resolved(filters: DeadLetterFilter) -> dict[str, str]:
    """The filters with their times made absolute: what an action's form carries, so that
    its confirmation acts on the rows its dry run counted."""
    resolved = {
        name: value
        for name, option in FILTER_FIELDS.items()
        if (value := _text(getattr(filters, option))) is not None
    }
    return resolved


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


async def dead_letter(request: web.Request) -> web.StreamResponse:
    """One dead letter: its envelope, last error, attempts and audit history."""
    event = await _event(request)
    if isinstance(event, web.Response):
        return event
    if event.dead_at is None or event.published_at is not None:
        raise web.HTTPFound(f"/events/{event.event_id}")
    return render(request, "dead_letter.html", **await _event_context(request, event))


async def event_search(request: web.Request) -> web.StreamResponse:
    """The timeline's search form; an id given goes to its page."""
    wanted = request.query.get("id", "").strip()
    if wanted:
        try:
            [event_id] = parse_ids([wanted])
        except BadInput as exc:
            return render(request, "event_search.html", status=400, error=str(exc), wanted=wanted)
        raise web.HTTPFound(f"/events/{event_id}")
    return render(request, "event_search.html", error=None, wanted="")


async def event(request: web.Request) -> web.StreamResponse:
    """An event's timeline by id: created, claimed, attempts, published or dead, redrives,
    audit rows."""
    found = await _event(request)
    if isinstance(found, web.Response):
        return found
    return render(request, "event.html", **await _event_context(request, found))


async def _event(request: web.Request) -> EventRecord | web.Response:
    console = console_of(request)
    try:
        [event_id] = parse_ids([request.match_info["event_id"]])
    except BadInput as exc:
        return refuse(request, 400, "Not an event id", str(exc))
    found = await console.store.console_event(event_id)
    if found is None:
        return refuse(
            request,
            404,
            "No such event",
            f"No row of {console.outbox} has the id {event_id}: it was never appended, or "
            "retention cleanup deleted it once published.",
        )
    return found


async def _event_context(request: web.Request, event: EventRecord) -> dict[str, Any]:
    console = console_of(request)
    audit = await console.store.console_audit(event.event_id)
    steps: list[tuple[datetime | None, str, str, str]] = [
        (event.created_at, "created", "appended by the producer", "neutral"),
    ]
    if event.last_attempt_at is not None:
        noun = "attempt" if event.attempts == 1 else "attempts"
        attempt = f"last attempt ({event.attempts} {noun} since created or redriven)"
        if event.published_at is not None:
            # last_error outlives the attempt that published: it is an earlier one's.
            earlier = f"; an earlier one failed: {event.last_error}" if event.last_error else ""
            steps.append((event.last_attempt_at, "claimed", attempt + earlier, "neutral"))
        else:
            outcome = event.last_error or "no error recorded"
            tone = "warn" if event.last_error else "neutral"
            steps.append((event.last_attempt_at, "claimed", f"{attempt}: {outcome}", tone))
    if event.redriven_at is not None:
        steps.append((event.redriven_at, "redriven", "made pending again by an operator", "info"))
    if event.dead_at is not None:
        steps.append((event.dead_at, "dead", f"dead-lettered: {event.dead_reason}", "bad"))
    if event.discarded_at is not None:
        steps.append(
            (event.discarded_at, "discarded", f"discarded: {event.discard_reason}", "muted")
        )
    if event.published_at is not None:
        steps.append((event.published_at, "published", "accepted by the destination", "good"))
    for row in audit:
        what = f"{row.action} by {row.actor}" + (f": {row.reason}" if row.reason else "")
        steps.append((row.at, "audit", f"{what} (audit #{row.id}, {row.row_count} rows)", "info"))
    steps.sort(key=lambda step: views.sort_key(step[0]))
    return {
        "event": event,
        "steps": steps,
        "audit": audit,
        "envelope": views.envelope(event.job, show_payloads=console.settings.show_payloads),
    }


async def pauses(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    return render(request, "pauses.html", pauses=await console.store.pauses())


async def keys(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    rows = await parked_keys(console.store, limit=PARKED_SHOWN)
    return render(request, "keys.html", keys=rows, shown=PARKED_SHOWN)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", overview, name="overview")
    app.router.add_get("/overview/figures", overview_figures)
    app.router.add_get("/dead-letters", dead_letters, name="dead_letters")
    app.router.add_get("/dead-letters/{event_id}", dead_letter)
    app.router.add_get("/events", event_search, name="events")
    app.router.add_get("/events/{event_id}", event)
    app.router.add_get("/pauses", pauses, name="pauses")
    app.router.add_get("/keys", keys, name="keys")
