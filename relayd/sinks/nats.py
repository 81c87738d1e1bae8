"""The NATS sink's transport: one nats-py connection per process, a JetStream publish per
row (the relay runs a claim's rows concurrently, up to `sink.concurrency`) in its route's
dedupe mode (the event alone, expecting its own subject empty, or in an atomic batch with
its marker: `relayd/sinks/nats_dedupe.py`), the stored message read back after a
duplicate's PubAck or a "wrong last sequence", and `relayd check`'s look at the stream.

What each answer means is decided in `relayd/sinks/nats_answers.py`, what is sent in
`relayd/sinks/nats_message.py`; nats-py's exceptions stop here, turned into outcome values.
No text leaves the sink with a credential in it: the client is given secrets, never asked
to print them, and failures are named by type.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from relayd import __version__
from relayd.logs import get_logger
from relayd.models import (
    ClaimedRow,
    DeadLetter,
    DeadReason,
    Envelope,
    NotFound,
    NotStarted,
    Outcome,
    Published,
    RetryLater,
    SinkDown,
)
from relayd.sinks import Capabilities, ExchangeObserver, SinkHealth
from relayd.sinks.nats_answers import (
    Duplicate,
    classify_ack,
    classify_batch_event,
    classify_connect_failure,
    classify_exception,
    classify_marker_reply,
    classify_stored,
    read_facts,
    reply_code,
    stream_verdict,
)
from relayd.sinks.nats_dedupe import (
    ATOMIC_DISABLED,
    BATCH_DUPLICATE_ID,
    EXPECTED_LAST_SUBJECT_SEQ,
    MarkerFound,
    Mode,
    StreamFacts,
    Taken,
    atomic_batch,
    expecting_new_subject,
    mode_for,
    needs_facts,
    past_window,
    past_window_dead_letter,
)
from relayd.sinks.nats_message import NatsMessage, message_for
from relayd.sinks.nats_settings import NatsSettings

API_PREFIX = "$JS.API"
# How often the client pings an idle connection, and how many pings may go unanswered: a
# connection that died without a word is noticed within about half a minute.
_PING_INTERVAL_S = 10
_MAX_OUTSTANDING_PINGS = 2
_RECONNECT_WAIT_S = 1
# How long the server's API level and the stream's configuration are trusted before they are
# read again (an operator may change the window or allow_atomic at any time).
_FACTS_TTL_S = 60.0


# Asked on every claim: one value.
_CAPABILITIES = Capabilities(batches=False, reconcile_by_id=False)


class NatsSink:
    """Publishes rows as events to one JetStream stream.

    Nothing is sent after the attempt's `send_by` (C4), and nothing is sent later than the
    moment it is handed over: the client's reconnect buffer is off (`pending_size=0`: a
    publish while disconnected fails at once, unsent), and commands queued but not yet
    written when a connection drops are discarded, not written after reconnecting.
    """

    def __init__(
        self,
        settings: NatsSettings,
        health: SinkHealth,
        *,
        observe: ExchangeObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        settings.require_routes()
        settings.target  # noqa: B018 - ConfigError naming sink.servers or sink.stream
        self._settings = settings
        self._stream = settings.stream_name
        self._routes = settings.route_table()
        self._health = health
        self._observe = observe
        self._clock = clock
        self._log = get_logger("sink")
        self._client: Client | None = None
        self._lock = asyncio.Lock()
        # The last connection failure and when it was decided: callers that waited for
        # that attempt share its verdict instead of each trying again in turn.
        self._failure: tuple[float, SinkDown] | None = None
        self._last_error: BaseException | None = None
        # A refusal an operator must fix (credentials, a certificate), once seen while
        # connecting: a later reset of the same attempt must not hide it.
        self._severe_error: BaseException | None = None
        self._last_logged = ""
        self._closing = False
        # What the server and the stream reported, and until when (clock) it is trusted.
        self._facts: tuple[float, StreamFacts] | None = None
        self._facts_failure: tuple[float, SinkDown] | None = None
        self._facts_lock = asyncio.Lock()

    @property
    def capabilities(self) -> Capabilities:
        # One request per row: the relay runs them concurrently. A stream is asked by
        # sequence or subject, never by message id, so an unanswered publish is re-sent with
        # the same id; the route's mode keeps the stream from storing it twice, or the
        # window and sink.past_window decide (docs/nats.md#deduplication).
        return _CAPABILITIES

    async def start(self) -> None:
        """Nothing to open yet: the connection is made by the first exchange, so a server
        that is down at start-up is a sink outage (the breaker), not a failed start."""

    async def close(self) -> None:
        self._closing = True
        client, self._client = self._client, None
        if client is not None:
            await _quietly_close(client)

    # --- the Sink interface ---

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        return [[row] for row in rows]

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, send_by: float
    ) -> dict[str, Outcome]:
        # One row per request (no batches), but a list is what the interface passes: each
        # row runs to its end before a failure of relayd's own is raised.
        results = await asyncio.gather(
            *(self._publish_row(row, envelopes[row.event_id], send_by) for row in rows),
            return_exceptions=True,
        )
        outcomes: dict[str, Outcome] = {}
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            outcomes[row.event_id] = result
        return outcomes

    async def reconcile(self, row: ClaimedRow, envelope: Envelope) -> Outcome | NotFound:
        """A stream cannot be asked by message id (capabilities: no reconcile_by_id)."""
        return NotFound()

    async def check(self) -> tuple[bool, str]:
        """Connect, then ask JetStream for the account and the stream: the stream exists,
        its subjects take every route's subject, and its duplicate window is shown."""
        client = await self._connection()
        if isinstance(client, SinkDown):
            return False, client.error
        account = await self._api(client, "account_info", f"{API_PREFIX}.INFO", b"")
        stream = await self._api(
            client, "stream_info", f"{API_PREFIX}.STREAM.INFO.{self._stream}", b""
        )
        return stream_verdict(
            account,
            stream,
            stream_name=self._stream,
            routes=self._routes.subjects,
            max_payload=client.max_payload,
            max_body_bytes=self._settings.max_payload_bytes,
            marker_prefix=self._settings.marker_prefix,
            horizon_s=self._settings.retry_horizon_s,
            past_window=self._settings.past_window,
        )

    # --- one row ---

    async def _publish_row(self, row: ClaimedRow, envelope: Envelope, send_by: float) -> Outcome:
        message = message_for(
            envelope,
            self._routes,
            stream=self._stream,
            source=self._settings.source,
            max_body_bytes=self._settings.max_payload_bytes,
        )
        if isinstance(message, DeadLetter):
            return message  # decided here, nothing sent: nothing to tell the breaker
        client = await self._connection()
        if isinstance(client, SinkDown):
            return self._noted(client)
        refused = self._over_max_payload(client, message)
        if refused is not None:
            return self._noted(refused) if isinstance(refused, SinkDown) else refused
        mode = await self._mode(client, row, message, send_by)
        if not isinstance(mode, Mode):
            return mode
        if asyncio.get_running_loop().time() > send_by:
            return NotStarted()
        if mode is Mode.ATOMIC_MARKER:
            outcome = await self._publish_batch(client, message, row.event_id, send_by)
        elif mode is Mode.ID_IN_SUBJECT:
            outcome = await self._publish_one(client, expecting_new_subject(message), row.event_id)
        else:
            outcome = await self._publish_one(client, message, row.event_id)
        return self._noted(outcome)

    async def _publish_one(self, client: Client, message: NatsMessage, event_id: str) -> Outcome:
        """The event alone; a publish expecting its subject empty learns whether it is."""
        reply = await self._request(client, message)
        if not isinstance(reply, Msg):
            return reply
        answer = classify_ack(
            reply.data,
            stream=self._stream,
            subject=message.subject,
            guarded=EXPECTED_LAST_SUBJECT_SEQ in message.headers,
        )
        if isinstance(answer, Duplicate):
            self._note("publish", "duplicate")
            return await self._read_back(client, answer.seq, message, event_id)
        self._note("publish", "ok" if isinstance(answer, Published) else reply_code(reply.data))
        if isinstance(answer, Taken):
            # The event's own subject holds a message: ours, stored by an earlier attempt
            # at any time before, or another's (a conflict).
            return await self._read_back(client, None, message, event_id)
        return answer

    async def _mode(
        self, client: Client, row: ClaimedRow, message: NatsMessage, send_by: float
    ) -> Mode | Outcome:
        """The route's dedupe mode (nats_dedupe), or why the row goes no further: the
        server's facts cannot be read (the sink's failure), or the row is past the window
        and `sink.past_window` dead-letters it (decided, like a re-send's warning, only for
        a row still due to be sent)."""
        if not needs_facts(message.route):
            return Mode.ID_IN_SUBJECT
        facts = await self._stream_facts(client)
        if isinstance(facts, SinkDown):
            return self._noted(facts)
        mode = mode_for(message.route, facts, marker_prefix=self._settings.marker_prefix)
        if mode is Mode.WINDOW and past_window(
            claimed_before=row.claimed_before,
            age_s=row.age_s,
            window_s=facts.duplicate_window_s,
            margin_s=self._settings.timeout_s,
        ):
            if asyncio.get_running_loop().time() > send_by:
                return NotStarted()
            refused = self._past_window(row, facts)
            if refused is not None:
                return refused
        return mode

    def _past_window(self, row: ClaimedRow, facts: StreamFacts) -> Outcome | None:
        """An ambiguous row the stream may have forgotten: `sink.past_window` decides."""
        window_s = facts.duplicate_window_s
        if self._settings.past_window == "dead_letter":
            self._note("past_window", "dead_letter")
            return past_window_dead_letter(row.age_s, window_s)
        self._note("past_window", "resend")
        self._log.warning(
            "sink.resending_past_window",
            event_id=row.event_id,
            age_s=round(row.age_s, 3),
            window_s=window_s,
        )
        return None

    async def _request(self, client: Client, message: NatsMessage) -> Msg | Outcome:
        """One publish and its reply, or the outcome of its failure."""
        try:
            return await client.request(
                message.subject,
                message.body,
                timeout=self._settings.timeout_s,
                headers=dict(message.headers),
            )
        except nats.errors.Error as exc:
            self._note("publish", _failure_code(exc))
            return classify_exception(exc, subject=message.subject)
        except asyncio.CancelledError:
            self._note("publish", "timeout")  # the attempt's deadline cut the exchange
            raise

    async def _publish_batch(  # noqa: PLR0911 - each answer to a batch is told apart
        self, client: Client, message: NatsMessage, event_id: str, send_by: float
    ) -> Outcome:
        """The marker and the event in one atomic batch: the marker goes first without a
        reply (the server answers only the commit), the event commits and is answered."""
        marker, event = atomic_batch(
            message,
            event_id=event_id,
            stream=self._stream,
            marker_prefix=self._settings.marker_prefix,
            batch_id=uuid.uuid4().hex,
        )
        try:
            await client.publish(marker.subject, marker.body, headers=dict(marker.headers))
        except nats.errors.Error as exc:
            self._note("publish", _failure_code(exc))
            return classify_exception(exc, subject=marker.subject)
        reply = await self._request(client, event)
        if not isinstance(reply, Msg):
            return reply
        answer = classify_ack(reply.data, stream=self._stream, subject=event.subject, guarded=True)
        code = reply_code(reply.data)
        self._note("publish", "ok" if isinstance(answer, Published) else code)
        if code == str(ATOMIC_DISABLED):
            self._facts = None  # the stream's configuration changed: read it again
        if code == str(BATCH_DUPLICATE_ID):
            # The stream holds the event's id, within its window, from a publish outside a
            # batch (before this route ran in this mode): the batch stored nothing. The
            # event alone gets the duplicate's PubAck, with the sequence to read back.
            if asyncio.get_running_loop().time() > send_by:
                return RetryLater(
                    f"the stream holds this event's id from a publish outside a batch "
                    f"(JetStream error {BATCH_DUPLICATE_ID}); the next attempt sends it alone"
                )
            return await self._publish_one(client, message, event_id)
        if isinstance(answer, Duplicate):  # a batch's answer never says so; kept honest
            return await self._read_back(client, answer.seq, message, event_id)
        if not isinstance(answer, Taken):
            return answer
        return await self._reconcile_batch(client, marker, message, event_id)

    async def _reconcile_batch(
        self, client: Client, marker: NatsMessage, message: NatsMessage, event_id: str
    ) -> Outcome:
        """After a batch refused with "wrong last sequence" on its marker."""
        # The batch was refused whole: the marker's subject holds a message. Ours proves
        # that an earlier batch stored the event too, at the next sequence.
        last_marker = await self._msg_get(client, {"last_by_subj": marker.subject})
        if isinstance(last_marker, SinkDown):
            return last_marker
        found = classify_marker_reply(last_marker, message=message)
        if not isinstance(found, MarkerFound):
            return found
        stored = await self._msg_get(client, {"seq": found.seq + 1})
        if isinstance(stored, SinkDown):
            return stored
        return classify_batch_event(
            stored, marker_seq=found.seq, body=message.body, event_id=event_id
        )

    def _over_max_payload(self, client: Client, message: NatsMessage) -> Outcome | None:
        """The server's max_payload, learnt on connecting, bounds both the configured bound
        (an operator's error: sink-wide) and each message with its headers (the row's)."""
        server_max = client.max_payload
        if self._settings.max_payload_bytes > server_max:
            return SinkDown(
                f"sink.max_payload_bytes ({self._settings.max_payload_bytes}) is above the "
                f"server's max_payload ({server_max})",
                reached=False,
                severe=True,
            )
        if message.size > server_max:
            return DeadLetter(
                DeadReason.TOO_LARGE,
                f"the message is {message.size} bytes with its headers, over the server's "
                f"max_payload ({server_max}); not sent",
            )
        return None

    async def _read_back(
        self, client: Client, seq: int | None, message: NatsMessage, event_id: str
    ) -> Outcome:
        """The message the stream holds at `seq` (the one a duplicate's PubAck names), or
        last on the event's own subject (`seq` None), compared with ours."""
        where = {"seq": seq} if seq is not None else {"last_by_subj": message.subject}
        reply = await self._msg_get(client, where)
        if isinstance(reply, SinkDown):
            return reply
        return classify_stored(reply, seq=seq, body=message.body, event_id=event_id)

    async def _msg_get(self, client: Client, request: dict[str, Any]) -> bytes | SinkDown:
        return await self._api(
            client,
            "msg_get",
            f"{API_PREFIX}.STREAM.MSG.GET.{self._stream}",
            json.dumps(request).encode(),
        )

    async def _stream_facts(self, client: Client) -> StreamFacts | SinkDown:
        """The server's API level and the stream's configuration, read when first needed
        and again after `_FACTS_TTL_S`, a reconnect, or an answer that shows them stale;
        concurrent rows share one read."""
        asked_at = self._clock()
        async with self._facts_lock:
            known = self._facts
            if known is not None and known[0] > asked_at:
                return known[1]
            failed = self._facts_failure
            if failed is not None and failed[0] >= asked_at:
                return failed[1]  # decided while this row waited: shared, not asked again
            account = await self._api(client, "account_info", f"{API_PREFIX}.INFO", b"")
            stream = await self._api(
                client, "stream_info", f"{API_PREFIX}.STREAM.INFO.{self._stream}", b""
            )
            facts = read_facts(account, stream, stream_name=self._stream)
            if isinstance(facts, StreamFacts):
                self._facts, self._facts_failure = (self._clock() + _FACTS_TTL_S, facts), None
            else:
                self._facts_failure = (self._clock(), facts)
            return facts

    async def _api(
        self, client: Client, operation: str, subject: str, payload: bytes
    ) -> bytes | SinkDown:
        """One JetStream API request (`operation` names it for the metric): its reply's
        bytes, or the failure."""
        try:
            reply = await client.request(subject, payload, timeout=self._settings.timeout_s)
        except nats.errors.Error as exc:
            self._note(operation, _failure_code(exc))
            failure = classify_exception(exc, subject=subject)
            return failure if isinstance(failure, SinkDown) else SinkDown(str(failure))
        except asyncio.CancelledError:
            self._note(operation, "timeout")
            raise
        self._note(operation, reply_code(reply.data))
        return reply.data

    # --- the connection ---

    async def _connection(self) -> Client | SinkDown:
        """The process's connection, made on first use; after a failure, again on the next
        use (the breaker spaces those out). Concurrent callers share one attempt."""
        client = self._client
        if client is not None and not client.is_closed:
            return client
        asked_at = self._clock()
        async with self._lock:
            client = self._client
            if client is not None and not client.is_closed:
                return client
            if self._failure is not None and self._failure[0] >= asked_at:
                return self._failure[1]
            made = await self._connect()
            if isinstance(made, SinkDown):
                self._failure = (self._clock(), made)
                return made
            self._client, self._failure = made, None
            return made

    async def _connect(self) -> Client | SinkDown:
        client = Client()
        self._last_error = self._severe_error = None
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                await client.connect(**self._connect_options(client))
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            # The client tries every server until the timeout, reporting each failure to
            # error_cb: the last of those says why better than the timeout does.
            await _quietly_close(client)
            self._note("connect", "error")
            return classify_connect_failure(self._severe_error or self._last_error or _cause(exc))
        self._note("connect", "ok")
        self._log.info(
            "sink.nats_connected",
            server=str(client.connected_url.netloc) if client.connected_url else None,
            version=str(client.connected_server_version),
            max_payload=client.max_payload,
        )
        return client

    def _connect_options(self, client: Client) -> dict[str, Any]:
        settings = self._settings
        options: dict[str, Any] = {
            "servers": list(settings.servers),
            "name": f"relayd/{__version__}",
            "error_cb": self._on_error,
            "disconnected_cb": self._dropper(client),
            "reconnected_cb": self._on_reconnected,
            "allow_reconnect": True,
            # Once connected, reconnect for as long as the process runs; the first connection
            # is bounded by sink.connect_timeout_s instead.
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": _RECONNECT_WAIT_S,
            "connect_timeout": settings.connect_timeout_s,
            "ping_interval": _PING_INTERVAL_S,
            "max_outstanding_pings": _MAX_OUTSTANDING_PINGS,
            # No reconnect buffer: a publish while disconnected fails at once, unsent (C4).
            "pending_size": 0,
            # Verified TLS whenever the server asks for TLS; the CA file for a private PKI.
            "tls": ssl.create_default_context(
                cafile=str(settings.ca_file) if settings.ca_file else None
            ),
        }
        if settings.user is not None and settings.password is not None:
            options["user"] = settings.user
            options["password"] = settings.password.get_secret_value()
        elif settings.token is not None:
            options["token"] = settings.token.get_secret_value()
        elif settings.nkey_seed_file is not None:
            options["nkeys_seed"] = str(settings.nkey_seed_file)
        elif settings.creds_file is not None:
            options["user_credentials"] = str(settings.creds_file)
        return options

    def _dropper(self, client: Client) -> Callable[[], Any]:
        async def dropped() -> None:
            # Commands queued but not yet written when the connection dropped would be
            # written once it is back, perhaps long after their attempt's send_by (C4), and
            # nats-py has no setting against it: discard them. Their requests then time out,
            # ambiguous, and the next attempt re-sends with the same id.
            client._pending = []
            client._pending_data_size = 0
            if not self._closing:
                self._log.warning("sink.nats_disconnected", error=_named(self._last_error))

        return dropped

    async def _on_reconnected(self) -> None:
        self._facts = None  # perhaps another server, or the same one upgraded
        self._log.info("sink.nats_reconnected")

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = exc
        if classify_connect_failure(exc).severe:
            self._severe_error = exc
        named = _named(exc)
        if named != self._last_logged:  # a server down for an hour is one line, not 3,600
            self._last_logged = named
            self._log.warning("sink.nats_error", error=named)

    # --- reporting ---

    def _noted(self, outcome: Outcome) -> Outcome:
        """Tell the breaker what a publish showed: a failure of the sink; a message stored
        (or found stored); a verdict on the row."""
        if isinstance(outcome, SinkDown):
            self._health.sink_failed(severe=outcome.severe)
        elif isinstance(outcome, Published):
            self._health.sink_accepted()
        else:
            self._health.sink_answered()
        return outcome

    def _note(self, operation: str, code: str) -> None:
        if self._observe is not None:
            self._observe(operation, code)


def _failure_code(exc: BaseException) -> str:
    """An exchange that got no answer, as `relayd_sink_requests_total` labels it."""
    if isinstance(exc, nats.errors.TimeoutError):
        return "timeout"
    if isinstance(exc, nats.errors.NoRespondersError):
        return "no_responders"
    return "error"


def _named(exc: BaseException | None) -> str:
    """An error as a log line names it: its type, and the server's words for the errors
    that carry them (an -ERR line: never a secret of ours)."""
    if exc is None:
        return "none"
    if type(exc) is nats.errors.Error:
        return str(exc)[:200]
    return type(exc).__name__


def _cause(exc: BaseException) -> BaseException | None:
    """The timeout of the first connection says nothing itself."""
    return None if isinstance(exc, TimeoutError) else exc


async def _quietly_close(client: Client) -> None:
    with contextlib.suppress(Exception):
        await client.close()
