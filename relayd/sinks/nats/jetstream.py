"""The NATS sink's exchanges with JetStream over the process's connection
(`relayd/sinks/nats/connection.py`): a publish and its reply, an API request, a stored message
read back, the server's and the stream's facts; each failure the client raises turned into an
outcome (`relayd/sinks/nats/answers.py`) and each exchange counted for
`relayd_sink_requests_total`. nats-py's exceptions stop here."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from relayd.core.outcomes import Outcome, SinkDown
from relayd.sinks import ExchangeObserver
from relayd.sinks.nats.answers import Refused, classify_exception, read_facts, reply_code
from relayd.sinks.nats.connection import NatsConnection
from relayd.sinks.nats.dedupe import StreamFacts
from relayd.sinks.nats.message import NatsMessage

API_PREFIX = "$JS.API"


class JetStream:
    """One stream's exchanges, each within `timeout_s`."""

    def __init__(
        self,
        connection: NatsConnection,
        *,
        stream: str,
        timeout_s: float,
        observe: ExchangeObserver | None = None,
    ) -> None:
        self._connection = connection
        self._stream = stream
        self._timeout_s = timeout_s
        self._observe = observe

    async def request(self, message: NatsMessage) -> Msg | Outcome:
        """One publish and its reply, or the outcome of its failure."""
        try:
            return await self._connection.inbox.request(
                message.subject, message.body, message.headers, timeout_s=self._timeout_s
            )
        except (nats.errors.Error, Refused) as exc:
            self.note("publish", failure_code(exc))
            return self.classified(exc, message.subject)
        except asyncio.CancelledError:
            self.note("publish", "timeout")  # the attempt's deadline cut the exchange
            raise

    async def api(self, operation: str, subject: str, payload: bytes) -> bytes | SinkDown:
        """One JetStream API request (`operation` names it for the metric): its reply's
        bytes, or the failure."""
        try:
            reply = await self._connection.inbox.request(
                subject, payload, None, timeout_s=self._timeout_s
            )
        except (nats.errors.Error, Refused) as exc:
            self.note(operation, failure_code(exc))
            failure = self.classified(exc, subject)
            return failure if isinstance(failure, SinkDown) else SinkDown(str(failure))
        except asyncio.CancelledError:
            self.note(operation, "timeout")
            raise
        self.note(operation, reply_code(reply.data))
        return reply.data

    async def msg_get(self, request: dict[str, Any]) -> bytes | SinkDown:
        """A stored message, by sequence (`{"seq": n}`) or last on a subject
        (`{"last_by_subj": subject}`)."""
        return await self.api(
            "msg_get",
            f"{API_PREFIX}.STREAM.MSG.GET.{self._stream}",
            json.dumps(request).encode(),
        )

    async def account_info(self) -> bytes | SinkDown:
        return await self.api("account_info", f"{API_PREFIX}.INFO", b"")

    async def stream_info(self) -> bytes | SinkDown:
        return await self.api("stream_info", f"{API_PREFIX}.STREAM.INFO.{self._stream}", b"")

    async def read_facts(self) -> StreamFacts | SinkDown:
        """The server's API level and the stream's configuration, read now."""
        account = await self.account_info()
        stream = await self.stream_info()
        return read_facts(account, stream, stream_name=self._stream)

    def classified(self, exc: BaseException, subject: str) -> Outcome:
        """A failure the client raised, as an outcome, with the connection's state."""
        return classify_exception(exc, subject=subject, link=self._connection.link())

    def note(self, operation: str, code: str) -> None:
        if self._observe is not None:
            self._observe(operation, code)


def failure_code(exc: BaseException) -> str:
    """An exchange that got no answer, as `relayd_sink_requests_total` labels it."""
    if isinstance(exc, nats.errors.TimeoutError):
        return "timeout"
    if isinstance(exc, nats.errors.NoRespondersError):
        return "no_responders"
    if isinstance(exc, Refused):
        return "refused"
    return "error"
