"""What every operator command shares: the handler's shape and where its parser is added, the
store opened for one command, the actor, checked input, one-line errors."""

from __future__ import annotations

import contextlib
import enum
import functools
import getpass
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from relayd.core.errors import EXIT_FAILURE, EXIT_USAGE, PrivilegeError, StatementError
from relayd.core.outcomes import CONTROL_CHARS
from relayd.settings import Settings
from relayd.store.privileges import Role, hint

if TYPE_CHECKING:
    import argparse

    from relayd.store import Store

    # Where a module's `add_commands(commands, common)` adds its subcommands; `common` is
    # the parent parser of the options every subcommand takes (`--config`).
    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

# A command's handler: its parsed arguments in, its exit code out.
Handler = Callable[["argparse.Namespace"], int]

_MAX_ACTOR_CHARS = 200
_QUOTED_CHARS = 60  # an operator's input quoted in an error line


class BadInput(ValueError):
    """An option or argument the command cannot use: one line on stderr, exit 2."""


def operator_command(name: str) -> Callable[[Handler], Handler]:
    """Turn a command's expected failures into one stderr line and its exit code: bad input
    2, a statement PostgreSQL refused 1 (a missing grant: naming the privilege and the
    object). Configuration, schema and connection failures are `relayd.cli.main`'s (2, 1
    and 1)."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except BadInput as exc:
                fail(f"{name}: {exc}")
                return EXIT_USAGE
            except PrivilegeError as exc:
                fail(f"{name}: {exc}; {hint(Role.OPERATOR)}")
                return EXIT_FAILURE
            except StatementError as exc:
                fail(f"{name}: the database refused the statement {exc}")
                return EXIT_FAILURE

        return run

    return decorate


def fail(message: str) -> None:
    """A command's one line on stderr."""
    sys.stderr.write(f"relayd: {message}\n")


class Needs(enum.Enum):
    """What a command needs of the outbox before it starts, checked once connected (a
    `SchemaError` otherwise: one line, exit 1)."""

    NOTHING = enum.auto()  # `doctor` and `check` report what they find
    CURRENT = enum.auto()  # `status`: every migration this relayd ships
    OPERATOR = enum.auto()  # `dlq`, `held`, `pause`: the dead-letter, pause and audit tables
    # `keys`, `dlq retry`: those, and ordered delivery's columns and parked keys (0011)
    ORDERED = enum.auto()


@contextlib.asynccontextmanager
async def command_store(
    settings: Settings, *, needs: Needs = Needs.OPERATOR, connect_timeout_s: float | None = None
) -> AsyncIterator[Store]:
    """A small pool on the outbox for one command, closed when it is done; no waiting for
    PostgreSQL, unlike `relayd run`, since an operator asked now."""
    # asyncpg, and the migrations, only for the commands that use them.
    from relayd.store import Store  # noqa: PLC0415
    from relayd.store.migrations import require_current  # noqa: PLC0415

    store = await Store.for_command(settings, connect_timeout_s=connect_timeout_s)
    try:
        if needs is Needs.CURRENT:
            await require_current(store)
        elif needs in (Needs.OPERATOR, Needs.ORDERED):
            await store.check_operator_schema()
            if needs is Needs.ORDERED:
                await store.check_ordering_schema()
        yield store
    finally:
        await store.close()


def resolve_actor(given: str | None) -> str:
    """Who acts, for the audit trail: `--actor NAME`, else the OS user."""
    if given is not None:
        return check_text(given, "--actor", _MAX_ACTOR_CHARS)
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (a bare container)
        return f"uid {os.getuid()}"


def check_text(value: str, option: str, most: int) -> str:
    """A free-text option: not blank, at most `most` characters, on one line."""
    text = value.strip()
    if not text:
        raise BadInput(f"{option}: must not be empty")
    if len(text) > most:
        raise BadInput(f"{option}: at most {most} characters, got {len(text)}")
    if CONTROL_CHARS.search(text):
        raise BadInput(f"{option}: must be one line without control characters")
    return text


def parse_count(value: str | None, option: str, default: int, most: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise BadInput(f"{option}: expected a whole number, got {quote(value)}") from None
    if not 1 <= number <= most:
        raise BadInput(f"{option}: must be from 1 to {most}, got {number}")
    return number


def parse_ids(values: Sequence[str]) -> list[str]:
    """Event ids as PostgreSQL prints them (lowercase), duplicates dropped, order kept."""
    ids: dict[str, None] = {}
    for value in values:
        try:
            ids[str(uuid.UUID(value.strip()))] = None
        except ValueError:
            raise BadInput(f"ID: not a UUID: {quote(value)}") from None
    return list(ids)


def quote(value: str) -> str:
    """An operator's input, quoted in an error line: bounded, controls escaped by repr."""
    return repr(value if len(value) <= _QUOTED_CHARS else value[: _QUOTED_CHARS - 3] + "...")
