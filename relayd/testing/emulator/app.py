"""The emulator as an HTTP server: `Emulator` (the Python control API and the aiohttp app:
request checks, scripted faults, dispatch, the control endpoints) and serving it on a port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import re
import secrets
import signal
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from relayd.producer import uuid7
from relayd.testing.emulator.config import EmulatorConfig
from relayd.testing.emulator.faults import FaultPlan, FaultRule
from relayd.testing.emulator.producer import ProducerEndpoints
from relayd.testing.emulator.state import EmulatorState, LedgerEntry
from relayd.testing.emulator.wire import (
    ACCEPTED_MEDIA_TYPES,
    CONTROL_PREFIX,
    DEFAULT_CODES,
    HEALTH_PATH,
    OJS_MEDIA_TYPE,
    Call,
    Reject,
    Reply,
    Route,
    dumps,
    format_time,
    internal_error,
    invalid,
    loads,
)
from relayd.testing.emulator.wire_faults import (
    Answer,
    first_jobs,
    omit_ids,
    oversized,
    trickle,
)
from relayd.testing.emulator.worker import WorkerEndpoints

logger = logging.getLogger(__name__)

_CONTROL_BODY_BYTES = 1 << 20


class Emulator:
    """The server's state and its aiohttp application; one instance per test or process."""

    def __init__(
        self, config: EmulatorConfig | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config or EmulatorConfig()
        self._state = EmulatorState(self.config, clock)
        self._closing = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._faults = FaultPlan()
        # Looked up in order: the first route whose pattern and method match serves a call.
        self._routes = [
            *ProducerEndpoints(self._state).routes(),
            *WorkerEndpoints(self._state).routes(),
            *self._control_routes(),
        ]

    # --- Python control API ----------------------------------------------------------

    def now(self) -> float:
        """The emulator's clock (epoch seconds), including any advance."""
        return self._state.now()

    def advance_clock(self, seconds: float) -> None:
        """Move the emulator's clock forward, e.g. past a lease or the retention period."""
        self._state.advance_clock(seconds)
        self._notify()

    def reset(self) -> list[tuple[str, float]]:
        """Forget every job, the ledger, the faults, the events and any clock advance;
        returns the receipts it forgot (see `receipts`)."""
        forgotten = self.receipts()
        self._faults.clear()
        self._state.reset()
        self._notify()
        return forgotten

    def add_fault(self, rule: FaultRule) -> str:
        """Arm a fault rule; returns its id."""
        rule_id = self._faults.add(rule)
        self._notify()
        return rule_id

    def clear_faults(self) -> int:
        """Disarm every fault rule; returns how many there were."""
        count = self._faults.clear()
        self._notify()
        return count

    def faults(self) -> list[dict[str, Any]]:
        """The armed rules with their fired counts (the JSON of GET /_emulator/faults)."""
        return self._faults.to_json()

    def fault_fired(self, rule_id: str) -> int:
        """How many times a rule fired."""
        return self._faults.fired(rule_id)

    def job(self, job_id: str) -> dict[str, Any] | None:
        """The stored job as GET would show it, or None."""
        return self._state.job(job_id)

    def arrivals(self) -> list[str]:
        """The ids of the jobs stored so far, in the order they were stored (a job stored
        again appears again)."""
        return list(self._state.arrivals)

    def receipts(self) -> list[tuple[str, float]]:
        """`arrivals`, each with the time its request was received on the emulator's clock
        (epoch seconds): when its handler began, before the body was read. A batch's jobs
        share their request's time."""
        return list(zip(self._state.arrivals, self._state.received_at, strict=True))

    def ledger(self) -> dict[str, LedgerEntry]:
        """A snapshot of the ledger, by job id."""
        return self._state.ledger()

    def ledger_json(self) -> dict[str, Any]:
        """The JSON of GET /_emulator/ledger."""
        return {"jobs": {job_id: e.to_json() for job_id, e in self.ledger().items()}}

    async def wait_until(self, predicate: Callable[[Emulator], bool]) -> None:
        """Return once predicate(self) holds; re-checked after every request and control
        call. Bound it with asyncio.timeout."""
        loop = asyncio.get_running_loop()
        while not predicate(self):
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            await waiter

    def close(self) -> None:
        """Wake every delayed answer so a server stop is not held up by scripted latency."""
        self._closing.set()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # --- HTTP ------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        """An aiohttp application serving this emulator's state."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or f"req_{uuid7(self.now())}"
        rule: FaultRule | None = None
        try:
            reply, rule = await self._serve(request, request_id)
        except Reject as exc:
            reply = Reply(exc.status, exc.envelope(request_id))
        except Exception:
            logger.exception("emulator.handler_crashed path=%s", request.path)
            reply = Reply(500, internal_error().envelope(request_id))
        finally:
            self._notify()
        if reply is None:
            # The transport is gone; aiohttp's write of this response fails quietly.
            return web.Response(status=500)
        headers = {
            "Content-Type": OJS_MEDIA_TYPE,
            "OJS-Version": self.config.ojs_version,
            "X-Request-Id": request_id,
            **reply.headers,
        }
        body = reply.raw if reply.raw is not None else dumps(reply.body)
        answer = Answer(reply.status, headers, body)
        if rule is not None and rule.action == "trickle":
            await trickle(request, answer, rule.delay_ms, self._closing)
            # The transport is closed; aiohttp's write of this response fails quietly.
            return web.Response(status=500)
        if rule is not None and rule.action == "oversized":
            return await oversized(request, answer, rule.size_bytes)
        return web.Response(status=reply.status, body=body, headers=headers)

    async def _serve(
        self, request: web.Request, request_id: str
    ) -> tuple[Reply | None, FaultRule | None]:
        """The answer (None: the connection was dropped) and the fault rule that fired."""
        path, method = request.path, request.method
        received_at = self._state.now()
        if path.startswith(CONTROL_PREFIX):
            body = await self._read_body(request, _CONTROL_BODY_BYTES)
            return self._dispatch(self._call(request, request_id, body, received_at)), None
        self._state.advance()
        self._check_auth(request)
        self._check_version(request)
        if method in ("POST", "PUT", "PATCH"):
            self._check_content_type(request)
        call = self._call(request, request_id, await self._read_body(request), received_at)
        job_ids = call.job_ids()
        posted = self._count_request(call, job_ids, request.headers.get("traceparent"))
        rule = self._faults.take(method, path, job_ids)
        reply: Reply | None
        if rule is not None and rule.action == "drop":
            self._drop(request)
            reply = None
        elif rule is not None and rule.action == "status":
            reply = self._fault_reply(rule, request_id)
        else:
            if rule is not None and rule.action == "latency":
                await self._pause(rule.delay_ms)
            if rule is not None and rule.action == "store_some_then_status":
                call = first_jobs(call, rule.count)
            reply = self._dispatch(call)
            if posted:
                await self.stored()
            if rule is not None:
                reply = await self._after_store(rule, request, call, reply)
        for job_id in posted:
            self._state.counts(job_id).post_statuses.append(None if reply is None else reply.status)
        return reply, rule

    async def stored(self) -> None:
        """A POST's jobs are stored and its answer is not sent yet. Nothing happens here: it
        is the place where a fault test holds the emulator (its launcher wraps this method)."""

    async def _after_store(
        self, rule: FaultRule, request: web.Request, call: Call, reply: Reply
    ) -> Reply | None:
        """What a fault that lets the request be processed does to its answer."""
        match rule.action:
            case "store_then_drop":
                self._drop(request)
                return None
            case "store_then_delay":
                await self._pause(rule.delay_ms)
            case "store_then_status" | "store_some_then_status":
                return self._fault_reply(rule, call.request_id)
            case "omit_ids":
                return omit_ids(call, reply, rule.count)
            case "oversized":
                return dataclasses.replace(reply, status=rule.status)
        return reply

    def _call(self, request: web.Request, request_id: str, body: bytes, received_at: float) -> Call:
        call = Call(
            method=request.method,
            path=request.path,
            params={},
            query=dict(request.query),
            request_id=request_id,
            body=body,
            received_at=received_at,
        )
        if body:
            try:
                call.payload = loads(body)
                call.payload_ok = True
            except (ValueError, UnicodeDecodeError):
                call.payload_ok = False
        for route in self._routes:
            match = route.pattern.match(request.path)
            if match and route.method == request.method:
                call.params = match.groupdict()
                break
        return call

    def _dispatch(self, call: Call) -> Reply:
        allowed: list[str] = []
        for route in self._routes:
            if route.pattern.match(call.path) is None:
                continue
            if route.method != call.method:
                allowed.append(route.method)
                continue
            if not route.enabled:
                break
            try:
                return route.handler(call)
            except Reject as exc:
                return Reply(exc.status, exc.envelope(call.request_id))
        if allowed:
            refusal = Reject(405, "invalid_request", f"Method {call.method} not allowed.")
            return Reply(405, refusal.envelope(call.request_id), {"Allow": ", ".join(allowed)})
        refusal = Reject(404, "not_found", f"No route for {call.method} {call.path}.")
        return Reply(404, refusal.envelope(call.request_id))

    def _check_auth(self, request: web.Request) -> None:
        token = self.config.auth_token
        if token is None or request.path == HEALTH_PATH:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Reject(401, "unauthorized", "Missing or malformed Bearer token.")
        if not secrets.compare_digest(credentials.strip().encode(), token.encode()):
            raise Reject(403, "forbidden", "The Bearer token is not valid for this server.")

    def _check_version(self, request: web.Request) -> None:
        asked = request.headers.get("OJS-Version")
        if asked is not None and asked.strip().split(".")[0] != "1":
            raise Reject(
                422, "unsupported", f"OJS version {asked!r} is not supported.", retryable=False
            )

    def _check_content_type(self, request: web.Request) -> None:
        header = request.headers.get("Content-Type")
        if header is None or not header.strip():
            return  # the reference middleware accepts a POST without a Content-Type
        media_type = header.split(";", 1)[0].strip().lower()
        if media_type not in ACCEPTED_MEDIA_TYPES:
            raise invalid(
                "Unsupported Content-Type. Expected 'application/openjobspec+json' or "
                "'application/json'.",
                received=header,
            )

    async def _read_body(self, request: web.Request, limit: int | None = None) -> bytes:
        limit = self.config.max_body_bytes if limit is None else limit
        too_large = Reject(
            413,
            "invalid_request",
            f"The request body exceeds {limit} bytes.",
            details={"max_bytes": limit},
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        # Read with a bound rather than request.read(): an endless body must not be buffered.
        async for chunk in request.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _count_request(self, call: Call, job_ids: list[str], traceparent: str | None) -> list[str]:
        """Count POSTs and GETs per job id, and note each POST's `traceparent` header;
        returns the ids whose POST outcome to record."""
        if call.method == "POST" and call.path in ("/ojs/v1/jobs", "/ojs/v1/jobs/batch"):
            for job_id in job_ids:
                counts = self._state.counts(job_id)
                counts.posts += 1
                counts.post_traceparents.append(traceparent)
            return job_ids
        if call.method == "GET" and "id" in call.params:
            self._state.counts(call.params["id"]).gets += 1
        return []

    def _fault_reply(self, rule: FaultRule, request_id: str) -> Reply:
        headers: dict[str, str] = {}
        if rule.retry_after is not None:
            headers["Retry-After"] = rule.retry_after
        if rule.content_type is not None:
            headers["Content-Type"] = rule.content_type
        if rule.body is not None:
            return Reply(rule.status, None, headers, raw=rule.body.encode())
        code = rule.code or DEFAULT_CODES.get(
            rule.status, "backend_error" if rule.status >= 500 else "invalid_request"
        )
        retryable = rule.status == 429 or rule.status >= 500
        message = "an internal error occurred" if code == "internal_error" else "injected fault"
        exc = Reject(rule.status, code, message, retryable=retryable)
        return Reply(rule.status, exc.envelope(request_id), headers)

    @staticmethod
    def _drop(request: web.Request) -> None:
        # abort() closes the socket at once, so the client sees a disconnect, not an answer.
        if request.transport is not None:
            request.transport.abort()

    async def _pause(self, delay_ms: int) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_ms / 1000):
                await self._closing.wait()

    # --- control endpoints (no auth, no faults) ---------------------------------------

    def _control_routes(self) -> list[Route]:
        return [
            Route("GET", re.compile(r"^/_emulator/ledger$"), self._control_ledger),
            Route("GET", re.compile(r"^/_emulator/arrivals$"), self._control_arrivals),
            Route("GET", re.compile(r"^/_emulator/faults$"), self._control_faults),
            Route("POST", re.compile(r"^/_emulator/faults$"), self._control_add_faults),
            Route("DELETE", re.compile(r"^/_emulator/faults$"), self._control_clear_faults),
            Route("POST", re.compile(r"^/_emulator/reset$"), self._control_reset),
            Route("POST", re.compile(r"^/_emulator/clock$"), self._control_clock),
        ]

    def _control_ledger(self, call: Call) -> Reply:
        del call
        return Reply(200, self.ledger_json())

    def _control_arrivals(self, call: Call) -> Reply:
        del call
        return Reply(200, _receipts_json(self.receipts()))

    def _control_faults(self, call: Call) -> Reply:
        del call
        return Reply(200, {"rules": self.faults()})

    def _control_add_faults(self, call: Call) -> Reply:
        payload = call.json()
        if isinstance(payload, dict) and "rules" in payload:
            payload = payload["rules"]
        items = payload if isinstance(payload, list) else [payload]
        rules: list[FaultRule] = []
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                raise invalid(f"fault rule {index} must be a JSON object")
            try:
                rules.append(FaultRule.from_json(item))
            except (TypeError, ValueError) as exc:
                raise invalid(f"fault rule {index}: {exc}", index=index) from exc
        ids = [self.add_fault(rule) for rule in rules]
        armed = [rule for rule in self.faults() if rule["id"] in ids]
        return Reply(201, {"rules": armed})

    def _control_clear_faults(self, call: Call) -> Reply:
        del call
        return Reply(200, {"cleared": self.clear_faults()})

    def _control_reset(self, call: Call) -> Reply:
        # Asked for, the receipts forgotten come back in the same answer: a caller that
        # resets as it goes (to keep the emulator small) loses none between two calls.
        asked = call.payload_ok and isinstance(call.payload, dict)
        wanted = asked and call.payload.get("receipts") is True
        forgotten = self.reset()
        return Reply(200, {"reset": True, **(_receipts_json(forgotten) if wanted else {})})

    def _control_clock(self, call: Call) -> Reply:
        advance = call.json_object().get("advance_s", 0)
        if isinstance(advance, bool) or not isinstance(advance, int | float) or advance < 0:
            raise invalid("advance_s must be a non-negative number", field="advance_s")
        self.advance_clock(float(advance))
        return Reply(200, {"now": format_time(self.now())})


def _receipts_json(receipts: list[tuple[str, float]]) -> dict[str, Any]:
    """Receipts as the control API shows them: ids and receipt times in two lists."""
    return {
        "arrivals": [job_id for job_id, _ in receipts],
        "received_at": [at for _, at in receipts],
    }


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server-side TLS context with this certificate (chain) and key; OSError or
    ssl.SSLError if they cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context


# --- serving it --------------------------------------------------------------------------


@dataclass
class RunningEmulator:
    """An emulator served on a loopback port; `stop()` (or leaving `async with`) ends it."""

    url: str
    emulator: Emulator
    _runner: web.AppRunner = field(repr=False)
    _stopped: bool = field(default=False, repr=False)

    async def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.emulator.close()
        await self._runner.cleanup()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def start_emulator(
    config: EmulatorConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
) -> RunningEmulator:
    """Serve a fresh emulator on host:port (port 0: a free one) and return at once; over
    HTTPS with `ssl_context`."""
    emulator = Emulator(config)
    # A short shutdown grace: in-flight answers are only scripted delays, woken by close().
    runner = web.AppRunner(emulator.make_app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    scheme = "http" if ssl_context is None else "https"
    return RunningEmulator(
        url=f"{scheme}://{shown}:{bound_port}", emulator=emulator, _runner=runner
    )


def serve(
    host: str, port: int, config: EmulatorConfig, *, ssl_context: ssl.SSLContext | None = None
) -> None:
    """Run an emulator until SIGTERM or SIGINT, then stop cleanly (``relayd emulator``);
    over HTTPS with `ssl_context`."""
    # The server keeps every job, event and ledger entry: with the default thresholds the
    # cyclic collector walks them all again and again (a fifth of a busy emulator's CPU).
    # Its objects form no cycles worth collecting sooner.
    gc.set_threshold(100_000, 50, 1000)
    asyncio.run(_serve_until_signal(host, port, config, ssl_context))


async def _serve_until_signal(
    host: str, port: int, config: EmulatorConfig, ssl_context: ssl.SSLContext | None
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        async with await start_emulator(
            config, host=host, port=port, ssl_context=ssl_context
        ) as running:
            # The one line a user (or a test that asked for port 0) needs: where it listens.
            print(f"ojs-emulator listening on {running.url}", flush=True)  # noqa: T201
            await stop.wait()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
