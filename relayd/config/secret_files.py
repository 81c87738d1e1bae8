"""Secret files, and the sink's bearer token that follows its file when an operator rotates it.

A secret file is read only if it is a regular file of at most `SECRET_MAX_BYTES`: a FIFO, a
device, a directory or a socket is refused without being read (a FIFO would block its reader
until someone writes, `/dev/zero` never ends). A token must also be sendable as a bearer
header value (`bearer_problem`).

A token file is rewritten in place (a new token written to a temporary file, then renamed over
the old one, as operators and Kubernetes' projected secrets do); `TokenFile` notices by the
file's (mtime, size, inode), looked at no more than once per `interval_s` on the hot path, and
at once when the sink refuses the token (401/403). The bound holds for every request, however
long the sink was idle: a request that starts more than `interval_s` after the file changed
waits for a look begun after the change (up to `LOOK_WAIT_S`), so it sends the new token. Each
look runs in a thread of its own, one at a time, so a file system that hangs its reader never
holds the event loop. A file that became unusable (unreadable, empty, not a regular file, too
large, not a bearer token) keeps the token in use, with one warning. No token value is ever
logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from relayd.telemetry.logs import get_logger

# How often, at most, a request looks at the token file.
CHECK_INTERVAL_S = 1.0
# How long a request waits for a look at a file whose last look is older than the interval;
# a look that takes longer (a file system that hangs) lets requests go on with the token in
# use rather than hold them all.
LOOK_WAIT_S = 1.0
# The largest secret file read. A DSN is well under 1 KiB and the largest bearer tokens in use
# (JWTs carrying many claims or a certificate chain) are a few KiB; HTTP servers refuse a
# header much over 8-16 KiB anyway. 64 KiB leaves room for any real secret while a file
# larger than that is a wrong path (a log, a binary), not a secret.
SECRET_MAX_BYTES = 64 * 1024

_Signature = tuple[int, int, int]
# What a file's text must be to be used: the text to use, or `SecretFileError` saying why not.
_Check = Callable[[Path, str], str]
_T = TypeVar("_T")

_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message names the file, never its content."""


def read_secret_file(path: Path) -> str:
    """The stripped text of a secret file; `SecretFileError` if it is unusable (see the
    module docstring) or empty. Never blocks on a file that is not a regular one."""
    return _secret_text(path, _read_regular(path)[0])


def read_token_file(path: Path) -> str:
    """The bearer token a token file holds; `SecretFileError` if the file is unusable or its
    content cannot be sent as a bearer token."""
    return _checked_token(path, read_secret_file(path))


def bearer_problem(token: str) -> str | None:
    """Why `token` cannot be sent as `Authorization: Bearer <token>`, or None if it can.

    One rule: a token is visible ASCII only (0x21-0x7E), with no whitespace inside it. A
    control character (a line break from a token followed by a comment line, a CR, a NUL)
    would make the HTTP client refuse to build every request; whitespace or a non-ASCII
    character does not form a bearer token (RFC 6750) and servers differ on what they do
    with it. The answer names the kind and position of the first such character, never a
    character of the token itself.
    """
    for position, char in enumerate(token, start=1):
        if "!" <= char <= "~":
            continue
        if char in "\r\n":
            kind = "a line break"
        elif char in " \t":
            kind = "whitespace"
        elif char < " " or char == "\x7f":
            kind = "a control character"
        else:
            kind = "a non-ASCII character"
        return f"{kind} at character {position} (a token is one line of visible ASCII)"
    return None


def _checked_token(path: Path, token: str) -> str:
    problem = bearer_problem(token)
    if problem is not None:
        raise SecretFileError(f"{path} does not hold a bearer token: {problem}")
    return token


def _secret_text(path: Path, data: bytes) -> str:
    try:
        value = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SecretFileError(f"{path} is not UTF-8 text") from None
    if not value:
        raise SecretFileError(f"{path} is empty")
    return value


def _not_regular(path: Path, mode: int) -> SecretFileError | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
    return SecretFileError(f"{path} is {kind}, not a regular file")


def _read_regular(path: Path) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file of at most SECRET_MAX_BYTES, and its fstat.

    The path is stat'ed first, so that a device is never even opened; it is then opened
    non-blocking (a FIFO swapped in after the stat opens at once instead of waiting for a
    writer) and checked again on the descriptor, which is what is read.
    """
    try:
        refused = _not_regular(path, os.stat(path).st_mode)
        if refused is not None:
            raise refused
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretFileError(f"cannot read {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        refused = _not_regular(path, info.st_mode)
        if refused is not None:
            raise refused
        chunks: list[bytes] = []
        size = 0
        # The size is read, not trusted from fstat: the file may grow while it is read.
        while size <= SECRET_MAX_BYTES:
            chunk = os.read(fd, SECRET_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > SECRET_MAX_BYTES:
            raise SecretFileError(f"{path} is larger than {SECRET_MAX_BYTES} bytes")
        return b"".join(chunks), info
    except OSError as exc:
        raise SecretFileError(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class _Look:
    """What one look at a token file found: nothing new (no field set), a token with the
    signature of the file it was read from, or why the file cannot be used."""

    token: str | None = None
    signature: _Signature | None = None
    error: str | None = None


def _signature(info: os.stat_result) -> _Signature:
    return (info.st_mtime_ns, info.st_size, info.st_ino)


def _look_at(path: Path, known: _Signature | None, check: _Check) -> _Look:
    """Stat the file; read it if its signature is not `known`. Never raises."""
    try:
        if _signature(os.stat(path)) == known:
            return _Look()
        data, info = _read_regular(path)
        return _Look(token=check(path, _secret_text(path, data)), signature=_signature(info))
    except OSError as exc:
        return _Look(error=f"cannot read {path}: {exc.strerror}")
    except SecretFileError as exc:
        return _Look(error=str(exc))
    except Exception as exc:  # a look must end in a value: its waiter is a request
        return _Look(error=f"cannot read {path}: {type(exc).__name__}")


def _off_loop(function: Callable[[], _T]) -> asyncio.Future[_T]:
    """Run `function` (which must not raise) in a daemon thread of its own; its result
    arrives on the calling loop. A dedicated daemon thread, not the loop's executor: a read
    stuck in a file system holds neither a shared worker thread nor, at exit, the process."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def deliver(result: _T) -> None:
        if not future.done():
            future.set_result(result)

    def run() -> None:
        result = function()
        with contextlib.suppress(RuntimeError):  # the loop closed while the thread ran
            loop.call_soon_threadsafe(deliver, result)

    threading.Thread(target=run, name="relayd-token-file", daemon=True).start()
    return future


class TokenFile:
    """The current token of one token file.

    `current()` is the hot path: a monotonic-clock comparison, and a look (a stat, off the
    loop) at most once per `interval_s`; the file is read again only when its signature
    changed (or while it is unusable, so that fixing its permissions is noticed too). Every
    request made while the last finished look is older than `interval_s` waits for the next
    look (one, shared), so none sends a token older than that after a change; a look that
    hangs holds them at most `LOOK_WAIT_S`, then they go on with the token in use.
    `refresh()` looks now: the sink calls it on every 401/403, and the request after it
    sends what the file holds.

    `check` decides what the file may hold: a bearer token unless told otherwise (the
    webhook sink's signing secrets are checked by their own rules).
    """

    def __init__(
        self,
        path: Path,
        token: str,
        *,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        check: _Check = _checked_token,
    ) -> None:
        self.path = path
        self._check = check
        self._token = token
        self._interval_s = interval_s
        self._clock = clock
        # Unknown until the first look: the file may have changed since the config was read.
        self._signature: _Signature | None = None
        # When the last finished look began: the token is as fresh as that.
        self._seen_at = float("-inf")
        self._unusable = False
        # The look under way, if any: never more than one thread reads the file.
        self._look: asyncio.Future[_Look] | None = None

    def fresh(self) -> str | None:
        """The token `current()` would return without waiting, or None when it would wait
        for a look: what a caller asks first, to await nothing in the usual case."""
        if self._clock() - self._seen_at < self._interval_s:
            return self._token
        return None

    async def current(self) -> str:
        """The token to send now: the one in use, unless the last finished look began
        `interval_s` ago or more; then after a look (begun now, or under way)."""
        if self._clock() - self._seen_at < self._interval_s:
            return self._token  # the usual case, asked for every request
        try:
            async with asyncio.timeout(LOOK_WAIT_S):
                # A look under way may have begun long before this request: after it, look
                # again until one that began within the interval has finished.
                while self._clock() - self._seen_at >= self._interval_s:
                    await self._look_now()
        except TimeoutError:
            pass  # a look that hangs: go on with the token in use (see the class docstring)
        return self._token

    async def refresh(self) -> bool:
        """Look at the file now; True if it holds a new token, used from now on. A look
        already under way may have seen the file before the rotation that prompted this
        call: it is waited for, then the file is looked at again."""
        before = self._token
        await self._applied()
        await self._look_now()
        return self._token != before

    async def _look_now(self) -> None:
        """Start a look unless one is under way, and wait until its result is applied."""
        if self._look is None:
            began = self._clock()
            known = None if self._unusable else self._signature
            self._look = _off_loop(functools.partial(_look_at, self.path, known, self._check))
            # Registered before any waiter's own callback, so the result is applied before
            # a waiter resumes.
            self._look.add_done_callback(functools.partial(self._apply, began))
        await self._applied()

    async def _applied(self) -> None:
        """Wait until the look under way, if any, has ended and its result is applied.
        Shielded: a request cut by its deadline leaves the look to finish and be applied."""
        look = self._look
        if look is None:
            return
        await asyncio.shield(look)
        if self._look is look:
            # Ended, but not applied yet: its callback is queued behind this request (which
            # was queued before the look ended). A done future is awaited without yielding,
            # so a request that loops until the result is applied would hold the loop for
            # ever; yield once, and the callback runs first.
            await asyncio.sleep(0)

    def _apply(self, began: float, look: asyncio.Future[_Look]) -> None:
        self._look = None
        if look.cancelled():
            return
        self._seen_at = max(self._seen_at, began)
        found = look.result()
        if found.error is not None:
            self._failed(found.error)
            return
        if found.token is None:
            return
        self._signature = found.signature
        if self._unusable:
            self._unusable = False
            get_logger("sink").info("sink.token_readable", path=str(self.path))
        if found.token != self._token:
            self._token = found.token
            get_logger("sink").info("sink.token_reloaded", path=str(self.path))

    def _failed(self, reason: str) -> None:
        """Keep the token in use; warn once until the file is usable again."""
        if not self._unusable:
            self._unusable = True
            get_logger("sink").warning(
                "sink.token_unreadable", path=str(self.path), error=reason, kept="previous token"
            )
