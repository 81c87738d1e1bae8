"""The NATS sink's connection: one nats-py client per process, made on first use and again
after a failure (the breaker spaces those out), with the settings that keep C4 (no reconnect
buffer, nothing queued written after a reconnect); and the reply inbox that pipelined
publishes share (`ReplyInbox`).

nats-py's connection errors stop here: they are put in relayd's words, with the server's
`host:port` (`relayd/sinks/nats/link.py`), never printed with a credential in them. A
reconnect is told to the breaker (`on_reconnected`): it may probe at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from structlog.typing import FilteringBoundLogger

from relayd.core import __version__
from relayd.core.outcomes import SinkDown
from relayd.sinks import ExchangeObserver, endpoint
from relayd.sinks.nats import wire
from relayd.sinks.nats.answers import (
    InboxRefused,
    PublishRefused,
    inbox_refused,
    publish_refused,
    subscribe_refused,
)
from relayd.sinks.nats.link import (
    Link,
    classify_connect_failure,
    connection_error,
    servers_text,
)
from relayd.sinks.nats.settings import NatsSettings

# How often the client pings an idle connection, and how many pings may go unanswered: a
# connection that died without a word is noticed within about half a minute.
_PING_INTERVAL_S = 10
_MAX_OUTSTANDING_PINGS = 2
_RECONNECT_WAIT_S = 1
# The status a NATS server answers a request with when nothing subscribes to its subject.
_NO_RESPONDERS = "503"


class ReplyInbox:
    """One subscription, on `<inbox>.*`, for the replies to every publish and API request:
    each names its own reply subject and waits on a future of its own. No timer per
    message in a pipeline (`send`): the caller waits for the whole pipeline under one
    deadline; `request` is one exchange under its own. A refusal the server reports on the
    side (`refuse`, `refuse_subscription`) fails the futures it concerns at once."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._prefix = client.new_inbox()
        self._subject = f"{self._prefix}.*"
        self._skip = len(self._prefix) + 1
        # By reply token: the future of the publish's reply, and the subject it went to.
        self._waiting: dict[str, tuple[asyncio.Future[Msg], str]] = {}
        self._counter = 0
        # The subscription's subject once the server refused it: nothing more is sent.
        self.refused: str | None = None

    async def start(self) -> None:
        """Subscribe, and learn whether the server allows it: it answers a subscription it
        refuses with an error on the side, which arrives before the answer to a ping sent
        after the SUB. Raises `InboxRefused` then. (Resubscribed by the client after a
        reconnect, like any subscription; a refusal then comes to `refuse_subscription`.)"""
        await self._client.subscribe(self._subject, cb=self._reply)
        # nats-py writes a flush's PING straight to the socket, ahead of the commands still
        # queued for its writer task, this SUB among them: the first round trip lets the
        # writer send the SUB, the second is answered after the server has processed it.
        await self._client.flush()
        await self._client.flush()
        if self.refused is not None:
            raise InboxRefused(self.refused, sent=False)

    async def send(self, subject: str, body: bytes, headers: dict[str, str]) -> asyncio.Future[Msg]:
        """Publish with a reply subject of its own; the future gets the reply. Raises what
        nats-py's publish raises, and `InboxRefused` once the server refused the inbox's
        subscription (nothing was sent then)."""
        if self.refused is not None:
            raise InboxRefused(self.refused, sent=False)
        self._counter += 1
        token = str(self._counter)
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (future, subject)
        try:
            await wire.publish(
                self._client, subject, body, reply=f"{self._prefix}.{token}", headers=headers
            )
        except BaseException:
            del self._waiting[token]
            raise
        future.add_done_callback(lambda _: self._waiting.pop(token, None))
        return future

    async def request(
        self, subject: str, body: bytes, headers: dict[str, str] | None, *, timeout_s: float
    ) -> Msg:
        """One publish and its reply, as nats-py's `request` (the same errors: a timeout,
        no responders), and `PublishRefused` as soon as the server refuses the subject."""
        future = await self.send(subject, body, headers or {})
        try:
            async with asyncio.timeout(timeout_s):
                reply = await future
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        if no_responders(reply):
            raise nats.errors.NoRespondersError
        return reply

    def refuse(self, subject: str) -> None:
        """The server refused a publish to `subject` for lack of permission: every publish
        to it still waiting fails now with `PublishRefused`, rather than at its deadline
        (the server drops such a message unanswered, and says so only on the side).

        nats-py lowercases the server's error line, so subjects compare without case: a
        refusal of `Orders.A` also fails the waiting publishes to `orders.a`, which come
        back as refused (severe, refunded) and are sent again after the breaker's probe."""
        wanted = subject.casefold()
        for future, sent_to in list(self._waiting.values()):
            if sent_to.casefold() == wanted and not future.done():
                future.set_exception(PublishRefused(subject))

    def refuse_subscription(self, subject: str) -> None:
        """The server refused a subscription to `subject` for lack of permission. If it is
        this inbox's, no reply can come: every request still waiting fails now with
        `InboxRefused`, and so does every later `send` (the connection is made anew)."""
        if subject.casefold() != self._subject.casefold():  # see refuse()
            return
        self.refused = subject
        for future, _ in list(self._waiting.values()):
            if not future.done():
                future.set_exception(InboxRefused(subject, sent=True))

    async def _reply(self, msg: Msg) -> None:
        waiting = self._waiting.pop(msg.subject[self._skip :], None)
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(msg)


def no_responders(msg: Msg) -> bool:
    """Whether a reply is the server's "no responders" status rather than an answer."""
    headers = msg.headers
    return headers is not None and headers.get("Status") == _NO_RESPONDERS and not msg.data


class NatsConnection:
    """The process's connection (`get`), its reply inbox, and the callbacks that log and
    keep C4 across disconnections."""

    def __init__(
        self,
        settings: NatsSettings,
        *,
        log: FilteringBoundLogger,
        clock: Callable[[], float],
        observe: ExchangeObserver | None,
        on_reconnected: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._log = log
        self._clock = clock
        self._observe = observe
        self._on_reconnected_hook = on_reconnected
        self._client: Client | None = None
        self._inbox: ReplyInbox | None = None
        self._tls: ssl.SSLContext | None = None
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
        # The server of the current connection, or of the last one (`host:port`).
        self._server: str | None = None

    @property
    def inbox(self) -> ReplyInbox:
        """The reply inbox of the current connection (after `get` returned a client)."""
        if self._inbox is None:
            raise RuntimeError("NatsConnection.inbox before a connection was made")
        return self._inbox

    async def get(self) -> Client | SinkDown:
        """The process's connection, made on first use; after a failure, again on the next
        use (the breaker spaces those out). Concurrent callers share one attempt. A
        connection whose reply subscription the server refused is replaced: a permission
        granted since then takes effect on a new subscription."""
        client = self._client
        if client is not None and not client.is_closed and not self._refused():
            return client
        asked_at = self._clock()
        async with self._lock:
            client = self._client
            if client is not None and not client.is_closed and not self._refused():
                return client
            if self._failure is not None and self._failure[0] >= asked_at:
                return self._failure[1]
            if client is not None:
                self._client, self._inbox = None, None
                await quietly_close(client)
            made = await self._connect()
            if isinstance(made, SinkDown):
                self._failure = (self._clock(), made)
                return made
            self._client, self._failure = made, None
            return made

    def link(self) -> Link:
        """Where the connection is or was last, and the client's last connection error
        since then: what a failure for want of a connection says."""
        error = None if self._last_error is None else connection_error(self._last_error)
        return Link(self._server or servers_text(self._settings.servers), error)

    def _refused(self) -> bool:
        return self._inbox is not None and self._inbox.refused is not None

    def start(self) -> None:
        """Load the CA bundle now, at start-up, rather than on the first exchange (tens of
        milliseconds of CPU); connecting waits for the first exchange. A CA file that
        cannot be loaded fails that exchange, as a connection failure the breaker sees."""
        with contextlib.suppress(OSError):  # ssl.SSLError too
            self._tls_context()

    def _tls_context(self) -> ssl.SSLContext:
        # Verified TLS whenever the server asks for TLS; the CA file for a private PKI.
        if self._tls is None:
            ca_file = self._settings.ca_file
            self._tls = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        return self._tls

    async def close(self) -> None:
        self._closing = True
        client, self._client, self._inbox = self._client, None, None
        if client is not None:
            await quietly_close(client)

    def _note(self, code: str) -> None:
        if self._observe is not None:
            self._observe("connect", code)

    async def _connect(self) -> Client | SinkDown:
        client = Client()
        self._last_error = self._severe_error = None
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                await client.connect(**self._connect_options(client))
                # Set before it subscribes, for the error callback to hand it a refusal.
                self._inbox = inbox = ReplyInbox(client)
                await inbox.start()
        except InboxRefused as exc:
            self._inbox = None
            await quietly_close(client)
            self._note("error")
            return inbox_refused(exc)
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            self._inbox = None
            # The client tries every server until the timeout, reporting each failure to
            # error_cb: the last of those says why better than the timeout does.
            await quietly_close(client)
            self._note("error")
            return classify_connect_failure(
                self._severe_error or self._last_error or _cause(exc),
                servers=servers_text(self._settings.servers),
            )
        self._note("ok")
        self._server = _server_of(client)
        self._log.info(
            "sink.nats_connected",
            server=self._server,
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
            # Every subject is checked already: the routes' when the configuration is
            # read, an event id (a UUID) where `{id}` stands, the reply inbox the client's.
            "skip_subject_validation": True,
            "tls": self._tls_context(),
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
                self._log.warning(
                    "sink.nats_disconnected",
                    server=self._server,
                    error=self._said(self._last_error),
                )

        return dropped

    async def _on_reconnected(self) -> None:
        client = self._client
        if client is not None:
            self._server = _server_of(client) or self._server
        self._last_error = None
        self._last_logged = ""  # the next failure is news again
        self._log.info("sink.nats_reconnected", server=self._server)
        self._on_reconnected_hook()

    async def _on_error(self, exc: Exception) -> None:
        if self._inbox is not None:
            subject = publish_refused(exc)
            if subject is not None:
                self._inbox.refuse(subject)
            subject = subscribe_refused(exc)
            if subject is not None:
                self._inbox.refuse_subscription(subject)
        self._last_error = exc
        if classify_connect_failure(exc, servers="").severe:
            self._severe_error = exc
        said = self._said(exc)
        if said != self._last_logged:  # a server down for an hour is one line, not 3,600
            self._last_logged = said
            self._log.warning("sink.nats_error", server=self._server, error=said)

    @staticmethod
    def _said(exc: BaseException | None) -> str:
        return "none" if exc is None else connection_error(exc)


def _server_of(client: Client) -> str | None:
    """The connected server as `host:port` (the URL's credentials, if any, left out)."""
    url = client.connected_url
    return None if url is None else endpoint(url.geturl())


def _cause(exc: BaseException) -> BaseException | None:
    """The timeout of the first connection says nothing itself."""
    return None if isinstance(exc, TimeoutError) else exc


async def quietly_close(client: Client) -> None:
    with contextlib.suppress(Exception):
        await client.close()
