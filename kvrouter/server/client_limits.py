"""The client edge: what one client connection may hold, so that no client takes the router down, starves the
others or blows its memory.

* Connections (`ClientEdge.protocol_factory`, served by `EdgeSite`): at most `max_client_connections` open, also
  kept under the process's file-descriptor limit less 256 (replicas, Redis and the tokenizer need some); one more
  is answered 503 and closed, counted, and logged at most once per `LOG_INTERVAL_S`. A connection with no request
  begun is closed after `client_idle_timeout_s` (aiohttp's keep-alive timer, which also runs from the moment a
  connection opens). Once a request's first byte arrived, its line and headers must be complete within
  `client_header_timeout_s`, or the connection is closed (slowloris). A kept-alive connection's
  `client_keepalive_requests`-th answer says `Connection: close` and the connection closes after it
  (`ClientEdge.on_response_prepare`): the kernel (SO_REUSEPORT, `--workers`) or a Service spreads connections, not
  requests, so without it a client's few long-lived connections stay on the worker or pod they first reached, also
  after the others restart; counted in kvrouter_client_connections_recycled_total.
* Bodies (`ClientEdge.middleware`, the outermost middleware): every request body is read here, before any handler
  runs — so a slow body never holds one of the proxy's concurrency slots — under a deadline that grows with what
  arrived: `client_body_timeout_s + received / client_body_min_bytes_per_s`; past it the client gets 408 and the
  connection is closed. A body larger than `max_body_bytes` is a 413, after inflation too: gzip and deflate bodies
  are inflated here (kvrouter/server/body_encoding.py), 256 KiB of output at a time with the event loop given back in
  between, and reading stops at the cap, so a bomb costs at most the cap and never stalls other requests; other
  encodings are a 415. All bodies being read at once may buffer `client_body_buffer_bytes` together (429 beyond).
  An inflated body reaches the handler without its Content-Encoding header: what is forwarded is the inflated
  bytes.
* Prompts are capped by the tokenizer (kvrouter/tokenization.py: max_prompt_chars, max_prompt_tokens).

Every refusal is counted in kvrouter_client_rejections_total{reason}; open connections in kvrouter_client_connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from kvrouter.config import Settings
from kvrouter.metrics import RouterMetrics
from kvrouter.server.body_encoding import SUPPORTED, BadEncoding, Inflater
from kvrouter.server.streaming import REQUEST_ID_HEADER
from kvrouter.tokenization import PromptLimits

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
FD_RESERVE = 256
_BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "router has too many client connections; retry later",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 75.0
    body_timeout_s: float = 10.0
    body_min_bytes_per_s: int = 16384
    max_connections: int = 4096
    max_body_bytes: int = 32 * 1024 * 1024
    body_buffer_bytes: int = 1024 * 1024 * 1024
    keepalive_requests: int = 1000
    """Answers a kept-alive connection carries; the last says Connection: close (0: no limit)."""

    @classmethod
    def from_settings(cls, settings: Settings, fd_limit: int | None = None) -> EdgeLimits:
        connections = settings.max_client_connections
        if fd_limit is not None and fd_limit - FD_RESERVE < connections:
            connections = max(1, fd_limit - FD_RESERVE)
            log.warning(
                "max_client_connections %d is above the file-descriptor limit %d less %d: capped at %d "
                "(raise `ulimit -n` to allow more)",
                settings.max_client_connections,
                fd_limit,
                FD_RESERVE,
                connections,
            )
        return cls(
            header_timeout_s=settings.client_header_timeout_s,
            idle_timeout_s=settings.client_idle_timeout_s,
            body_timeout_s=settings.client_body_timeout_s,
            body_min_bytes_per_s=settings.client_body_min_bytes_per_s,
            max_connections=connections,
            max_body_bytes=settings.max_body_bytes,
            body_buffer_bytes=settings.client_body_buffer_bytes,
            keepalive_requests=settings.client_keepalive_requests,
        )

    def body_deadline(self, received: int) -> float:
        """Seconds a body may have taken so far, given the bytes that arrived."""
        return self.body_timeout_s + received / self.body_min_bytes_per_s


def prompt_limits(settings: Settings) -> PromptLimits:
    return PromptLimits(
        max_chars=settings.max_prompt_chars,
        max_tokens=settings.max_prompt_tokens,
        large_chars=settings.tokenizer_large_prompt_chars,
        large_queue=settings.tokenizer_large_queue,
    )


def soft_fd_limit() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


class RateLimitedLog:
    """One warning per reason per `interval_s`, with how many were folded into it."""

    def __init__(self, clock: Callable[[], float], interval_s: float = LOG_INTERVAL_S) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._folded: dict[str, int] = {}

    def warn(self, reason: str, message: str, *args: object) -> None:
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._folded[reason] = self._folded.get(reason, 0) + 1
            return
        self._last[reason] = now
        folded = self._folded.pop(reason, 0)
        suffix = f" ({folded} more since the last such line)" if folded else ""
        log.warning(message + suffix, *args)


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    response = web.json_response(body, status=status)
    response.force_close()
    return response


class ClientEdge:
    """Connection cap, header/idle/body timeouts and the body-buffer budget of one router process."""

    def __init__(
        self, limits: EdgeLimits, metrics: RouterMetrics, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        self.clock = clock
        self.log = RateLimitedLog(self.clock)
        self.open = 0
        self.buffered = 0
        self._connections: dict[asyncio.Protocol, _Connection] = {}
        self._rejections = {reason: metrics.client_rejections.labels(reason) for reason in REASONS}
        self.malformed = MalformedRequestLog(self)

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's per-connection settings: the idle timer and header size bounds."""
        # auto_decompress off: aiohttp would inflate inside its read callback, in one call per read (see
        # kvrouter/server/body_encoding.py); the middleware inflates in slices instead.
        return {
            "keepalive_timeout": self.limits.idle_timeout_s,
            "max_field_size": 65536,
            "auto_decompress": False,
        }

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """The connection's `keepalive_requests`-th answer closes it (`app.on_response_prepare`, which aiohttp
        runs after the answer's headers are made and before they are sent, so the header can still say so)."""
        connection = self._connections.get(request.protocol)
        limit = self.limits.keepalive_requests
        if connection is None or not limit or connection.served < limit or connection.recycled:
            return
        connection.recycled = True
        response.headers["Connection"] = "close"
        response.force_close()  # aiohttp closes the connection once this answer is written
        self.metrics.client_connections_recycled.inc()

    def refuse(self, reason: str) -> None:
        self._rejections[reason].inc()

    # -- connections ----------------------------------------------------------------------------------------

    def protocol_factory(self, server: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            return _Connection(self, server())

        return make

    def _admit(self, connection: _Connection) -> bool:
        if self.open >= self.limits.max_connections:
            self.refuse("connections")
            self.log.warn(
                "connections",
                "client connection refused: %d open, the cap (max_client_connections) is %d",
                self.open,
                self.limits.max_connections,
            )
            return False
        self.open += 1
        self.metrics.client_connections.set(self.open)
        self._connections[connection.inner] = connection
        return True

    def _gone(self, connection: _Connection) -> None:
        self.open -= 1
        self.metrics.client_connections.set(self.open)
        self._connections.pop(connection.inner, None)

    def _header_timeout(self) -> None:
        self.refuse("header_timeout")
        self.log.warn(
            "header_timeout",
            "client connection closed: request headers not complete within %.0fs (client_header_timeout_s)",
            self.limits.header_timeout_s,
        )

    # -- requests -------------------------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        connection = self._connections.get(request.protocol)
        if connection is not None:
            connection.request_started()
        try:
            if request.body_exists:
                encoding = request.headers.get("content-encoding")
                compressed = encoding is not None
                if compressed:
                    # The inflated bytes go on: the label must not (the replica would inflate them again).
                    headers = request.headers.copy()
                    del headers["content-encoding"]
                    try:
                        request = request.clone(headers=headers)
                    except UnicodeEncodeError:  # clone re-encodes headers as strict UTF-8
                        self.refuse("malformed_request")
                        unreadable = _error(400, "compressed requests need UTF-8 header values", "invalid_header")
                        await self._answer_and_close(request, unreadable)
                        return unreadable
                refused = await self._read_body(request, encoding=encoding)
                if refused is not None:
                    refused.headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
                    if compressed:
                        await self._answer_and_close(request, refused)
                    # Otherwise aiohttp's lingering close reads (and drops) the rest of the body for a few seconds,
                    # so the client sees this answer instead of a reset; the response closes the connection.
                    return refused
            return await handler(request)
        finally:
            if connection is not None:
                connection.request_finished()

    @staticmethod
    async def _answer_and_close(request: web.Request, refused: web.Response) -> None:
        """Lingering over a refused compressed body would inflate the rest of it: cut the connection at once
        (a client still sending may see a reset rather than the answer; a bomb's sender deserves no better)."""
        await refused.prepare(request)
        await refused.write_eof()
        request.protocol.force_close()  # flushes the answer, then closes; no lingering read of the rest

    async def _read_body(self, request: web.Request, *, encoding: str | None) -> web.Response | None:
        """Read the whole body into the request (its `read()` returns it), or the answer that refuses it."""
        limits = self.limits
        declared = request.content_length
        if declared is not None and declared > limits.max_body_bytes and encoding is None:
            return self._too_large()
        inflater: Inflater | None = None
        if encoding is not None:
            try:
                inflater = Inflater(encoding)
            except ValueError:
                self.refuse("malformed_request")
                supported = ", ".join(SUPPORTED)
                return _error(415, f"unsupported Content-Encoding (supported: {supported})", "unsupported_encoding")
        payload = request.content
        started = self.clock()
        body = bytearray()
        received = 0
        try:
            while True:
                remaining = started + limits.body_deadline(received) - self.clock()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    # What has already arrived (usually the whole body with its headers) needs no timer.
                    chunk = payload.read_nowait()
                    if not chunk and not payload.is_eof():
                        async with asyncio.timeout(remaining):
                            chunk = await payload.readany()
                except TimeoutError:
                    return self._too_slow(len(body))
                except (RequestPayloadError, HttpProcessingError) as error:
                    # Broken chunked framing, or a Content-Encoding the bytes do not match: the client's mistake.
                    self.refuse("malformed_request")
                    reason = str(error.__cause__ or error).strip().splitlines()[0][:200]
                    return _error(400, f"the request body cannot be read: {reason}", "invalid_body")
                if not chunk:
                    break
                received += len(chunk)
                if inflater is None:
                    refused = self._take(body, chunk)
                    if refused is not None:
                        return refused
                    continue
                try:
                    for piece in inflater.feed(chunk):
                        refused = self._take(body, piece)
                        if refused is not None:
                            return refused
                        await asyncio.sleep(0)  # a slice at a time: other requests run between slices
                except BadEncoding as error:
                    return self._bad_encoding(error)
            if inflater is not None:
                try:
                    inflater.close()
                except BadEncoding as error:
                    return self._bad_encoding(error)
        finally:
            self.buffered -= len(body)
        # aiohttp's own cache of the body: the handler's `await request.read()` returns it without reading again.
        request._read_bytes = bytes(body)
        return None

    def _take(self, body: bytearray, data: bytes) -> web.Response | None:
        """Append `data` to `body` within the body cap and the shared buffer budget, or the answer refusing it."""
        if len(body) + len(data) > self.limits.max_body_bytes:
            return self._too_large()
        if self.buffered + len(data) > self.limits.body_buffer_bytes:
            self.refuse("body_buffer_full")
            self.log.warn("body_buffer_full", "request refused: client bodies being read fill the buffer")
            return _error(429, "router is reading too many request bodies; retry later", "overloaded")
        body += data
        self.buffered += len(data)
        return None

    def _bad_encoding(self, error: BadEncoding) -> web.Response:
        self.refuse("malformed_request")
        return _error(400, f"the request body cannot be read: {error}", "invalid_body")

    def _too_large(self) -> web.Response:
        self.refuse("body_too_large")
        limit = self.limits.max_body_bytes
        return _error(413, f"request body is larger than {limit} bytes", "request_too_large")

    def _too_slow(self, received: int) -> web.Response:
        self.refuse("body_timeout")
        self.log.warn(
            "body_timeout",
            "request refused: its body arrived slower than %d bytes/s after %.0fs (%d bytes received)",
            self.limits.body_min_bytes_per_s,
            self.limits.body_timeout_s,
            received,
        )
        return _error(408, "request body arrived too slowly", "request_timeout")


REASONS = (
    "connections",
    "malformed_request",
    "header_timeout",
    "body_timeout",
    "body_too_large",
    "body_buffer_full",
    "prompt_too_large",
    "tokenizer_busy",
    "bad_token_ids",
)


class MalformedRequestLog(logging.Filter):
    """aiohttp logs every request it cannot parse as an error with a traceback: a hostile client turns that into a
    log flood. On aiohttp's server logger this counts them (reason malformed_request) and lets one line without a
    traceback through per `LOG_INTERVAL_S`; other errors (handler bugs) pass untouched."""

    def __init__(self, edge: ClientEdge) -> None:
        super().__init__()
        self.edge = edge

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        self.edge.refuse("malformed_request")
        first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        self.edge.log.warn("malformed_request", "malformed request answered 400: %s", first_line)
        return False


class _Connection(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection: admission against the cap and the header timer."""

    def __init__(self, edge: ClientEdge, inner: asyncio.Protocol) -> None:
        self.edge = edge
        self.inner = inner
        self.admitted = False
        self.transport: asyncio.Transport | None = None
        self.in_request = False
        self.served = 0
        """Requests begun on this connection (`EdgeLimits.keepalive_requests`)."""
        self.recycled = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.transport = transport
        if not self.edge._admit(self):
            transport.write(BUSY_ANSWER)
            transport.close()
            return
        self.admitted = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if not self.in_request and self._timer is None and data:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.edge.limits.header_timeout_s, self._headers_too_slow)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if not self.admitted:
            return
        self.admitted = False
        self.edge._gone(self)
        self.inner.connection_lost(exc)

    def request_started(self) -> None:
        self.in_request = True
        self.served += 1
        self._cancel_timer()

    def request_finished(self) -> None:
        self.in_request = False

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_too_slow(self) -> None:
        self._timer = None
        if self.in_request or self.transport is None:
            return
        self.edge._header_timeout()
        self.transport.close()


class EdgeSite(web.BaseSite):
    """`web.TCPSite` whose connections go through `ClientEdge` (cap and header timer)."""

    __slots__ = ("_bound_port", "_edge", "_host", "_port", "_reuse_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        edge: ClientEdge,
        host: str,
        port: int,
        *,
        backlog: int = 2048,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._edge = edge
        self._host = host
        self._port = port
        self._reuse_port = reuse_port
        self._bound_port = port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self._bound_port

    async def start(self) -> None:
        await super().start()
        logging.getLogger("aiohttp.server").addFilter(self._edge.malformed)
        server = self._runner.server
        assert server is not None, "the runner is set up before its sites start"
        loop = asyncio.get_running_loop()
        listening = await loop.create_server(
            self._edge.protocol_factory(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_port=self._reuse_port or None,
        )
        self._server = listening
        if listening.sockets:
            self._bound_port = int(listening.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        await super().stop()
        logging.getLogger("aiohttp.server").removeFilter(self._edge.malformed)


EDGE = web.AppKey("client_edge", ClientEdge)
