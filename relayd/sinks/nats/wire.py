"""A publish with headers as relayd writes it: the bytes nats-py's `Client.publish` would
write, with less work per message.

nats-py checks every header name against a regular expression and cleans every value on
every publish; relayd's messages carry about a dozen headers whose names never change, and
that work was a sixth of the NATS sink's CPU. Here each name is checked once per process,
each value is cleaned as nats-py cleans it (trimmed, CR and LF turned into spaces), the
block is built as one string, and the HPUB command, made by nats-py's own `hpub_cmd`, is
queued on the client's writer as `Client.publish` queues it. That needs two members of the
client that are not its public API (`_send_command`, `_flush_pending`): where they are
missing (another nats-py), `publish` is nats-py's own. The bytes on the wire are the same
either way (tests/integration/sinks/nats/test_wire.py compares them through a server).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import nats.errors
from nats.aio.client import Client
from nats.protocol.command import hpub_cmd

# nats-py's rules (nats/aio/client.py, 2.16): a header name is an RFC 7230 token, trimmed
# first, and an empty one is skipped; a value is trimmed, and CR or LF in it becomes a space.
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_STATUS_LINE = "NATS/1.0\r\n"
# Header names are relayd's own constants and a route's few: a bound, not a limit in use.
_MAX_NAMES = 256

# By name as given: "Name: " as written, or "" for a name nats-py skips (empty once trimmed).
_names: dict[str, str] = {}

# Whether this nats-py's client queues commands as 2.x does; if not, nats-py publishes.
QUEUES_COMMANDS = all(
    callable(getattr(Client, member, None)) for member in ("_send_command", "_flush_pending")
)


def header_block(headers: Mapping[str, str]) -> bytes:
    """The header block nats-py writes for `headers`; `nats.errors.BadHeaderError` for a
    name it refuses."""
    parts = [_STATUS_LINE]
    for name, raw in headers.items():
        prefix = _names.get(name)
        if prefix is None:
            prefix = _checked(name)
        if not prefix:
            continue
        value = raw.strip()
        if "\r" in value or "\n" in value:
            value = value.translate(_NEWLINES)
        parts += (prefix, value, "\r\n")
    parts.append("\r\n")
    return "".join(parts).encode()


def _checked(name: str) -> str:
    key = name.strip()
    if key and not _NAME.fullmatch(key):
        raise nats.errors.BadHeaderError(key)
    prefix = f"{key}: " if key else ""
    if len(_names) < _MAX_NAMES:
        _names[name] = prefix
    return prefix


async def publish(
    client: Client, subject: str, payload: bytes, *, reply: str, headers: Mapping[str, str]
) -> None:
    """`client.publish(subject, payload, reply=reply, headers=headers)` for a client
    connected as relayd connects (subjects checked by relayd, no reconnect buffer): the same
    errors, the same command on the wire."""
    flush_queue = getattr(client, "_flush_queue", None)
    if not QUEUES_COMMANDS or flush_queue is None:
        await client.publish(subject, payload, reply=reply, headers=dict(headers))
        return
    if client.is_closed:
        raise nats.errors.ConnectionClosedError
    if client.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not client.is_connected:
        raise nats.errors.OutboundBufferLimitError  # no reconnect buffer: nothing is queued
    if len(payload) > client.max_payload:
        raise nats.errors.MaxPayloadError
    if not subject:
        raise nats.errors.BadSubjectError
    command = hpub_cmd(subject, reply, header_block(headers), payload)
    client.stats["out_msgs"] += 1
    client.stats["out_bytes"] += len(payload)
    await client._send_command(command)  # not public: see the module's docstring
    if flush_queue.empty():
        await client._flush_pending()  # wakes the writer, as publish does
