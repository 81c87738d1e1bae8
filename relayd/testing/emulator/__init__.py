"""An in-memory OJS job server over aiohttp: the ground truth of relayd's correctness tests.

It serves the producer binding (`producer`), the worker binding with the gateway dialect's
`lease_token` (`worker`), the switches that reproduce how real servers differ (`config`), the
scripted faults of `relayd.testing.emulator.faults`, and a ledger of what each job id went through
(`state`); `app` puts them behind one aiohttp application.

Control API (no auth, no faults): ``GET /_emulator/ledger``, ``GET /_emulator/arrivals`` (the
ids stored, in order, and when each one's request was received, in epoch seconds on the
emulator's clock: ``{"arrivals": [...], "received_at": [...]}``), ``GET|POST|DELETE
/_emulator/faults``, ``POST /_emulator/reset`` (with ``{"receipts": true}`` it also answers
the arrivals it forgot, as ``GET /_emulator/arrivals`` would have), ``POST /_emulator/clock``
(``{"advance_s": N}``). The same operations are methods of `Emulator` for in-process tests.

Ledger JSON (``GET /_emulator/ledger``)::

    {"jobs": {"<id>": {"job": {...as GET shows it...} | null, "queue": "<effective queue>",
                       "created": 1, "overwrites": 0, "posts": 2, "post_statuses": [201, 409],
                       "post_traceparents": ["00-...-01", null],
                       "gets": 1, "deliveries": 0, "purged": false}}}

`created` counts insertions (an overwrite counts), `posts` every POST (single or batch) that
carried the id whatever its outcome, `post_statuses` the answer to each (null: the connection
was dropped without one), `post_traceparents` each one's `traceparent` request header as
received (null: none), `deliveries` the worker fetches. Time-driven transitions (scheduled
and retry promotion, lease expiry, retention purge) happen lazily at the next request, on the
emulator's clock, which tests can move forward instead of sleeping.
"""

from relayd.producer import uuid7
from relayd.testing.emulator.app import Emulator, RunningEmulator, serve, start_emulator
from relayd.testing.emulator.config import (
    DUPLICATE_MODES,
    QUEUE_SOURCES,
    DuplicateMode,
    EmulatorConfig,
    QueueSource,
    config_from_options,
)
from relayd.testing.emulator.faults import FaultRule
from relayd.testing.emulator.jobs import UUIDV7_PATTERN
from relayd.testing.emulator.state import LedgerEntry
from relayd.testing.emulator.wire import format_time, parse_duration_s

__all__ = [
    "DUPLICATE_MODES",
    "QUEUE_SOURCES",
    "UUIDV7_PATTERN",
    "DuplicateMode",
    "Emulator",
    "EmulatorConfig",
    "FaultRule",
    "LedgerEntry",
    "QueueSource",
    "RunningEmulator",
    "config_from_options",
    "format_time",
    "parse_duration_s",
    "serve",
    "start_emulator",
    "uuid7",
]
