"""`relayd console`: serve the console until signalled, on a pool of its own (at most two
connections, `console.statement_timeout_s`) with the configuration's DSN: the operator
role's, as every operator command uses."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import signal
import sys
from typing import TYPE_CHECKING

from relayd.core.errors import EXIT_OK, ConfigError
from relayd.settings import Settings, load_settings

if TYPE_CHECKING:
    from aiohttp import web

    from relayd.console.auth import Gate
    from relayd.operator.command import Commands
    from relayd.store import Store

# The console's pool: one connection for the page being served, one for the overview's
# refresh or an action's batch; a third request waits for one of them.
POOL_MAX = 2
_CLIENT_MODULES = ("jinja2",)


def require_extra() -> None:
    """`ConfigError` naming the extra when the console's libraries are not installed."""
    missing = [name for name in _CLIENT_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            "console",
            f"relayd console needs {', '.join(missing)}, which is not installed: install "
            "relayd[console] (pip install '.[console]' in a clone, or the wheel with "
            "[console]: docs/install.md)",
        )


def console_command(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, sink_files=False)
    require_extra()
    from relayd.console.auth import Gate  # noqa: PLC0415 - needs the extra, checked above

    gate = Gate.from_settings(settings.console)  # reads the password file: ConfigError
    asyncio.run(serve(settings, gate))
    return EXIT_OK


async def serve(settings: Settings, gate: Gate) -> None:
    """Open the pool, check the schema, serve until SIGINT or SIGTERM, then close."""
    from aiohttp import web  # noqa: PLC0415

    from relayd.config.sections import parse_listen  # noqa: PLC0415
    from relayd.console.app import build_app, new_console  # noqa: PLC0415
    from relayd.console.overview import sampling  # noqa: PLC0415
    from relayd.store import Store  # noqa: PLC0415
    from relayd.store.migrations import require_current  # noqa: PLC0415

    console_settings = settings.console
    store = await Store.connect(
        settings.dsn,
        settings.outbox.outbox_table,
        max_size=POOL_MAX,
        connect_timeout_s=settings.database.connect_timeout_s,
        statement_timeout_s=console_settings.statement_timeout_s,
    )
    try:
        await require_current(store)
        console = new_console(
            store,
            console_settings,
            gate,
            sample_interval_s=settings.metrics.sample_interval_s,
            lease_s=settings.relay.lease_s,
        )
        runner = web.AppRunner(build_app(console), access_log=None, handle_signals=False)
        await runner.setup()
        host, port = parse_listen(console_settings.listen)
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
            async with sampling(console.status):
                await _until_signalled(site, store, console_settings.actions)
        finally:
            await runner.cleanup()
    finally:
        await store.close()


async def _until_signalled(site: web.TCPSite, store: Store, actions: bool) -> None:
    """Say where the console listens, then wait for SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        mode = "actions on" if actions else "read-only"
        sys.stderr.write(
            f"relayd: console for {store.table} on {_url(site)} ({mode}); Ctrl-C stops it\n"
        )
        sys.stderr.flush()
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def _url(site: web.TCPSite) -> str:
    """Where the site listens, with the port bound when the configuration asked for 0."""
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    if sockets:
        host, port = sockets[0].getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"
    return site.name


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd console`, beside its handler."""
    console = commands.add_parser(
        "console",
        parents=[common],
        help="serve the operator console in a browser ([console]; needs the relayd[console] extra)",
    )
    console.set_defaults(handler=console_command)
