"""Secret files, and the sink's bearer token that follows its file when an operator rotates it.

A token file is rewritten in place (a new token written to a temporary file, then renamed over
the old one, as operators and Kubernetes' projected secrets do); `TokenFile` notices by the
file's (mtime, size, inode), looked at no more than once per `interval_s` on the hot path, and
at once when the sink refuses the token (401/403). A file that became unreadable or empty keeps
the token in use, with one warning. No token value is ever logged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from relayd.logs import get_logger

# How often, at most, a request looks at the token file.
CHECK_INTERVAL_S = 1.0

_Signature = tuple[int, int, int]


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message names the file, never its content."""


def read_secret_file(path: Path) -> str:
    """The stripped text of a secret file; `SecretFileError` if it is unreadable or empty."""
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SecretFileError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SecretFileError(f"{path} is not UTF-8 text") from None
    if not value:
        raise SecretFileError(f"{path} is empty")
    return value


class TokenFile:
    """The current token of one token file.

    `value` is the hot path: a monotonic-clock comparison, and a stat at most once per
    `interval_s`; the file is read again only when its signature changed (or while it is
    unusable, so that fixing its permissions is noticed too). `refresh` looks now: the sink
    calls it on every 401/403.
    """

    def __init__(
        self,
        path: Path,
        token: str,
        *,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._token = token
        self._interval_s = interval_s
        self._clock = clock
        # Unknown until the first look: the file may have changed since the config was read.
        self._signature: _Signature | None = None
        self._checked_at = float("-inf")
        self._unusable = False

    @property
    def value(self) -> str:
        """The token to send now (the file is looked at if the last look is old enough)."""
        if self._clock() - self._checked_at >= self._interval_s:
            self.refresh()
        return self._token

    def refresh(self) -> bool:
        """Look at the file now; True if it holds a new token, used from now on."""
        self._checked_at = self._clock()
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            self._failed(f"cannot read {self.path}: {exc.strerror}")
            return False
        signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if signature == self._signature and not self._unusable:
            return False
        try:
            token = read_secret_file(self.path)
        except SecretFileError as exc:
            self._failed(str(exc))
            return False
        self._signature = signature
        if self._unusable:
            self._unusable = False
            get_logger("sink").info("sink.token_readable", path=str(self.path))
        if token == self._token:
            return False
        self._token = token
        get_logger("sink").info("sink.token_reloaded", path=str(self.path))
        return True

    def _failed(self, reason: str) -> None:
        """Keep the token in use; warn once until the file is usable again."""
        if not self._unusable:
            self._unusable = True
            get_logger("sink").warning(
                "sink.token_unreadable", path=str(self.path), error=reason, kept="previous token"
            )
