"""Structured logging: one stable event name per happening, fields instead of sentences.

JSON lines on stderr in production, a console renderer on a TTY. Payloads and secrets are
never logged; callers pass event ids, attempts, outcomes and durations.

The standard library's `logging` (asyncpg, aiohttp and asyncio log through it) goes through
the same processors and renderer, so its records are JSON lines too, with the logger's name
as `component`. An error record keeps its traceback; a warning's exception (asyncpg's pool
retrying a connection while the server is down, say) is one `error` field, `Type: message`,
so an outage reads as one line per retry, not a traceback each.

When stderr is the journal's stream (systemd sets `$JOURNAL_STREAM` to its `device:inode`),
each line starts with its syslog priority, `<3>` for an error to `<7>` for debug
(sd-daemon(3)), so journald records the level.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Mapping
from typing import Literal, TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR

# syslog priorities (sd-daemon(3)) of structlog's level names.
_PRIORITIES = {
    "critical": 2,
    "exception": 3,
    "error": 3,
    "warning": 4,
    "warn": 4,
    "info": 6,
    "debug": 7,
    "notset": 7,
}
_DEFAULT_PRIORITY = 6
# The name of the handler relayd puts on the root logger (replaced on reconfiguration).
_HANDLER_NAME = "relayd"


def configure_logging(
    level: Literal["debug", "info", "warning", "error"] = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    stream: TextIO | None = None,
    *,
    journal: bool | None = None,
) -> None:
    """Route structlog and the standard library's logging to `stream` (stderr) at `level`,
    as JSON or for a human; `journal` (default: detected) prefixes syslog priorities."""
    stream = sys.stderr if stream is None else stream
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    if journal if journal is not None else is_journal_stream(stream):
        renderer = _PriorityPrefix(renderer)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    _route_standard_logging(stream, _LEVELS[level], shared, renderer)


def is_journal_stream(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `stream` is connected to the journal: `$JOURNAL_STREAM` names its device and
    inode (a stream merely inherited the variable otherwise)."""
    environ = os.environ if environ is None else environ
    expected = environ.get("JOURNAL_STREAM")
    if not expected:
        return False
    try:
        status = os.fstat(stream.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
    return expected == f"{status.st_dev}:{status.st_ino}"


class _PriorityPrefix:
    """Wraps a renderer: every line of its output starts with `<N>`, the syslog priority."""

    def __init__(self, renderer: Processor) -> None:
        self._renderer = renderer

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> str:
        level = str(event_dict.get("level", method)).lower()
        priority = _PRIORITIES.get(level, _DEFAULT_PRIORITY)
        text = str(self._renderer(logger, method, event_dict))
        return "\n".join(f"<{priority}>{line}" for line in text.split("\n"))


def _component_from_logger(
    _logger: WrappedLogger, _method: str, event_dict: EventDict
) -> EventDict:
    """A standard-library record's logger name (`asyncpg.pool`) becomes its `component`."""
    record = event_dict.get("_record")
    if isinstance(record, logging.LogRecord):
        event_dict.setdefault("component", record.name)
    return event_dict


def _brief_warning_exceptions(
    _logger: WrappedLogger, _method: str, event_dict: EventDict
) -> EventDict:
    """A foreign record below ERROR carries its exception as `error`, not a traceback."""
    record = event_dict.get("_record")
    if not isinstance(record, logging.LogRecord) or record.levelno >= logging.ERROR:
        return event_dict
    exc_info = event_dict.pop("exc_info", None)
    if isinstance(exc_info, tuple) and isinstance(exc_info[1], BaseException):
        exc = exc_info[1]
        event_dict.setdefault("error", f"{type(exc).__name__}: {exc}")
    return event_dict


def _route_standard_logging(
    stream: TextIO, level: int, shared: list[Processor], renderer: Processor
) -> None:
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[_component_from_logger, _brief_warning_exceptions, *shared],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn() too, as the `py.warnings` component


def get_logger(component: str) -> FilteringBoundLogger:
    """A logger whose events carry `component`."""
    return cast(FilteringBoundLogger, structlog.get_logger().bind(component=component))
