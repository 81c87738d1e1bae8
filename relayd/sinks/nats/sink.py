"""The NATS sink's transport: a claim's rows published as one pipeline (every message
written, then each PubAck awaited) over the process's connection (`nats_connection.py`),
each in its route's dedupe mode (the event alone, expecting its own subject empty, or in an
atomic batch with its marker: `relayd/sinks/nats/dedupe.py`), the stored message read back
after a duplicate's PubAck or a "wrong last sequence", and `relayd check`'s look at the
stream.

What each answer means is decided in `relayd/sinks/nats/answers.py`, what is sent in
`relayd/sinks/nats/message.py`; nats-py's exceptions stop here, turned into outcome values.
No text leaves the sink with a credential in it: the client is given secrets, never asked
to print them, and failures are put in relayd's words (`relayd/sinks/nats/link.py`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from relayd.core.envelope import Envelope
from relayd.core.outcomes import (
    DeadLetter,
    DeadReason,
    NotStarted,
    Outcome,
    Published,
    RetryLater,
    SinkDown,
)
from relayd.core.rows import ClaimedRow
from relayd.sinks import Capabilities, ExchangeObserver, SendWindow, SinkHealth, report
from relayd.sinks.nats.answers import (
    NO_ROOM,
    Duplicate,
    LastOnSubject,
    Refused,
    acked_seq,
    classify_ack,
    classify_batch_event,
    classify_last_on_subject,
    classify_marker_reply,
    classify_stored,
    never_stored,
    reply_code,
    stream_verdict,
)
from relayd.sinks.nats.connection import NatsConnection, no_responders
from relayd.sinks.nats.dedupe import (
    ATOMIC_DISABLED,
    BATCH_DUPLICATE_ID,
    EXPECTED_LAST_SUBJECT_SEQ,
    MarkerFound,
    Mode,
    PastWindow,
    StreamFacts,
    Taken,
    atomic_batch,
    expecting_new_subject,
    mode_for,
    mode_without_facts,
    past_window,
    past_window_action,
    past_window_dead_letter,
)
from relayd.sinks.nats.facts import StreamFactsCache
from relayd.sinks.nats.fence import LastSequences, expected_of, expecting
from relayd.sinks.nats.jetstream import JetStream, failure_code
from relayd.sinks.nats.message import NatsMessage, message_for
from relayd.sinks.nats.settings import NatsSettings
from relayd.telemetry.logs import get_logger

# Asked on every claim: one value.
_CAPABILITIES = Capabilities(batches=True, reconcile_by_id=False)


class NatsSink:
    """Publishes rows as events to one JetStream stream.

    Nothing is sent once the claim's `SendWindow` is closed (C4), and nothing is sent later than the
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
        self._clock = clock
        self._log = get_logger("sink")
        self._connection = NatsConnection(
            settings,
            log=self._log,
            clock=clock,
            observe=observe,
            on_reconnected=self._reconnected,
        )
        # What the server and the stream reported (the dedupe modes depend on it).
        self._js = JetStream(
            self._connection,
            stream=self._stream,
            timeout_s=settings.timeout_s,
            observe=observe,
        )
        self._facts = StreamFactsCache(self._js.read_facts, clock=clock)
        # The last sequence seen on each ordering key's subject (key_in_subject routes).
        self._last_seqs = LastSequences()

    @property
    def capabilities(self) -> Capabilities:
        # A claim's rows in one pipeline (`batches`: one attempt). A stream is asked by
        # sequence or subject, never by message id, so an unanswered publish is re-sent with
        # the same id; the route's mode keeps the stream from storing it twice, or the
        # window and sink.past_window decide (docs/nats.md#deduplication).
        return _CAPABILITIES

    async def start(self) -> None:
        """No connection yet: it is made by the first exchange, so a server that is down at
        start-up is a sink outage (the breaker), not a failed start."""
        self._connection.start()

    async def close(self) -> None:
        await self._connection.close()

    def _reconnected(self) -> None:
        # Perhaps another server, or an upgraded one: its facts are read again. The breaker
        # may probe now rather than wait out its cooldown.
        self._facts.forget()
        self._health.sink_reconnected()

    # --- the Sink interface ---

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        # A claim's rows go out as one pipeline: every message written at once, each
        # waiting for its own PubAck.
        return [list(rows)]

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, window: SendWindow
    ) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        piped: list[tuple[ClaimedRow, NatsMessage]] = []
        alone: list[tuple[ClaimedRow, NatsMessage, Mode]] = []
        client: Client | SinkDown | None = None
        for row in rows:
            message = message_for(
                envelopes[row.event_id],
                self._routes,
                stream=self._stream,
                source=self._settings.source,
                max_body_bytes=self._settings.max_payload_bytes,
                key=row.ordering_key,
            )
            if isinstance(message, DeadLetter):
                outcomes[row.event_id] = message  # decided here, nothing sent or noted
                continue
            if client is None:  # asked once per claim, once a row is to be sent
                client = await self._connection.get()
            mode = await self._prepare(client, row, message, window)
            if not isinstance(mode, Mode):
                outcomes[row.event_id] = mode
                continue
            guarded = self._piped(message, mode)
            if guarded is None:
                alone.append((row, message, mode))
            else:
                piped.append((row, guarded))
        if client is None or isinstance(client, SinkDown):
            return outcomes
        if piped:
            outcomes.update(await self._pipeline(piped, window))
        if alone:
            # Each row runs to its end before a failure of relayd's own is raised.
            results = await asyncio.gather(
                *(self._send(client, row, message, mode, window) for row, message, mode in alone),
                return_exceptions=True,
            )
            for (row, _, _), result in zip(alone, results, strict=True):
                if isinstance(result, BaseException):
                    raise result
                outcomes[row.event_id] = result
        return outcomes

    async def check(self) -> tuple[bool, str]:
        """Connect, then ask JetStream for the account and the stream: the stream exists,
        its subjects take every route's subject, and its duplicate window is shown."""
        client = await self._connection.get()
        if isinstance(client, SinkDown):
            return False, client.error
        account = await self._js.account_info()
        stream = await self._js.stream_info()
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

    async def _prepare(
        self, client: Client | SinkDown, row: ClaimedRow, message: NatsMessage, window: SendWindow
    ) -> Mode | Outcome:
        """The route's mode for the row's message; or the row's outcome when it goes no
        further (too large for the server, past the window, or the sink is down)."""
        if isinstance(client, SinkDown):
            return self._noted(client)
        refused = self._over_max_payload(client, message)
        if refused is not None:
            return self._noted(refused) if isinstance(refused, SinkDown) else refused
        return await self._mode(row, message, window)

    def _piped(self, message: NatsMessage, mode: Mode) -> NatsMessage | None:
        """The message as it goes in the claim's pipeline, guarded as its mode says; None
        for one sent on its own: an atomic batch, or the head of a key whose subject relayd
        has not seen lately (read first)."""
        if mode is Mode.KEY_IN_SUBJECT:
            last_seq = self._last_seqs.get(message.subject)
            return None if last_seq is None else expecting(message, last_seq)
        if mode is Mode.ID_IN_SUBJECT:
            return expecting_new_subject(message)
        return None if mode is Mode.ATOMIC_MARKER else message

    async def _send(
        self, client: Client, row: ClaimedRow, message: NatsMessage, mode: Mode, window: SendWindow
    ) -> Outcome:
        """One row on its own, in its mode."""
        if window.closed():
            return NotStarted()
        if mode is Mode.ATOMIC_MARKER:
            outcome = await self._publish_batch(client, message, row.event_id, window)
        elif mode is Mode.KEY_IN_SUBJECT:
            outcome = await self._publish_keyed(message, row.event_id, window)
        elif mode is Mode.ID_IN_SUBJECT:
            outcome = await self._publish_one(expecting_new_subject(message), row.event_id, window)
        else:
            outcome = await self._publish_one(message, row.event_id, window)
        return self._noted(outcome)

    async def _pipeline(
        self, items: Sequence[tuple[ClaimedRow, NatsMessage]], window: SendWindow
    ) -> dict[str, Outcome]:
        """Every message written before any PubAck is awaited, then each answered on its
        own within sink.timeout_s; a message without an answer by then is ambiguous (the
        next attempt re-sends it with the same id)."""
        inbox = self._connection.inbox
        outcomes: dict[str, Outcome] = {}
        waiting: list[tuple[ClaimedRow, NatsMessage, asyncio.Future[Msg]]] = []
        try:
            for row, message in items:
                if window.closed():
                    outcomes[row.event_id] = (
                        NotStarted()
                    )  # nothing sent once the window closed (C4)
                    continue
                try:
                    future = await inbox.send(message.subject, message.body, message.headers)
                except (nats.errors.Error, Refused) as exc:
                    self._js.note("publish", failure_code(exc))
                    outcomes[row.event_id] = self._noted(self._js.classified(exc, message.subject))
                    continue
                waiting.append((row, message, future))
            if waiting:
                await asyncio.wait([f for _, _, f in waiting], timeout=self._settings.timeout_s)
        except asyncio.CancelledError:
            for _, _, future in waiting:
                if not future.done():
                    self._js.note("publish", "timeout")  # the attempt's deadline cut it
                elif not future.cancelled():
                    future.exception()  # retrieved: a refusal has no one else to read it
                future.cancel()
            raise
        for row, message, future in waiting:
            reply = self._piped_reply(message, future)
            outcomes[row.event_id] = self._noted(
                reply
                if not isinstance(reply, Msg)
                else await self._answered(reply, message, row.event_id, window)
            )
        return outcomes

    def _piped_reply(self, message: NatsMessage, future: asyncio.Future[Msg]) -> Msg | Outcome:
        """A pipelined publish's reply once the pipeline's wait is over, or what its absence
        means: no answer in time, a refusal for lack of permission, no responders."""
        if not future.done():
            future.cancel()
            self._js.note("publish", "timeout")
            return self._js.classified(nats.errors.TimeoutError(), message.subject)
        failure = future.exception()
        if failure is not None:  # the server refused the subject (ReplyInbox.refuse)
            self._js.note("publish", failure_code(failure))
            return self._js.classified(failure, message.subject)
        if no_responders(future.result()):
            self._js.note("publish", "no_responders")
            return self._js.classified(nats.errors.NoRespondersError(), message.subject)
        return future.result()

    async def _publish_one(
        self, message: NatsMessage, event_id: str, window: SendWindow, *, again: bool = True
    ) -> Outcome:
        """The event alone; a publish expecting its subject empty learns whether it is."""
        reply = await self._js.request(message)
        if not isinstance(reply, Msg):
            return reply
        return await self._answered(reply, message, event_id, window, again=again)

    async def _publish_keyed(
        self, message: NatsMessage, event_id: str, window: SendWindow
    ) -> Outcome:
        """The head of a key whose subject relayd has not seen lately: the subject is read
        first (the event may be there already), then the event published expecting what was
        read (relayd/sinks/nats/fence.py)."""
        last = await self._last_on_subject(message, event_id)
        if not isinstance(last, int):
            return last
        if window.closed():
            return NotStarted()
        return await self._publish_one(expecting(message, last), event_id, window)

    async def _last_on_subject(self, message: NatsMessage, event_id: str) -> Outcome | int:
        """The key's subject read: the event's own outcome when it is the last message there
        (stored by an earlier attempt), else the last message's sequence (kept)."""
        reply = await self._js.msg_get({"last_by_subj": message.subject})
        if isinstance(reply, SinkDown):
            return reply
        last = classify_last_on_subject(reply, body=message.body, event_id=event_id)
        if not isinstance(last, LastOnSubject):
            return last
        self._last_seqs.put(message.subject, last.seq)
        return last.ours if last.ours is not None else last.seq

    async def _moved(
        self, message: NatsMessage, event_id: str, window: SendWindow, *, again: bool
    ) -> Outcome:
        """A fenced publish refused: the key's subject holds something else last. The event
        itself (stored before: published) or an earlier event of the key, which relayd had
        not seen: while the claim's window is open no other relay can hold the key's head,
        so the event is published once more, expecting what was read; a late answer, or a
        second refusal, leaves it to the next attempt."""
        last = await self._last_on_subject(message, event_id)
        if not isinstance(last, int):
            return last
        if again and not window.closed():
            return await self._publish_one(expecting(message, last), event_id, window, again=False)
        return RetryLater(
            f"the subject {message.subject} moved on while this event was on its way (it "
            f"expected seq {expected_of(message)}, the last is {last}): sent again on its next "
            "attempt"
        )

    async def _room_for(
        self,
        answer: Outcome | Duplicate | Taken,
        reply: bytes,
        message: NatsMessage,
        window: SendWindow,
    ) -> Outcome | Duplicate | Taken:
        """A refusal for want of room (a full stream: sink-wide, a wait), unless the message
        is larger than the stream's whole budget: then it can never be stored, and is
        dead-lettered at once instead of failing the sink again and again."""
        if not isinstance(answer, SinkDown):
            return answer  # the usual case: the reply is not read again
        code = reply_code(reply)
        if not code.isdigit() or int(code) not in NO_ROOM:
            return answer
        facts = await self._stream_facts(fresh_since=window.opened_at)
        if isinstance(facts, SinkDown):
            return answer
        return never_stored(message, facts) or answer

    async def _answered(
        self,
        reply: Msg,
        message: NatsMessage,
        event_id: str,
        window: SendWindow,
        *,
        again: bool = True,
    ) -> Outcome:
        """What the reply to a publish of the event alone means, read back if need be."""
        answer = await self._room_for(
            classify_ack(
                reply.data,
                stream=self._stream,
                subject=message.subject,
                guarded=EXPECTED_LAST_SUBJECT_SEQ in message.headers,
            ),
            reply.data,
            message,
            window,
        )
        keyed = mode_without_facts(message.route) is Mode.KEY_IN_SUBJECT
        if isinstance(answer, Duplicate):
            self._js.note("publish", "duplicate")
            outcome = await self._read_back(answer.seq, message, event_id)
            if keyed and isinstance(outcome, Published):
                self._last_seqs.put(message.subject, answer.seq)
            return outcome
        self._js.note("publish", "ok" if isinstance(answer, Published) else reply_code(reply.data))
        if isinstance(answer, Taken):
            if keyed:
                return await self._moved(message, event_id, window, again=again)
            # The event's own subject holds a message: ours, stored by an earlier attempt
            # at any time before, or another's (a conflict).
            return await self._read_back(None, message, event_id)
        if keyed and isinstance(answer, Published) and (seq := acked_seq(reply.data)):
            self._last_seqs.put(message.subject, seq)
        return answer

    async def _mode(
        self, row: ClaimedRow, message: NatsMessage, window: SendWindow
    ) -> Mode | Outcome:
        """The route's dedupe mode (nats_dedupe), or why the row goes no further: the
        server's facts cannot be read (the sink's failure), or the row is past the window
        and `sink.past_window` dead-letters it (decided, like a re-send's warning, only for
        a row still due to be sent)."""
        if (fixed := mode_without_facts(message.route)) is not None:
            return fixed
        # A row an earlier attempt may have stored is sent again only against facts read
        # since its claim: an operator may have shortened the stream's duplicate window
        # after they were cached, and the stream forgets ids at once then.
        facts = await self._stream_facts(
            fresh_since=window.opened_at if row.claimed_before else None
        )
        if isinstance(facts, SinkDown):
            return self._noted(facts)
        mode = mode_for(message.route, facts, marker_prefix=self._settings.marker_prefix)
        # Its age as it leaves, not as it was claimed: it may have waited for a sending slot.
        if mode is Mode.WINDOW and past_window(
            claimed_before=row.claimed_before,
            age_s=row.age_s + window.elapsed_s(),
            window_s=facts.duplicate_window_s,
            margin_s=self._settings.timeout_s,
        ):
            if window.closed():
                return NotStarted()
            refused = self._past_window(row, facts, window)
            if refused is not None:
                return refused
        return mode

    def _past_window(
        self, row: ClaimedRow, facts: StreamFacts, window: SendWindow
    ) -> Outcome | None:
        """An ambiguous row the stream may have forgotten: sent if an operator redrove it
        since its last attempt, else as `sink.past_window` says."""
        window_s = facts.duplicate_window_s
        age_s = row.age_s + window.elapsed_s()
        action = past_window_action(redriven=row.redriven, setting=self._settings.past_window)
        self._js.note("past_window", action.value)
        if action is PastWindow.DEAD_LETTER:
            return past_window_dead_letter(age_s, window_s)
        fields = {"event_id": row.event_id, "age_s": round(age_s, 3), "window_s": window_s}
        if action is PastWindow.REDRIVEN:
            # The operator's decision (`relayd dlq retry`), not the relay's: no warning.
            self._log.info("sink.resending_redriven", **fields)
        else:
            self._log.warning("sink.resending_past_window", **fields)
        return None

    async def _publish_batch(  # noqa: PLR0911 - each answer to a batch is told apart
        self, client: Client, message: NatsMessage, event_id: str, window: SendWindow
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
            self._js.note("publish", failure_code(exc))
            return self._js.classified(exc, marker.subject)
        reply = await self._js.request(event)
        if not isinstance(reply, Msg):
            return reply
        answer = await self._room_for(
            classify_ack(reply.data, stream=self._stream, subject=event.subject, guarded=True),
            reply.data,
            message,
            window,
        )
        code = reply_code(reply.data)
        self._js.note("publish", "ok" if isinstance(answer, Published) else code)
        if code == str(ATOMIC_DISABLED):
            self._facts.forget()  # the stream's configuration changed: read it again
        if code == str(BATCH_DUPLICATE_ID):
            # The stream holds the event's id, within its window, from a publish outside a
            # batch (before this route ran in this mode): the batch stored nothing. The
            # event alone gets the duplicate's PubAck, with the sequence to read back.
            if window.closed():
                return RetryLater(
                    f"the stream holds this event's id from a publish outside a batch "
                    f"(JetStream error {BATCH_DUPLICATE_ID}); the next attempt sends it alone"
                )
            return await self._publish_one(message, event_id, window)
        if isinstance(answer, Duplicate):  # a batch's answer never says so; kept honest
            return await self._read_back(answer.seq, message, event_id)
        if not isinstance(answer, Taken):
            return answer
        return await self._reconcile_batch(marker, message, event_id)

    async def _reconcile_batch(
        self, marker: NatsMessage, message: NatsMessage, event_id: str
    ) -> Outcome:
        """After a batch refused with "wrong last sequence" on its marker."""
        # The batch was refused whole: the marker's subject holds a message. Ours proves
        # that an earlier batch stored the event too, at the next sequence.
        last_marker = await self._js.msg_get({"last_by_subj": marker.subject})
        if isinstance(last_marker, SinkDown):
            return last_marker
        found = classify_marker_reply(last_marker, message=message)
        if not isinstance(found, MarkerFound):
            return found
        stored = await self._js.msg_get({"seq": found.seq + 1})
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

    async def _read_back(self, seq: int | None, message: NatsMessage, event_id: str) -> Outcome:
        """The message the stream holds at `seq` (the one a duplicate's PubAck names), or
        last on the event's own subject (`seq` None), compared with ours."""
        where = {"seq": seq} if seq is not None else {"last_by_subj": message.subject}
        reply = await self._js.msg_get(where)
        if isinstance(reply, SinkDown):
            return reply
        return classify_stored(reply, seq=seq, body=message.body, event_id=event_id)

    async def _stream_facts(self, fresh_since: float | None = None) -> StreamFacts | SinkDown:
        """The server's API level and the stream's configuration (`StreamFactsCache`)."""
        return await self._facts.get(fresh_since)

    def _noted(self, outcome: Outcome) -> Outcome:
        """Tell the breaker what a publish showed (a message stored, or found stored)."""
        return report(self._health, outcome)
