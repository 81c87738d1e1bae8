"""relayd's publish (relayd/sinks/nats/wire.py) writes what nats-py's `Client.publish`
writes: the same HPUB command, header block and body, as a subscriber of a real nats-server
receives them. The subscriber speaks the protocol over a plain socket, so that the bytes
compared are the ones the server forwarded, not a client library's reading of them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from relayd.core.envelope import Envelope
from relayd.sinks.nats import wire
from relayd.sinks.nats.message import NatsMessage, Route, Routes, message_for
from relayd.testing.nats import NatsServer

SUBJECT = "events.orders"
REPLY = "_INBOX.test.1"
EVENT_ID = "0190f3a0-1111-7222-8333-444455556666"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
DEADLINE_S = 10.0


class RawSubscriber:
    """A subscription read straight off the socket: each message as the server wrote it
    (its HMSG line with the subscription id taken out, then its header block and body)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def next_message(self) -> bytes:
        async with asyncio.timeout(DEADLINE_S):
            while True:
                line = await self._reader.readline()
                if line.startswith(b"PING"):
                    self._writer.write(b"PONG\r\n")
                    continue
                if line.startswith(b"HMSG") or line.startswith(b"MSG"):
                    break
            fields = line.split()
            size = int(fields[-1])
            data = await self._reader.readexactly(size + 2)  # the frame and its CRLF
        return b" ".join([fields[0], fields[1], *fields[3:]]) + b"\r\n" + data


@pytest.fixture
async def raw(nats_server: NatsServer) -> AsyncIterator[RawSubscriber]:
    reader, writer = await asyncio.open_connection("127.0.0.1", nats_server.port)
    try:
        async with asyncio.timeout(DEADLINE_S):
            await reader.readline()  # INFO
            connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True}
            writer.write(f"CONNECT {json.dumps(connect)}\r\n".encode())
            writer.write(f"SUB {SUBJECT} 1\r\nPING\r\n".encode())
            await writer.drain()
            while not (await reader.readline()).startswith(b"PONG"):
                pass  # the subscription is in place once the PING is answered
        yield RawSubscriber(reader, writer)
    finally:
        writer.close()


@pytest.fixture
async def client(nats_server: NatsServer) -> AsyncIterator[Client]:
    # Connected as the sink connects: no reconnect buffer, subjects checked by relayd.
    connected = await nats.connect(nats_server.url, pending_size=0, skip_subject_validation=True)
    yield connected
    await connected.close()


def event_message() -> NatsMessage:
    job = {
        "id": EVENT_ID,
        "type": "order.updated",
        "args": [{"order": 7, "note": "café"}],
        "meta": {
            "version": 1,
            "occurred_at": "2024-05-01T12:00:00Z",
            "traceparent": TRACEPARENT,
            "tracestate": "vendor=a,other=b",
        },
    }
    message = message_for(
        Envelope.parse(json.dumps(job), EVENT_ID),
        Routes([Route("order.updated", SUBJECT)]),
        stream="EVENTS",
        source="/orders service",
        max_body_bytes=1024,
    )
    assert isinstance(message, NatsMessage)
    return message


async def both(
    client: Client, raw: RawSubscriber, headers: Mapping[str, str], body: bytes
) -> tuple[bytes, bytes]:
    """What the server forwarded of nats-py's publish, then of relayd's, of one message."""
    await client.publish(SUBJECT, body, reply=REPLY, headers=dict(headers))
    theirs = await raw.next_message()
    await wire.publish(client, SUBJECT, body, reply=REPLY, headers=headers)
    ours = await raw.next_message()
    return theirs, ours


async def test_an_event_is_the_bytes_nats_py_sends(client: Client, raw: RawSubscriber) -> None:
    """A message of the sink (eleven headers, the trace context) is forwarded as the same
    bytes, whichever publishes it."""
    message = event_message()
    assert wire.QUEUES_COMMANDS  # the path under test, not the fallback to nats-py's own
    theirs, ours = await both(client, raw, message.headers, message.body)
    assert theirs.startswith(b"HMSG " + SUBJECT.encode())
    assert f"Nats-Msg-Id: {EVENT_ID}\r\n".encode() in ours
    assert ours == theirs


@pytest.mark.parametrize(
    "headers",
    [
        {"Padded-Name ": " padded value "},
        {"Broken": "line one\r\nline two\rthree\nfour"},
        {" ": "an empty name is skipped", "Kept": "yes"},
        {"Unicode": "zürich ✓"},
        {"Nul": "a\x00b", "Tab": "\tx\t"},
        {"Empty": ""},
    ],
    ids=["padded", "newlines", "empty-name", "unicode", "controls", "empty-value"],
)
async def test_headers_are_cleaned_as_nats_py_cleans_them(
    client: Client, raw: RawSubscriber, headers: dict[str, str]
) -> None:
    """Names and values nats-py trims, skips or rewrites come out the same."""
    theirs, ours = await both(client, raw, headers, b"{}")
    assert ours == theirs


async def test_a_name_nats_py_refuses_is_refused(client: Client) -> None:
    """A header name that is not a token raises nats-py's own error, and nothing is sent."""
    for publish in (
        client.publish(SUBJECT, b"{}", reply=REPLY, headers={"Bad Name": "x"}),
        wire.publish(client, SUBJECT, b"{}", reply=REPLY, headers={"Bad Name": "x"}),
    ):
        with pytest.raises(nats.errors.BadHeaderError, match="Bad Name"):
            await publish
    assert wire.header_block({"Good": "x"}) == b"NATS/1.0\r\nGood: x\r\n\r\n"


async def test_a_closed_client_refuses_as_nats_py_does(client: Client) -> None:
    """A publish on a closed connection raises the error nats-py's publish raises."""
    await client.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await wire.publish(client, SUBJECT, b"{}", reply=REPLY, headers={"A": "b"})
