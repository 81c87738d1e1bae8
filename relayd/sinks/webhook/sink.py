"""The webhook sink's transport: one signed POST per row (Standard Webhooks), over one
keep-alive aiohttp session, with each endpoint's own slow-down and 410 state.

What is sent and what each answer means is decided in `relayd/sinks/webhook/answers.py`,
the signature in `relayd/sinks/webhook/signing.py`; aiohttp's exceptions stop here, turned
into outcome values. Redirects are not followed, answers are read up to a bound, and no
secret is ever put in a log line, an error or a metric.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from relayd.config.secret_files import TokenFile
from relayd.core import __version__
from relayd.core.envelope import Envelope
from relayd.core.outcomes import (
    DeadLetter,
    Held,
    NotStarted,
    Outcome,
    Published,
    SinkDown,
)
from relayd.core.rows import ClaimedRow
from relayd.sinks import Capabilities, ExchangeObserver, SendWindow, SinkHealth, report
from relayd.sinks.http.answers import Response
from relayd.sinks.http.exchange import exchange, new_session
from relayd.sinks.http.urls import REDACTED
from relayd.sinks.webhook.answers import (
    GONE_HOLD_S,
    GONE_RETRY_S,
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    Delivery,
    Gone,
    SlowDown,
    classify,
    delivery_for,
    slow_delay_s,
)
from relayd.sinks.webhook.settings import SecretFile, WebhookSettings, check_secret_text
from relayd.sinks.webhook.signing import SigningKeys, parse_secrets, signature_header
from relayd.telemetry.logs import get_logger

# Only an excerpt of an answer is ever shown: reading more is wasted, and a receiver that
# streams an endless body must not hold the attempt.
MAX_ANSWER_BYTES = 64 * 1024

REDACTED_BYTES = REDACTED.encode()
# The answers with which a receiver refuses our signature: the secret file is read again.
_REFUSED_SIGNATURE = frozenset({401, 403})
# What C2 means for webhooks (docs/contract.md), as `relayd check` says it.
DELIVERY_GUARANTEE = "at least once, deduplicated by webhook-id at the receiver"
# Asked on every claim: one value. A receiver cannot be asked what it holds: an unanswered
# delivery is sent again with the same webhook-id, and the receiver deduplicates.
_CAPABILITIES = Capabilities(batches=False, reconcile_by_id=False)


@dataclass(slots=True)
class _Endpoint:
    """What one endpoint said lately: left alone until `quiet_until` (loop time) after a
    slow-down (`slowed` in a row); `gone_at`, when it last answered 410 Gone."""

    quiet_until: float = float("-inf")
    slowed: int = 0
    gone_at: float = float("-inf")


class _Signer:
    """The signing keys of one secret file, following the file (`TokenFile`), parsed once
    per text it holds."""

    def __init__(self, secret: SecretFile, clock: Callable[[], float]) -> None:
        self.key = secret.key
        self.file = TokenFile(secret.path, secret.text, check=check_secret_text, clock=clock)
        self._text = secret.text
        self._keys = parse_secrets(secret.text)

    async def keys(self) -> SigningKeys:
        return self._parsed(await self.file.current())

    def fresh_keys(self) -> SigningKeys | None:
        """The keys to sign with now, or None when the file is due a look (`keys()`)."""
        text = self.file.fresh()
        return None if text is None else self._parsed(text)

    def _parsed(self, text: str) -> SigningKeys:
        if text != self._text:
            self._text, self._keys = text, parse_secrets(text)
        return self._keys


class WebhookSink:
    """Delivers rows as signed webhooks to the endpoints of `[sink]`.

    Nothing is sent once the claim's `SendWindow` is closed (C4). Each endpoint is signed
    with the secrets of its secret file (its route's own, else `sink.secret_file`), and each
    file is followed on its own when an operator rewrites it: looked at (off the loop) no
    more than once a second, and at once after its endpoint answers 401/403
    (relayd/config/secret_files.py).
    """

    def __init__(
        self,
        settings: WebhookSettings,
        health: SinkHealth,
        *,
        observe: ExchangeObserver | None = None,
        clock: Callable[[], float] = time.time,
        files_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        settings.target  # noqa: B018 - ConfigError naming sink.url
        self._settings = settings
        self._routes = settings.endpoints
        self._health = health
        self._observe = observe
        # The wall clock of webhook-timestamp (receivers compare it with theirs).
        self._clock = clock
        # One signer per secret file, shared by the endpoints signed with it; the files'
        # looks are timed on `files_clock` (monotonic).
        by_file: dict[str, _Signer] = {}
        self._signers: dict[str, _Signer] = {}  # by endpoint URL
        for url, secret in settings.signing().items():
            path = os.path.abspath(secret.path)
            if path not in by_file:
                by_file[path] = _Signer(secret, files_clock)
            self._signers[url] = by_file[path]
        self._files = list(by_file.values())
        self._endpoints: dict[str, _Endpoint] = {}
        self._hidden = tuple(part.encode() for part in settings.hidden)
        self._session: aiohttp.ClientSession | None = None
        self._log = get_logger("sink")

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    async def start(self) -> None:
        self._session = new_session(self._settings, {"User-Agent": f"relayd/{__version__}"})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- the Sink interface ---

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        return [[row] for row in rows]

    def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, window: SendWindow
    ) -> Coroutine[None, None, dict[str, Outcome]]:
        if len(rows) == 1:  # what the relay asks of a sink that does not batch
            # The delivery itself, for the relay to await: no coroutine of publish's own
            # between each request's every resumption and the relay's.
            row = rows[0]
            return self._deliver(row, envelopes[row.event_id], window)
        return self._deliver_each(rows, envelopes, window)

    async def _deliver_each(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], window: SendWindow
    ) -> dict[str, Outcome]:
        results = await asyncio.gather(
            *(self._deliver(row, envelopes[row.event_id], window) for row in rows),
            return_exceptions=True,
        )
        outcomes: dict[str, Outcome] = {}
        for result in results:
            if isinstance(result, BaseException):
                raise result
            outcomes.update(result)
        return outcomes

    async def check(self) -> tuple[bool, str]:
        """The secrets parse and each endpoint accepts a connection. Nothing is POSTed: a
        probe would be a delivery a receiver must verify and store."""
        count = sum([len((await signer.keys()).keys) for signer in self._files])
        for url in self._settings.urls:
            answer = await self._exchange("HEAD", url, None, {})
            if isinstance(answer, SinkDown):
                return False, f"{self._settings.shown(url)} unreachable: {answer.error}"
        secrets = f"{count} signing secret{'s' if count > 1 else ''}"
        if len(self._files) > 1:
            keys = ", ".join(signer.key for signer in self._files)
            secrets += f" in {len(self._files)} files ({keys})"
        horizon_s = self._settings.retry_horizon_s
        if horizon_s is not None:
            secrets += f"; retry horizon {horizon_s:g}s: keep each webhook-id at least that long"
        return True, f"endpoints answer; {secrets}; {DELIVERY_GUARANTEE}"

    # --- one row ---

    async def _deliver(
        self, row: ClaimedRow, envelope: Envelope, window: SendWindow
    ) -> dict[str, Outcome]:
        """The row's outcome, by its id."""
        event_id = row.event_id
        delivery = delivery_for(envelope, url=self._settings.url, routes=self._routes)
        if isinstance(delivery, DeadLetter):
            return {event_id: delivery}  # decided here, nothing sent: nothing to tell the breaker
        endpoint = self._endpoints.get(delivery.url)
        if endpoint is None:
            endpoint = self._endpoints[delivery.url] = _Endpoint()
        loop = asyncio.get_running_loop()
        if _claimed_before(window, endpoint.gone_at):
            # Claimed before the endpoint's 410: the pause that answer asked for holds the
            # row from now on. A row claimed after it is sent: only a lifted pause (or one
            # not stored yet) lets a claim return it, and no timer of this process may
            # outlast an operator's resume.
            shown = self._settings.shown(delivery.url)
            return {
                event_id: Held(f"not sent: {shown} answered 410 Gone", retry_after_s=GONE_HOLD_S)
            }
        quiet_s = endpoint.quiet_until - loop.time()
        if quiet_s > 0:
            return {
                event_id: Held("not sent: the endpoint asked to slow down", retry_after_s=quiet_s)
            }
        signer = self._signers[delivery.url]
        keys = signer.fresh_keys()  # the usual case: no look due, nothing to await
        if keys is None:
            keys = await signer.keys()
        if window.closed():
            return {event_id: NotStarted()}
        timestamp_s = int(self._clock())
        headers = dict(delivery.headers)
        headers[HEADER_TIMESTAMP] = str(timestamp_s)
        headers[HEADER_SIGNATURE] = signature_header(
            keys, delivery.headers[HEADER_ID], timestamp_s, delivery.body
        )
        answer = await self._exchange("POST", delivery.url, delivery.body, headers)
        if isinstance(answer, SinkDown):
            return {event_id: report(self._health, answer)}
        if answer.status in _REFUSED_SIGNATURE:
            await signer.file.refresh()  # the operator may have rotated the secret
        classified = classify(answer, signed_with=signer.key)
        outcome = self._answered(endpoint, delivery, classified, loop.time())
        return {event_id: report(self._health, outcome)}

    def _answered(
        self,
        endpoint: _Endpoint,
        delivery: Delivery,
        answer: Outcome | Gone | SlowDown,
        now: float,
    ) -> Outcome:
        """The outcome of the endpoint's answer, and what it asks of the next deliveries to
        it: left alone for a while after a 410 or a slow-down, no longer after a 2xx."""
        if isinstance(answer, Published):
            endpoint.slowed = 0
            return answer
        if isinstance(answer, SinkDown):
            return answer
        if isinstance(answer, Gone):
            endpoint.gone_at = now
            shown = self._settings.shown(delivery.url)
            self._log.error("sink.webhook_gone", url=shown, pause=list(delivery.pause))
            error = f"{shown} answered {answer.error}"
            return Held(error, retry_after_s=GONE_RETRY_S, pause=delivery.pause)
        if isinstance(answer, SlowDown):
            # Requests in flight together answer together: only the first slow answer after
            # the endpoint was left alone counts as one more in a row.
            if now >= endpoint.quiet_until:
                endpoint.slowed += 1
            delay_s = slow_delay_s(answer.retry_after_s, endpoint.slowed)
            endpoint.quiet_until = max(endpoint.quiet_until, now + delay_s)
            self._log.warning(
                "sink.webhook_slowed",
                url=self._settings.shown(delivery.url),
                delay_s=round(delay_s, 3),
            )
            return Held(f"slowed down: {answer.error}", retry_after_s=delay_s)
        return answer

    # --- transport ---

    def _exchange(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> Coroutine[None, None, Response | SinkDown]:
        """One exchange, for the caller to await (no coroutine of its own per request)."""
        if self._session is None:
            raise RuntimeError("WebhookSink.start() was not called")
        return exchange(
            self._session,
            method,
            url,
            body=body,
            headers=headers,
            limit_bytes=MAX_ANSWER_BYTES,
            check="sink.url and sink.routes",
            observe=self._observe,
            answered=self._answered_body if self._hidden else None,
        )

    async def _answered_body(self, status: int, content: bytes) -> bytes:
        """An answer's body, cleaned of what relayd hides of its endpoints' URLs: an error
        page that echoes the URL it was called on must not put a token in last_error."""
        if 200 <= status < 300:
            return content
        for part in self._hidden:
            content = content.replace(part, REDACTED_BYTES)
        return content


def _claimed_before(window: SendWindow, when: float) -> bool:
    """Whether the claim of `window` was answered before `when` (loop time); a window made
    outside a claim opens now."""
    return window.opened_at is not None and window.opened_at <= when
