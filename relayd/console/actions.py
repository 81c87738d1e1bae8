"""The console's actions, each the function its command's verb calls, audited alike with the
console user's name: a dead-letter action (`relayd dlq retry|discard`, by id or on everything
a filter matches), a pause and a resume, and the parked keys' verbs.

Every action is two POSTs: the first shows what it would do (a dead-letter action and a
key's verb run as a dry run, rolled back), the second, from that page's form, does it. A
bulk action's confirmation acts on the rows its dry run walked: the filters with their times
made absolute, and the walk's end fixed when it was counted. The CSRF check and the
read-only refusal are the application's (app.py), before any of this runs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from aiohttp import web
from multidict import MultiDictProxy

from relayd.console.app import console_of, refuse, render, user_of
from relayd.console.pages import query_filters, resolve_filters
from relayd.core.errors import DatabaseUnavailable
from relayd.operator.command import BadInput, check_text, parse_ids
from relayd.operator.dlq_actions import DlqRequest, Selection, act, walk_end
from relayd.operator.keys_actions import NotParked, check_key, release_key, retry_key, skip_key
from relayd.operator.pause import (
    pause_queue,
    queue_arg,
    queue_use,
    resume_queue,
    type_arg,
    unused_queue_warning,
)
from relayd.store.records import AuditEntry, DlqAction, RowOutcome, describe_pause

_MAX_REASON_CHARS = 1000
_CONFIRMED = "yes"
_DLQ_ACTIONS = {"retry": DlqAction.REDRIVE, "discard": DlqAction.DISCARD}
_KEY_VERBS: dict[str, Any] = {"retry": retry_key, "skip": skip_key, "release": release_key}


def _field(form: MultiDictProxy[Any], name: str) -> str | None:
    value = form.get(name)
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()


def _reason(form: MultiDictProxy[Any], *, required: str | None = None) -> str | None:
    value = _field(form, "reason")
    if value is None:
        if required is not None:
            raise BadInput(f"reason: required: {required}")
        return None
    return check_text(value, "reason", _MAX_REASON_CHARS)


async def dead_letters_act(request: web.Request) -> web.StreamResponse:
    """Redrive or discard dead letters (named, or every one a filter matches): a dry run
    first, then, confirmed, the action."""
    console = console_of(request)
    form = await request.post()
    try:
        action = _DLQ_ACTIONS[_field(form, "action") or ""]
    except KeyError:
        return refuse(request, 400, "Unknown action", "action: expected retry or discard")
    try:
        reason = _reason(
            form,
            required="say why these rows are discarded" if action is DlqAction.DISCARD else None,
        )
        ids = parse_ids([v for v in form.getall("id", []) if isinstance(v, str)]) or None
        wanted, given = query_filters({k: v for k, v in form.items() if isinstance(v, str)})
        if ids and given:
            raise BadInput("filters select rows for a bulk action only; with ids, name each row")
        if not ids and _field(form, "scope") != "matched":
            raise BadInput("name the dead letters, or act on everything the filter matches")
        walk_until = _walk_until(_field(form, "walk_until"))
    except BadInput as exc:
        return refuse(request, 400, "Cannot act", str(exc))
    confirmed = _field(form, "confirmed") == _CONFIRMED
    now = await console.store.operator_now()
    try:
        filters = resolve_filters(wanted, now)
    except BadInput as exc:
        return refuse(request, 400, "Cannot act", str(exc))
    until = walk_end(filters, now if walk_until is None else min(walk_until, now))
    user = user_of(request)
    request_ = DlqRequest(
        action,
        Selection(ids, filters, until),
        AuditEntry(actor=user, action=action.value, reason=reason, keep_all_ids=ids is not None),
        dry_run=not confirmed,
    )
    summary = await act(console.store, request_)
    verb = "retry" if action is DlqAction.REDRIVE else "discard"
    done = RowOutcome.REDRIVEN if action is DlqAction.REDRIVE else RowOutcome.DISCARDED
    context: dict[str, Any] = {
        "summary": summary,
        "verb": verb,
        "changed": summary.counts[done],
        "skipped": summary.skipped[:50],
        "ids": ids or [],
        "given": given,
        "reason": reason or "",
        "walk_until": until.isoformat(),
    }
    return render(request, "dlq_done.html" if confirmed else "dlq_confirm.html", **context)


def _walk_until(text: str | None) -> datetime | None:
    """The end of the walk a dry run counted, carried by its confirmation's form."""
    if text is None:
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise BadInput("walk_until: not a time: reload the dead letters and start again") from None
    if at.tzinfo is None:
        raise BadInput("walk_until: a time without its offset")
    return at


async def pause_act(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    form = await request.post()
    try:
        queue, job_type = queue_arg(_field(form, "queue")), type_arg(_field(form, "type"))
        reason = _reason(form, required="say why, for the audit trail and the other operators")
    except BadInput as exc:
        return refuse(request, 400, "Cannot pause", str(exc))
    assert reason is not None  # noqa: S101 - required above
    what = describe_pause(queue, job_type)
    fields = {"queue": _field(form, "queue") or "", "type": _field(form, "type") or ""}
    if _field(form, "confirmed") != _CONFIRMED:
        return render(
            request,
            "confirm.html",
            title=f"Pause {what}?",
            lines=[
                f"Every relay of {console.outbox} stops claiming {what} from its next claim.",
                f"Reason recorded in the audit trail: {reason}",
            ],
            target="/pauses/pause",
            fields=fields | {"reason": reason},
            button="Pause",
            danger=True,
            back="/pauses",
        )
    inserted = await pause_queue(
        console.store, queue, job_type, reason=reason, actor=user_of(request)
    )
    lines = [f"Paused {what}." if inserted else f"{what} was paused already: reason updated."]
    try:
        warning = unused_queue_warning(
            queue, job_type, await queue_use(console.store, queue), console.outbox
        )
    except DatabaseUnavailable:  # the look took longer than the console's timeout
        warning = None
    if warning is not None:
        lines.append(f"Warning: {warning}")
    return render(request, "done.html", title="Paused", lines=lines, back="/pauses")


async def resume_act(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    form = await request.post()
    try:
        queue, job_type = queue_arg(_field(form, "queue")), type_arg(_field(form, "type"))
        reason = _reason(form)
    except BadInput as exc:
        return refuse(request, 400, "Cannot resume", str(exc))
    what = describe_pause(queue, job_type)
    if _field(form, "confirmed") != _CONFIRMED:
        return render(
            request,
            "confirm.html",
            title=f"Resume {what}?",
            lines=[f"Relays claim {what} again at once (idle ones are woken)."],
            target="/pauses/resume",
            fields={
                "queue": _field(form, "queue") or "",
                "type": _field(form, "type") or "",
                "reason": reason or "",
            },
            button="Resume",
            danger=False,
            back="/pauses",
        )
    lifted = await resume_queue(
        console.store, queue, job_type, actor=user_of(request), reason=reason
    )
    line = f"Resumed {what}." if lifted is not None else f"{what} was not paused: nothing to do."
    return render(request, "done.html", title="Resumed", lines=[line], back="/pauses")


async def key_act(request: web.Request) -> web.StreamResponse:
    """A parked key's verb (retry, skip, release): a dry run first, then, confirmed, the verb."""
    console = console_of(request)
    form = await request.post()
    verb_name = request.match_info["verb"]
    verb = _KEY_VERBS.get(verb_name)
    if verb is None:
        raise web.HTTPNotFound
    confirmed = _field(form, "confirmed") == _CONFIRMED
    # A skip's reason is asked for on its confirmation page, and required there.
    needs_reason = verb is skip_key and confirmed
    try:
        key = check_key(str(form.get("key", "")))
        reason = _reason(
            form, required="say why this row may be passed over" if needs_reason else None
        )
    except (BadInput, ValueError) as exc:
        return refuse(request, 400, f"Cannot {verb_name} the key", str(exc))
    actor, dry_run = user_of(request), not confirmed
    try:
        if verb is skip_key:
            # The dry run records nothing: its reason is never written.
            outcome = await skip_key(
                console.store, key, actor=actor, reason=reason or "dry run", dry_run=dry_run
            )
        else:
            outcome = await verb(console.store, key, actor=actor, reason=reason, dry_run=dry_run)
    except NotParked as exc:
        return refuse(request, 409, "Not parked", f"{exc}: another action lifted it first.")
    return render(
        request,
        "key_done.html" if confirmed else "key_confirm.html",
        outcome=outcome,
        verb=verb_name,
        reason=reason or "",
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/dead-letters/act", dead_letters_act)
    app.router.add_post("/pauses/pause", pause_act)
    app.router.add_post("/pauses/resume", resume_act)
    app.router.add_post("/keys/{verb}", key_act)
