"""The switches that reproduce how real OJS servers differ (`EmulatorConfig`), and building
them from command-line options."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

DuplicateMode = Literal["spec409", "overwrite", "pk500"]
QueueSource = Literal["options", "top_level", "either"]
DUPLICATE_MODES: tuple[str, ...] = get_args(DuplicateMode)
QUEUE_SOURCES: tuple[str, ...] = get_args(QueueSource)

DEFAULT_VISIBILITY_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class EmulatorConfig:
    """How the emulator behaves where real OJS servers disagree."""

    # A reused client id: 409 `duplicate` (conformance), silent overwrite (redis, lite),
    # or 500 `internal_error` retryable (postgres primary-key violation).
    duplicate_mode: DuplicateMode = "spec409"
    # The gateway dialect: with spec409, reusing an id in *another* queue surfaces a storage
    # error (500 internal_error) instead of 409.
    cross_queue_500: bool = False
    # Where the job's queue is read: `options.queue` (OJS binding; a top-level `queue` is
    # echoed as an unknown field), top-level `queue` (the gateway dialect), or either
    # (options first).
    queue_source: QueueSource = "options"
    # True: validate and check every batch item before storing any. False (redis, lite):
    # check each item's id, type and args first, then validate and store the items one by
    # one; the first that fails answers for the batch and the earlier ones stay stored.
    batch_atomic: bool = True
    # Whether POST /ojs/v1/jobs/batch exists; advertised as capabilities.batch_enqueue.
    batch_enqueue: bool = True
    max_batch_jobs: int = 100
    # Terminal jobs are purged this long after they finish; afterwards GET is 404 and the
    # id may be inserted again.
    retention_s: float = 24 * 3600.0
    auth_token: str | None = field(default=None, repr=False)
    max_body_bytes: int = 1 << 20
    default_visibility_timeout_ms: int = DEFAULT_VISIBILITY_TIMEOUT_MS
    # The OJS-Version response header; the reference code sends its own constant.
    ojs_version: str = "1.0"

    def __post_init__(self) -> None:
        if self.duplicate_mode not in DUPLICATE_MODES:
            raise ValueError(f"duplicate_mode must be one of {', '.join(DUPLICATE_MODES)}")
        if self.queue_source not in QUEUE_SOURCES:
            raise ValueError(f"queue_source must be one of {', '.join(QUEUE_SOURCES)}")
        if self.max_batch_jobs < 1:
            raise ValueError("max_batch_jobs must be >= 1")
        if self.retention_s < 0 or math.isnan(self.retention_s):
            raise ValueError("retention_s must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.default_visibility_timeout_ms < 1:
            raise ValueError("default_visibility_timeout_ms must be >= 1")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty")

    @classmethod
    def gateway_variant(cls, **overrides: Any) -> EmulatorConfig:
        """The gateway dialect: the queue is read from a top-level `queue`; an id reused in
        its original queue is 409 `duplicate`, one reused in another queue a storage error
        (500 `internal_error`); batches are atomic. Its workers fence ack and nack with the
        `lease_token` that fetch hands out (honoured whenever a client sends one)."""
        settings: dict[str, Any] = {
            "duplicate_mode": "spec409",
            "cross_queue_500": True,
            "queue_source": "top_level",
            "batch_atomic": True,
        }
        settings.update(overrides)
        return cls(**settings)


def config_from_options(
    *,
    duplicate_mode: str = "spec409",
    queue_source: str = "options",
    batch_atomic: bool = True,
    batch_enqueue: bool = True,
    cross_queue_500: bool = False,
    auth_token_file: str | None = None,
    retention_s: str | float | None = None,
    max_body_bytes: str | int | None = None,
    max_batch_jobs: str | int | None = None,
) -> EmulatorConfig:
    """An EmulatorConfig from command-line style options; ValueError names the bad one."""
    token: str | None = None
    if auth_token_file is not None:
        try:
            token = Path(auth_token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"auth_token_file: cannot read {auth_token_file}: {exc}") from exc
        if not token:
            raise ValueError(f"auth_token_file: {auth_token_file} is empty")
    if duplicate_mode not in DUPLICATE_MODES:
        raise ValueError(
            f"duplicate_mode must be one of {', '.join(DUPLICATE_MODES)} (got {duplicate_mode!r})"
        )
    if queue_source not in QUEUE_SOURCES:
        raise ValueError(
            f"queue_source must be one of {', '.join(QUEUE_SOURCES)} (got {queue_source!r})"
        )
    settings: dict[str, Any] = {
        "duplicate_mode": duplicate_mode,
        "queue_source": queue_source,
        "batch_atomic": batch_atomic,
        "batch_enqueue": batch_enqueue,
        "cross_queue_500": cross_queue_500,
        "auth_token": token,
    }
    if retention_s is not None:
        settings["retention_s"] = _float_option("retention_s", retention_s)
    if max_body_bytes is not None:
        settings["max_body_bytes"] = _int_option("max_body_bytes", max_body_bytes)
    if max_batch_jobs is not None:
        settings["max_batch_jobs"] = _int_option("max_batch_jobs", max_batch_jobs)
    return EmulatorConfig(**settings)


def _float_option(name: str, value: str | float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a number (got {value!r})") from exc


def _int_option(name: str, value: str | int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be an integer (got {value!r})") from exc
