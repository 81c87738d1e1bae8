"""Structured logging: one stable event name per happening, fields instead of sentences.

JSON lines on stderr in production, a console renderer on a TTY. Payloads and secrets are
never logged; callers pass event ids, attempts, outcomes and durations.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR


def configure_logging(
    level: Literal["debug", "info", "warning", "error"] = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    stream: TextIO | None = None,
) -> None:
    """Route structlog to `stream` (stderr) at `level`, as JSON or for a human."""
    stream = sys.stderr if stream is None else stream
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get_logger(component: str) -> FilteringBoundLogger:
    """A logger whose events carry `component`."""
    return cast(FilteringBoundLogger, structlog.get_logger().bind(component=component))
