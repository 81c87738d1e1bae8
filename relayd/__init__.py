"""relayd: publishes the committed rows of a PostgreSQL transactional outbox to an Open Job
Spec server, NATS JetStream or Standard Webhooks endpoints, at least once.

What an application needs to append events is here (docs/producers.md): `define_event`,
`Outbox`, `append` (asyncpg; `relayd.producer.psycopg` and `relayd.producer.sqlalchemy` for
the other drivers) and the errors `append` raises.
"""

from relayd.core import __version__
from relayd.producer import (
    AppendError,
    Event,
    EventIdConflict,
    EventTooLarge,
    EventType,
    InvalidEvent,
    MissingKey,
    NoRoute,
    NotInTransaction,
    Outbox,
    append,
    define_event,
    new_job,
)

__all__ = [
    "AppendError",
    "Event",
    "EventIdConflict",
    "EventTooLarge",
    "EventType",
    "InvalidEvent",
    "MissingKey",
    "NoRoute",
    "NotInTransaction",
    "Outbox",
    "__version__",
    "append",
    "define_event",
    "new_job",
]
