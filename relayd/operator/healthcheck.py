"""`relayd healthcheck`: ask a running daemon's `/healthz`, for a container's HEALTHCHECK.

The daemon is found where the configuration says it listens (`http.listen`); a wildcard
address (`0.0.0.0`, `::`) is asked on loopback. One line of output, exit 0 when `/healthz`
answers 200 within the timeout, else 1: never 2, which Docker reserves.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from relayd.config.sections import parse_listen
from relayd.core.errors import EXIT_FAILURE, EXIT_OK, ConfigError
from relayd.operator.command import fail
from relayd.settings import Settings, load_settings

if TYPE_CHECKING:
    from relayd.operator.command import Commands

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # noqa: S104 - mapped away


def healthcheck_command(args: argparse.Namespace) -> int:
    """`relayd healthcheck [--timeout SECONDS]`: one line; exit 0 if healthy, else 1."""
    try:
        healthy, said = probe(load_settings(args.config, sink_files=False), args.timeout)
    except ConfigError as exc:  # exit 1, not 2: a container runtime reserves 2
        healthy, said = False, f"config error: {exc}"
    if healthy:
        sys.stdout.write(f"relayd: healthy: {said}\n")
        return EXIT_OK
    fail(f"unhealthy: {said}")
    return EXIT_FAILURE


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd healthcheck`, beside its handler."""
    healthcheck = commands.add_parser(
        "healthcheck",
        parents=[common],
        help="ask the running daemon's /healthz (at http.listen): exit 0 if healthy, else 1",
    )
    healthcheck.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS")
    healthcheck.set_defaults(handler=healthcheck_command)


def healthz_url(settings: Settings) -> str:
    """The URL of the daemon's `/healthz` as seen from this host."""
    host, port = parse_listen(settings.http.listen)
    host = _WILDCARDS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def probe(settings: Settings, timeout_s: float) -> tuple[bool, str]:
    """(healthy, what to say)."""
    if not settings.http.enabled:
        return False, "http.enabled is false: no /healthz to ask"
    url = healthz_url(settings)
    # No proxy: the daemon is on this host, whatever HTTP_PROXY says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        return False, f"{url} answered {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return False, f"{url} did not answer: {reason}"
    if status != 200:  # noqa: PLR2004 - the one healthy answer
        return False, f"{url} answered {status}"
    return True, f"{url} answered 200"
