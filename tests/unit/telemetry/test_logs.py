"""Logging (relayd/telemetry/logs.py): journald priority prefixes; the standard library's
records as JSON."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

from relayd.telemetry.logs import configure_logging, get_logger, is_journal_stream


def test_journal_lines_carry_their_syslog_priority() -> None:
    """Under journald every line starts with <N>: error 3, warning 4, info 6, debug 7."""
    out = io.StringIO()
    configure_logging("debug", "json", out, journal=True)
    log = get_logger("test")
    log.error("e.error")
    log.warning("e.warning")
    log.info("e.info")
    log.debug("e.debug")
    lines = out.getvalue().splitlines()
    assert [line[:3] for line in lines] == ["<3>", "<4>", "<6>", "<7>"]
    assert [json.loads(line[3:])["event"] for line in lines] == [
        "e.error",
        "e.warning",
        "e.info",
        "e.debug",
    ]


def test_no_prefix_outside_the_journal() -> None:
    """Without the journal, lines are plain JSON."""
    out = io.StringIO()
    configure_logging("info", "json", out, journal=False)
    get_logger("test").info("plain")
    assert json.loads(out.getvalue())["event"] == "plain"


def test_journal_stream_is_recognised_by_device_and_inode(tmp_path: Path) -> None:
    """$JOURNAL_STREAM must name the stream's own device:inode (sd-daemon(3))."""
    path = tmp_path / "stderr"
    with path.open("w") as stream:
        status = os.fstat(stream.fileno())
        own = f"{status.st_dev}:{status.st_ino}"
        assert is_journal_stream(stream, {"JOURNAL_STREAM": own})
        assert not is_journal_stream(stream, {"JOURNAL_STREAM": f"{status.st_dev}:1"})
        assert not is_journal_stream(stream, {})
    assert not is_journal_stream(io.StringIO(), {"JOURNAL_STREAM": own})


def test_standard_library_records_are_json_with_their_traceback() -> None:
    """asyncpg's and aiohttp's logging records come out as JSON lines, tracebacks inside."""
    out = io.StringIO()
    configure_logging("info", "json", out, journal=True)
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        logging.getLogger("asyncpg.pool").exception("connection %s lost", "c1")
    logging.getLogger("aiohttp.server").debug("below the level")
    [line] = out.getvalue().splitlines()
    assert line.startswith("<3>{")
    record = json.loads(line[3:])
    assert record["event"] == "connection c1 lost"
    assert record["component"] == "asyncpg.pool"
    assert record["level"] == "error"
    assert "timestamp" in record
    assert "ConnectionResetError: peer went away" in record["exception"]


def test_a_standard_library_warning_names_its_exception_in_one_line() -> None:
    """asyncpg's pool retrying a connection during an outage warns with exc_info: the line
    carries `error` (type and message), not a traceback."""
    out = io.StringIO()
    configure_logging("info", "json", out)
    try:
        raise FileNotFoundError(2, "No such file or directory")
    except FileNotFoundError:
        logging.getLogger("asyncpg.pool").warning("floor; retrying", exc_info=True)
    [line] = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["level"] == "warning"
    assert record["error"] == "FileNotFoundError: [Errno 2] No such file or directory"
    assert "exception" not in record
    assert "Traceback" not in line


def test_reconfiguring_replaces_the_handler() -> None:
    """Configuring twice leaves one relayd handler on the root logger, on the new stream."""
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "json", first)
    configure_logging("info", "json", second)
    logging.getLogger("asyncio").warning("once")
    assert first.getvalue() == ""
    assert json.loads(second.getvalue())["component"] == "asyncio"
    assert sum(h.get_name() == "relayd" for h in logging.getLogger().handlers) == 1
