"""The OJS sink's transport: POST /ojs/v1/jobs (and /jobs/batch), GET-first reconciliation,
the manifest, over one keep-alive aiohttp session. What each answer means is decided in
`relayd/sinks/ojs/answers.py`; aiohttp exceptions stop here, turned into outcome values, and
so does a request aiohttp refuses to build: no exchange raises into a worker. No text leaves
the sink (an outcome's error, `check`'s line) with a piece of a token in it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import aiohttp

from relayd.config.secret_files import TokenFile
from relayd.core import __version__
from relayd.core.envelope import Envelope
from relayd.core.outcomes import NotFound, NotStarted, Outcome, Published, RetryLater, SinkDown
from relayd.core.rows import ClaimedRow
from relayd.core.trace_context import carried
from relayd.sinks import Capabilities, ExchangeObserver, SendWindow, SinkHealth, report
from relayd.sinks.http.answers import Response
from relayd.sinks.http.exchange import exchange, new_session
from relayd.sinks.ojs.answers import (
    BATCH_PATH,
    JOBS_PATH,
    MANIFEST_PATH,
    MEDIA_TYPE,
    BatchAccepted,
    BatchDrop,
    BatchFailed,
    BatchNotServed,
    BatchSplit,
    BatchVerdict,
    Reconcile,
    SecretPieces,
    batch_body,
    batchable,
    chunk_batches,
    classify_batch,
    classify_get,
    classify_post,
    parse_json,
    redact,
    request_id,
    scrubbed,
    secret_forms,
)
from relayd.sinks.ojs.settings import OjsSettings

_MAX_RESPONSE_BYTES = 16 * 1024 * 1024
# What an exchange shows the breaker: an outcome, a lookup's, or a conflict to reconcile.
_Told = TypeVar("_Told", bound="Outcome | NotFound | Reconcile")
_MANIFEST_TIMEOUT_S = 5.0
_MANIFEST_TTL_S = 300.0
_MANIFEST_RETRY_S = 30.0
# Sent with every request of the sink's session.
SESSION_HEADERS = {"Accept": MEDIA_TYPE, "User-Agent": f"relayd/{__version__}"}


class OjsSink:
    """Publishes rows to one OJS server over a keep-alive connection pool.

    Every POST is sent only while the claim's `SendWindow` is open: a claim whose lease ran
    out while relayd was waiting (for PostgreSQL's answer, a free connection, an earlier
    request) must not write to the sink (C4). A GET changes nothing on the sink, so it needs
    no such check. Only this sink can look a row up by id (`reconcile`): a row an earlier
    attempt may have stored is looked up before it is sent again (C2).

    The bearer token follows `sink.token_file` when an operator rotates it: the file is
    looked at (off the loop) no more than once a second, and at once after a 401/403
    (relayd/config/secret_files.py).
    """

    def __init__(
        self,
        settings: OjsSettings,
        health: SinkHealth,
        *,
        observe: ExchangeObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._url = settings.base_url
        # Asked on every claim: built once.
        self._capabilities = Capabilities(batches=settings.batch != "off", reconcile_by_id=True)
        self._health = health
        self._observe = observe
        # The monotonic clock of what the sink caches: the manifest, the token file's looks.
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._batch_known: bool | None = {"on": True, "off": False}.get(settings.batch)
        self._batch_checked_at = float("-inf")
        token = settings.token.get_secret_value() if settings.token is not None else None
        self._token = token
        # The token follows its file when an operator rotates it (relayd/config/secret_files.py).
        self._token_file = (
            TokenFile(settings.token_file, token, clock=clock)
            if token and settings.token_file is not None
            else None
        )
        # Every form of every token this sink has sent: rotated-out ones stay redacted.
        self._secrets = secret_forms(token) if token else ()
        self._pieces = SecretPieces.of(self._secrets)

    async def start(self) -> None:
        # Authorization is set per request: the token may change while the session lives.
        self._session = new_session(self._settings, SESSION_HEADERS)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    # --- the Sink interface ---

    async def group_requests(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope]
    ) -> list[list[ClaimedRow]]:
        """First attempts of plain jobs go in batches where the server offers them; a row
        that may already be on the sink, or that carries options a batch would drop
        (scheduling, expiry, uniqueness), goes alone."""
        candidates = [
            row for row in rows if not row.claimed_before and batchable(envelopes[row.event_id])
        ]
        if len(candidates) < 2 or not await self._batch_enabled():
            candidates = []
        in_batch = {row.event_id for row in candidates}
        batches = chunk_batches(
            candidates,
            max_jobs=self._settings.batch_max_jobs,
            max_bytes=self._settings.batch_max_bytes,
        )
        return batches + [[row] for row in rows if row.event_id not in in_batch]

    async def publish(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], *, window: SendWindow
    ) -> dict[str, Outcome]:
        if len(rows) == 1:
            row = rows[0]
            outcome = await self._publish_row(row, envelopes[row.event_id], window)
            if self._pieces.whole:
                outcome = scrubbed(outcome, self._pieces)
            return {row.event_id: outcome}
        outcomes = await self._publish_batch(rows, envelopes, window)
        if not self._pieces.whole:
            return outcomes
        return {event_id: scrubbed(o, self._pieces) for event_id, o in outcomes.items()}

    async def reconcile(self, row: ClaimedRow, envelope: Envelope) -> Outcome | NotFound:
        return scrubbed(await self._get(row, envelope, suffix="-get"), self._pieces)

    async def check(self) -> tuple[bool, str]:
        """GET the manifest: it needs the bearer token where the server has one."""
        answer = await self._exchange("GET", MANIFEST_PATH, None, "relayd-check")
        if isinstance(answer, SinkDown):
            return False, f"unreachable: {scrubbed(answer, self._pieces).error}"
        if answer.status in (401, 403):
            return False, f"HTTP {answer.status}: not authorised (check sink.token_file)"
        if answer.status != 200:
            # A failing server (5xx, 429) is no reason to doubt the URL.
            wrong_url = answer.status in (404, 405) or 300 <= answer.status < 400
            hint = " (check sink.url)" if wrong_url else ""
            return False, f"HTTP {answer.status} for {MANIFEST_PATH}{hint}"
        manifest = parse_json(answer.body)
        if not isinstance(manifest, dict):
            return False, f"{MANIFEST_PATH} is not an OJS manifest"
        implementation = manifest.get("implementation")
        name = implementation.get("name") if isinstance(implementation, dict) else None
        capabilities = manifest.get("capabilities")
        batches = isinstance(capabilities, dict) and capabilities.get("batch_enqueue") is True
        offered = "offered" if batches else "not offered"
        return True, f"{name or 'an OJS server'} answers; batch enqueue {offered}"

    # --- single rows ---

    async def _publish_row(
        self, row: ClaimedRow, envelope: Envelope, window: SendWindow
    ) -> Outcome:
        """GET first if an earlier attempt may have landed, else POST; a 409 is reconciled."""
        if row.claimed_before:
            found = await self.reconcile(row, envelope)
            if not isinstance(found, NotFound):
                return found
        posted = await self._post(row, envelope, window)
        if not isinstance(posted, Reconcile):
            return posted
        found = await self._get(row, envelope, suffix="-reconcile")
        if not isinstance(found, NotFound):
            return found
        if posted.existing_job_id and posted.existing_job_id != row.event_id:
            # A unique policy rejected ours in favour of an existing job (docs/ojs.md).
            return Published(sink_state="deduplicated", sink_job_id=posted.existing_job_id)
        return RetryLater(f"{posted.error}, yet GET finds no job with this id")

    async def _post(
        self, row: ClaimedRow, envelope: Envelope, window: SendWindow
    ) -> Outcome | Reconcile:
        """POST the stored job; the request carries the producer's trace context that the
        row's meta holds (`traceparent`, `tracestate`), as stored, when it is valid. (A batch
        request carries none: its jobs come from many traces, each in its own meta.)"""
        if window.closed():
            return NotStarted()
        answer = await self._exchange(
            "POST",
            JOBS_PATH,
            row.job,
            request_id(row.event_id, row.attempts),
            carried(envelope.meta),
        )
        return self._report(
            answer if isinstance(answer, SinkDown) else classify_post(answer, row.event_id)
        )

    async def _get(self, row: ClaimedRow, envelope: Envelope, suffix: str) -> Outcome | NotFound:
        answer = await self._exchange(
            "GET",
            f"{JOBS_PATH}/{row.event_id}",
            None,
            request_id(row.event_id, row.attempts, suffix),
        )
        return self._report(
            answer if isinstance(answer, SinkDown) else classify_get(answer, envelope),
            write=False,
        )

    # --- batches ---

    async def _batch_enabled(self) -> bool:
        """`sink.batch`, or for `auto` the manifest's `capabilities.batch_enqueue` (cached;
        a manifest that does not answer in time means no batches for now)."""
        if self._settings.batch != "auto":
            return bool(self._batch_known)
        ttl = _MANIFEST_TTL_S if self._batch_known is not None else _MANIFEST_RETRY_S
        if self._clock() - self._batch_checked_at < ttl:
            return bool(self._batch_known)
        self._batch_checked_at = self._clock()
        try:
            async with asyncio.timeout(_MANIFEST_TIMEOUT_S):
                answer = await self._exchange("GET", MANIFEST_PATH, None, "relayd-manifest")
        except TimeoutError:
            answer = SinkDown("the manifest did not answer in time")
        if isinstance(answer, SinkDown) or answer.status != 200:
            self._batch_known = None
            return False
        manifest = parse_json(answer.body)
        capabilities = manifest.get("capabilities") if isinstance(manifest, dict) else None
        self._batch_known = (
            isinstance(capabilities, dict) and capabilities.get("batch_enqueue") is True
        )
        return self._batch_known

    async def _publish_batch(
        self, rows: Sequence[ClaimedRow], envelopes: Mapping[str, Envelope], window: SendWindow
    ) -> dict[str, Outcome]:
        """First attempts through POST /jobs/batch; see `classify_batch` for what each answer
        leads to. A part left with one row is published as a single job."""
        outcomes: dict[str, Outcome] = {}
        pending = [list(rows)]
        while pending:
            chunk = pending.pop()
            if len(chunk) == 1:
                row = chunk[0]
                outcomes[row.event_id] = await self._publish_row(
                    row, envelopes[row.event_id], window
                )
                continue
            if window.closed():
                outcomes.update((row.event_id, NotStarted()) for row in chunk)
                continue
            answer = await self._exchange(
                "POST",
                BATCH_PATH,
                batch_body(chunk),
                request_id(chunk[0].event_id, chunk[0].attempts, f"-batch{len(chunk)}"),
            )
            if isinstance(answer, SinkDown):
                self._report(answer)
                outcomes.update((row.event_id, answer) for row in chunk)
                continue
            verdict = classify_batch(answer, chunk)
            if isinstance(verdict, BatchFailed):
                failed = self._report(verdict.outcome)
                outcomes.update((row.event_id, failed) for row in chunk)
                continue
            # One exchange for every row of the chunk: it stored rows if any is published,
            # else the server answered with a verdict (a refused item, batches not served).
            self._report(_stored(verdict) or _BATCH_VERDICT)
            if isinstance(verdict, BatchAccepted):
                outcomes.update(verdict.outcomes)
            elif isinstance(verdict, BatchNotServed):
                # The manifest promised batches the server does not serve: publish singly.
                self._batch_known, self._batch_checked_at = False, self._clock()
                outcomes.update((row.event_id, NotStarted()) for row in chunk)
            elif isinstance(verdict, BatchDrop):
                outcomes[chunk[verdict.index].event_id] = verdict.dead
                absent = await self._absent(chunk[: verdict.index], envelopes, outcomes)
                rest = absent + chunk[verdict.index + 1 :]
                if rest:
                    pending.append(rest)
            elif isinstance(verdict, BatchSplit):
                half = len(chunk) // 2
                pending.extend((chunk[:half], chunk[half:]))
        return outcomes

    async def _absent(
        self,
        rows: Sequence[ClaimedRow],
        envelopes: Mapping[str, Envelope],
        outcomes: dict[str, Outcome],
    ) -> list[ClaimedRow]:
        """Reconcile each row (C2): record what the sink holds in `outcomes`; return the rows
        it does not hold, which may be sent again."""
        found = await asyncio.gather(
            *(self._get(row, envelopes[row.event_id], suffix="-batch-get") for row in rows)
        )
        absent: list[ClaimedRow] = []
        for row, result in zip(rows, found, strict=True):
            if isinstance(result, NotFound):
                absent.append(row)
            else:
                outcomes[row.event_id] = result
        return absent

    # --- transport ---

    def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | None,
        rid: str,
        trace: Mapping[str, str] | None = None,
    ) -> Awaitable[Response | SinkDown]:
        """One exchange with the server, for the caller to await. Without a token file the
        token never changes: the request is built at once, with no coroutine of its own."""
        if self._token_file is not None:
            return self._exchange_reading_token(method, path, body, rid, trace)
        return self._request(method, path, body, rid, trace)

    async def _exchange_reading_token(
        self,
        method: str,
        path: str,
        body: bytes | None,
        rid: str,
        trace: Mapping[str, str] | None,
    ) -> Response | SinkDown:
        await self._bearer()  # the file's current token, as self._token
        return await self._request(method, path, body, rid, trace)

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        rid: str,
        trace: Mapping[str, str] | None,
    ) -> Awaitable[Response | SinkDown]:
        if self._session is None:
            raise RuntimeError("OjsSink.start() was not called")
        headers = {"X-Request-Id": rid}
        if trace:
            headers.update(trace)
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        if body is not None:
            headers["Content-Type"] = MEDIA_TYPE
        return exchange(
            self._session,
            method,
            self._url + path,
            body=body,
            headers=headers,
            limit_bytes=_MAX_RESPONSE_BYTES,
            check="sink.token_file and sink.url",
            observe=self._observe,
            # Without a token there is none to refresh (a token file needs one) nor to
            # redact: no coroutine per answer to look at it.
            answered=self._answered if self._secrets else None,
        )

    async def _answered(self, status: int, content: bytes) -> bytes:
        if status in (401, 403) and self._token_file is not None:
            # Refused: the operator may have rotated the token; the next request (the
            # breaker's probe) sends the file's new one. This answer can only echo the
            # token it was sent, which is redacted already.
            await self._token_file.refresh()
        if not 200 <= status < 300:
            # Error text may reach logs and last_error; a server or proxy that echoes our
            # Authorization header must not put the token there.
            content = redact(content, self._secrets)
        return content

    def _report(self, outcome: _Told, *, write: bool = True) -> _Told:
        """`report` an exchange's outcome to the breaker, its error text scrubbed of every
        piece of a token first: the breaker logs it as the reason it opened, and the
        heartbeat stores it."""
        return report(self._health, scrubbed(outcome, self._pieces), write=write)

    async def _bearer(self) -> str | None:
        """The token to send now: the token file's current one (see TokenFile.current)."""
        if self._token_file is not None:
            token = await self._token_file.current()
            if token != self._token:
                self._token = token
                forms = {*self._secrets, *secret_forms(token)}
                self._secrets = tuple(sorted(forms, key=len, reverse=True))
                self._pieces = SecretPieces.of(self._secrets)
        return self._token


# What the breaker is told of a batch answer that stored no row: a verdict, not a failure.
_BATCH_VERDICT = RetryLater("the batch was answered without storing a row")


def _stored(verdict: BatchVerdict) -> Published | None:
    """A row a batch answer says was stored, if any."""
    if isinstance(verdict, BatchAccepted):
        for outcome in verdict.outcomes.values():
            if isinstance(outcome, Published):
                return outcome
    return None
