"""What a producer's append can fail with: one tree under `AppendError`, re-exported by
`relayd.producer` (and `relayd`), and the ordering key's own check."""

from __future__ import annotations

from relayd.core.errors import RelaydError

# The table refuses an ordering key outside 1 to this many characters
# (relayd_ordering_key_length, migrations/0011_ordering.sql).
MAX_KEY_CHARS = 256


class AppendError(RelaydError):
    """The event cannot be appended; nothing was written."""


class NotInTransaction(AppendError):
    """The connection is in no transaction: the event would commit alone."""


class InvalidEvent(AppendError, ValueError):
    """An envelope the outbox table's checks or the relay would refuse."""


class EventTooLarge(AppendError):
    """An envelope, or the message a sink would send for it, over the sink's bound."""


class NoRoute(AppendError):
    """The NATS sink has no route for the event's type and version."""


class MissingKey(AppendError):
    """The event's route is ordered (`ordering = "key"`) and the event has no ordering key:
    the relay would dead-letter it."""


class EventIdConflict(AppendError):
    """The outbox already holds a different envelope, or the same envelope under another
    ordering key, under the event's id."""

    def __init__(self, event_id: str) -> None:
        super().__init__(
            f"event {event_id} is already in the outbox with a different envelope or ordering "
            "key (an id is appended once; a new event needs a new id)"
        )
        self.event_id = event_id


def checked_key(key: object, what: str = "the ordering key") -> str:
    """`key` as the outbox stores it in `ordering_key`, or `InvalidEvent` saying what the
    table would refuse of it (`what` names it in the message; the key itself is not
    repeated: it is the application's data)."""
    if not isinstance(key, str):
        raise InvalidEvent(
            f"{what} must be a str, not {'None' if key is None else type(key).__name__}"
        )
    if not key:
        raise InvalidEvent(f"{what} is empty: a key is 1 to {MAX_KEY_CHARS} characters")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidEvent(
            f"{what} is {len(key)} characters long: a key is 1 to {MAX_KEY_CHARS} characters"
        )
    if "\x00" in key:
        raise InvalidEvent(f"{what} holds the NUL character, which PostgreSQL text refuses")
    try:
        key.encode()
    except UnicodeEncodeError:
        raise InvalidEvent(f"{what} holds a lone surrogate, which is not UTF-8") from None
    return str(key)  # a subclass of str, as the plain str the driver sends
