"""The daemon's own sections of the configuration (`[database]`, `[outbox]`, `[relay]`,
`[retry]`, `[http]`, `[log]`, `[cleanup]`, `[metrics]`): their keys, defaults and bounds.
`[sink]` is each kind's (`relayd/sinks/`); the whole is `relayd.settings.Settings`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from relayd.config.base import MAX_DURATION_S, KeyedError, Section, read_secret
from relayd.config.dsn import check_dsn
from relayd.core.rows import OutboxTable

# Retention is counted in years, not hours: ten of them is still far from interval limits.
_MAX_RETENTION_S = 10 * 365 * 24 * 3600.0
# PostgreSQL's statement_timeout is an int4 of milliseconds, and 0 means "no limit": the
# setting must fit in 2^31 - 1 ms and be at least 1 ms.
_MAX_STATEMENT_TIMEOUT_S = 2_147_483.0
_MIN_STATEMENT_TIMEOUT_S = 0.001


class DatabaseSettings(Section):
    dsn: SecretStr | None = None
    dsn_file: Path | None = None
    pool_max_size: int | None = Field(default=None, ge=2, le=1000)
    connect_timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    statement_timeout_s: float = Field(
        default=30.0, ge=_MIN_STATEMENT_TIMEOUT_S, le=_MAX_STATEMENT_TIMEOUT_S
    )

    _dsn_from_file: SecretStr | None = PrivateAttr(default=None)

    @field_validator("dsn")
    @classmethod
    def _valid_dsn(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_dsn(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _one_dsn_source(self) -> DatabaseSettings:
        if self.dsn is not None and self.dsn_file is not None:
            raise ValueError("set either dsn or dsn_file, not both")
        return self

    @model_validator(mode="after")
    def _read_dsn_file(self) -> DatabaseSettings:
        # Read while validating, so that any DatabaseSettings, however built, is complete.
        if self.dsn_file is not None:
            dsn = read_secret(self.dsn_file, "database.dsn_file")
            try:
                check_dsn(dsn)
            except ValueError as exc:
                raise KeyedError("database.dsn_file", f"{self.dsn_file}: {exc}") from None
            self._dsn_from_file = SecretStr(dsn)
        return self

    @property
    def resolved_dsn(self) -> SecretStr | None:
        """The DSN, from `dsn` or read from `dsn_file`."""
        return self.dsn if self.dsn is not None else self._dsn_from_file


# A column outbox.ordering_key_column may name: a plain identifier, so that it needs no
# quoting wherever relayd writes it.
_COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


class OutboxSettings(Section):
    table: str = "relayd.outbox"
    # The INSERT trigger that NOTIFYs idle relays (`relayd migrate` creates or drops it); false
    # for two-phase-commit producers (no PREPARE TRANSACTION after a NOTIFY): relays poll.
    notify_trigger: bool = True
    # A column of the outbox holding each row's ordering key (a Debezium-shaped table's
    # `aggregateid`): `relayd migrate` gives the table a trigger that copies it into
    # ordering_key when a row sets none (docs/ordering.md). None: rows set ordering_key.
    ordering_key_column: str | None = None

    @field_validator("ordering_key_column")
    @classmethod
    def _plain_column(cls, value: str | None) -> str | None:
        if value is not None and not _COLUMN.fullmatch(value):
            raise ValueError(
                "expected a column name: a letter or underscore, then letters, digits or "
                "underscores (at most 63)"
            )
        return value

    @field_validator("table")
    @classmethod
    def _valid_table(cls, value: str) -> str:
        OutboxTable.parse(value)
        return value

    @property
    def outbox_table(self) -> OutboxTable:
        return OutboxTable.parse(self.table)


class RelaySettings(Section):
    workers: int = Field(default=4, ge=1, le=256)
    batch_size: int = Field(default=100, ge=1, le=10_000)
    lease_s: float = Field(default=30.0, gt=0, le=MAX_DURATION_S)
    poll_interval_s: float = Field(default=2.0, gt=0, le=MAX_DURATION_S)
    listen: bool = True
    shutdown_grace_s: float = Field(default=10.0, ge=0, le=MAX_DURATION_S)
    # How often a claim reads the whole claim index rather than from its watermark
    # (relayd/engine/watermark.py): the longest a row inserted with a past available_at can wait.
    full_scan_interval_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    # The poison-storm guard (relayd/engine/storm.py): more than this share of the last
    # storm_window settled rows of one queue and type rejected by the sink pauses that queue
    # and type instead of dead-lettering them. 1.0 turns the guard off (more than all is
    # impossible).
    storm_threshold: float = Field(default=0.5, gt=0, le=1)
    storm_window: int = Field(default=100, ge=1, le=100_000)
    # Where the relay keeps its proof of life (relayd/engine/liveness.py): a directory the
    # operating system clears with the machine, private to this service (systemd's
    # RuntimeDirectory=, a pod's emptyDir). Unset: systemd's $RUNTIME_DIRECTORY if there is
    # one, else none, and a crashed relay's claims wait out relay.lease_s.
    runtime_dir: Path | None = None


class RetrySettings(Section):
    base_s: float = Field(default=1.0, gt=0, le=MAX_DURATION_S)
    cap_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    max_attempts: int = Field(default=10, ge=1)
    breaker_threshold: int = Field(default=5, ge=1)
    breaker_cooldown_s: float = Field(default=5.0, gt=0, le=MAX_DURATION_S)

    @model_validator(mode="after")
    def _cap_above_base(self) -> RetrySettings:
        if self.cap_s < self.base_s:
            raise ValueError("cap_s must be >= base_s")
        return self


class HttpSettings(Section):
    enabled: bool = True
    listen: str = "127.0.0.1:9464"

    @field_validator("listen")
    @classmethod
    def _valid_listen(cls, value: str) -> str:
        parse_listen(value)
        return value


class LogSettings(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class CleanupSettings(Section):
    enabled: bool = True
    published_retention_s: float = Field(default=7 * 24 * 3600.0, ge=0, le=_MAX_RETENTION_S)
    interval_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    batch_size: int = Field(default=1000, ge=1, le=100_000)


class MetricsSettings(Section):
    # The backlog sampler's period, which is also the heartbeat's: a relay silent for three
    # of them is shown as stale, so it must stay far below the day after which heartbeats
    # are pruned; under 0.1 s the sample would be a steady load on PostgreSQL.
    sample_interval_s: float = Field(default=5.0, ge=0.1, le=3600.0)


def parse_listen(value: str) -> tuple[str, int]:
    """Split `HOST:PORT` (IPv6 as `[::1]:PORT`) and check the port."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port_text)
