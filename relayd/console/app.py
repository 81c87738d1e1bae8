"""The console's aiohttp application: its routes, the user of every request, the CSRF check
of every POST, the read-only refusal, and the headers that keep a page from loading anything
from elsewhere. The pages are `pages.py`'s, the actions `actions.py`'s."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from aiohttp import web

from relayd.config.console import ConsoleSettings
from relayd.console import views
from relayd.console.auth import REALM, Gate, Unauthenticated
from relayd.console.overview import StatusSampler
from relayd.core import __version__
from relayd.core.errors import DatabaseUnavailable, PrivilegeError, StatementError
from relayd.operator.render import stamp
from relayd.store.privileges import Role, hint

if TYPE_CHECKING:
    from relayd.store import Store

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Nothing from elsewhere: the console's own script and stylesheet, no inline script, no
# frame around it, forms posting to itself only.
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Console:
    """What every handler reads: the store, the settings it acts under, who is who."""

    store: Store
    settings: ConsoleSettings
    gate: Gate
    templates: jinja2.Environment
    outbox: str
    status: StatusSampler  # the overview's figures


def new_console(
    store: Store, settings: ConsoleSettings, gate: Gate, *, sample_interval_s: float, lease_s: float
) -> Console:
    """The console over `store`: its overview read at most every `sample_interval_s`
    (metrics.sample_interval_s); `lease_s` is relay.lease_s, as `relayd status` reads it."""
    return Console(
        store=store,
        settings=settings,
        gate=gate,
        templates=templates(),
        outbox=str(store.table),
        status=StatusSampler(store, interval_s=sample_interval_s, lease_s=lease_s),
    )


STATIC = Path(__file__).resolve().parent / "static"
CONSOLE = web.AppKey("console", Console)
USER = web.RequestKey("user", str)


def console_of(request: web.Request) -> Console:
    return request.app[CONSOLE]


def user_of(request: web.Request) -> str:
    user: str = request[USER]
    return user


def templates() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("relayd.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["when"] = views.when
    environment.filters["utc"] = stamp  # a time inside an attribute (a title)
    environment.filters["age"] = views.duration
    environment.filters["shown"] = views.shown
    environment.filters["or_none"] = views.highlight_none
    environment.globals["version"] = __version__
    return environment


def render(
    request: web.Request, template: str, *, status: int = 200, **context: Any
) -> web.Response:
    """A page of the console: `template` with what every page shows (the user, the outbox,
    whether actions are on, the CSRF token its forms carry)."""
    console = console_of(request)
    user = user_of(request)
    text = console.templates.get_template(template).render(
        user=user,
        outbox=console.outbox,
        actions=console.settings.actions,
        show_payloads=console.settings.show_payloads,
        csrf=console.gate.csrf_token(user),
        refresh_s=console.settings.refresh_s,
        path=request.path,
        **context,
    )
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def refuse(request: web.Request, status: int, title: str, message: str) -> web.Response:
    return render(request, "error.html", status=status, title=title, message=message)


@web.middleware
async def _identify(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request, static files too, comes from a known user."""
    console = console_of(request)
    try:
        request[USER] = console.gate.user(request.headers)
    except Unauthenticated:
        if console.gate.mode == "basic":
            return web.Response(
                status=401,
                text="relayd console: sign in\n",
                headers={"WWW-Authenticate": REALM, **_SECURITY_HEADERS},
            )
        return web.Response(
            status=401,
            text=f"relayd console: the proxy named no user ({console.gate.header})\n",
            headers=_SECURITY_HEADERS,
        )
    return await handler(request)


@web.middleware
async def _guard_posts(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A POST acts: refused in read-only mode, and without the user's CSRF token."""
    if request.method != "POST":
        return await handler(request)
    console = console_of(request)
    if not console.settings.actions:
        return refuse(
            request,
            403,
            "Read-only console",
            "This console was started without console.actions = true: it shows, it does "
            "not act. The relayd command line acts with the operator role.",
        )
    form = await request.post()
    token = form.get("csrf")
    if not isinstance(token, str) or not console.gate.csrf_valid(user_of(request), token):
        return refuse(
            request,
            403,
            "Form refused",
            "The form's CSRF token is missing or not this console's (a restart draws a new "
            "one): reload the page and submit it again.",
        )
    return await handler(request)


@web.middleware
async def _failures(request: web.Request, handler: Handler) -> web.StreamResponse:
    """What the database said, as a page: the statement and its error, never the DSN."""
    try:
        return await handler(request)
    except DatabaseUnavailable as exc:
        return refuse(
            request,
            503,
            "Database unavailable",
            f"{exc}: the page could not be read within console.statement_timeout_s, or "
            "PostgreSQL is unreachable. Reload in a moment.",
        )
    except PrivilegeError as exc:
        return refuse(request, 500, "Permission denied", f"{exc}; {hint(Role.OPERATOR)}")
    except StatementError as exc:
        return refuse(request, 500, "The database refused a statement", str(exc))


@web.middleware
async def _headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # a 404, a redirect: raised by aiohttp or a page
        exc.headers.update(_SECURITY_HEADERS)
        raise
    response.headers.update(_SECURITY_HEADERS)
    return response


def build_app(console: Console) -> web.Application:
    """The console's application over `console.store` (opened and closed by the caller)."""
    from relayd.console import actions, pages  # noqa: PLC0415 - they import this module

    app = web.Application(
        middlewares=[_headers, _identify, _failures, _guard_posts], client_max_size=64 * 1024
    )
    app[CONSOLE] = console
    pages.add_routes(app)
    actions.add_routes(app)
    app.router.add_static("/static/", STATIC, name="static", append_version=False)
    return app
