"""What every section of the configuration shares, below `config.py` and the sinks' own
settings models (`relayd/sinks/`): the strict base model, the error that names a key pydantic
would not, reading a secret file (and whether the sink's are read at all), and the bound on
durations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from relayd.config.secret_files import SecretFileError, read_secret_file

# Upper bound of durations. Every one ends up in an asyncio deadline, an int conversion or
# PostgreSQL's make_interval(), which overflow or fail at run time on huge values; a day is
# far beyond any sane lease, timeout or backoff, and keeps every derived deadline finite.
MAX_DURATION_S = 24 * 3600.0


class Section(BaseModel):
    """One `[section]` of the configuration: unknown keys refused, values frozen."""

    # inf and nan parse as floats (TOML `inf`, env "inf") but are never a usable setting.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Whether the sink's settings read their files (credentials, a CA bundle) while they are
# validated. Only the commands that talk to the sink need them (`relayd run`, `relayd
# check`); the others load the configuration without (`sink_files_unread`), so that an
# operator's role needs no access to the relay's secrets.
_SINK_FILES_READ: ContextVar[bool] = ContextVar("relayd_sink_files_read", default=True)


def sink_files_read() -> bool:
    """Whether sink settings validated now read their files (a kind's `_read_files`
    validator returns at once when not)."""
    return _SINK_FILES_READ.get()


@contextlib.contextmanager
def sink_files_unread() -> Iterator[None]:
    """Sink settings validated inside the block read none of their files: their paths are
    kept, their content is not looked at (and a sink cannot be built from them)."""
    token = _SINK_FILES_READ.set(False)
    try:
        yield
    finally:
        _SINK_FILES_READ.reset(token)


class KeyedError(ValueError):
    """A validation error whose key is not where pydantic reports it (a rule spanning
    sections, a secret file read by a section's validator); carries the key to name."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key


def read_secret(path: Path, key: str, *, read: Callable[[Path], str] = read_secret_file) -> str:
    """The stripped text of a secret file (as `read` checks it); `KeyedError` naming `key`
    if it is unusable."""
    try:
        return read(path)
    except SecretFileError as exc:
        raise KeyedError(key, str(exc)) from None


def readable_file(path: Path, key: str) -> Path:
    """`path` if it names a readable regular file (a CA bundle); `KeyedError` naming `key`
    otherwise."""
    if not path.is_file():
        raise KeyedError(key, f"not a readable file: {path}")
    return path
