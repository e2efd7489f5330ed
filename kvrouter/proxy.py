"""Request handlers and the relay: the async shell around `Router`.

A completion request is read (size-capped), parsed once (`parse_request`), turned into routing facts, and sent
to the replica the policy picks. Connect failures, 5xx and 429 answers are retried on another replica — only
while nothing has been written to the client. The answer is relayed as it arrives: SSE chunk by chunk, JSON
bodies whole and unchanged. The load book gets a ticket at dispatch, `first_token` at the first body chunk and
`finish` on every path out. A client that disconnects cancels its handler (the server runs with handler
cancellation), which closes the upstream connection at once so the engine stops generating.

Other endpoints: GET /v1/models merged from routable replicas; /health; /metrics; POST /debug/route (a dry run
of the routing decision, guarded by `admin_token`); anything else is passed through to one routable replica.
Knobs come from `Settings`: max_body_bytes, max_retries, max_concurrency, api_keys, admin_token,
forward_authorization.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict

from kvrouter.config import Settings
from kvrouter.feedback import FeedbackLookup
from kvrouter.load import LoadBook, Ticket
from kvrouter.metrics import RouterMetrics
from kvrouter.openai_request import Endpoint, ParsedRequest, RequestError, parse_request
from kvrouter.replicas import ReplicaSet, ReplicaState
from kvrouter.routing import Router, RoutingFacts
from kvrouter.status import StatusEndpoints
from kvrouter.streaming import (
    REQUEST_ID_HEADER,
    UsageScanner,
    cached_tokens_in_body,
    downstream_headers,
    upstream_headers,
)
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

EVENT_STREAM = "text/event-stream"
_ROUTES: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass(slots=True)
class Refused:
    """An attempt that may be retried elsewhere: nothing reached the client. `status` 0 means no answer."""

    reason: str
    status: int = 0
    body: bytes = b""
    headers: CIMultiDict[str] | None = None


def error_response(error: RequestError, request_id: str | None = None) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return web.json_response(error.body(), status=error.status, headers=headers)


def _bearer(request: web.Request) -> str:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value[:7].lower() == "bearer " else ""


def _token_matches(token: str, accepted: list[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in accepted)


class Proxy:
    def __init__(
        self,
        *,
        settings: Settings,
        router: Router,
        replicas: ReplicaSet,
        load: LoadBook,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.router = router
        self.replicas = replicas
        self.load = load
        self.metrics = metrics
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None
        self.active = 0

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        status = StatusEndpoints(self)
        app.router.add_get("/v1/models", status.models)
        app.router.add_get("/health", status.health)
        app.router.add_get("/metrics", status.prometheus)
        app.router.add_post("/debug/route", status.debug_route)
        app.router.add_post("/debug/route/{endpoint}", status.debug_route)
        # Unmatched paths go to a replica through a middleware rather than a catch-all route, so routes that
        # other modules register later (admin, readiness) are never shadowed.
        app.middlewares.append(self.passthrough_unmatched)

    @web.middleware
    async def passthrough_unmatched(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if isinstance(request.match_info.http_exception, web.HTTPNotFound):
            return await self.passthrough(request)
        return await handler(request)

    def client_session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the client session starts with the application"
        return self.session

    # -- guards ---------------------------------------------------------------------------------------------

    def check_client(self, request: web.Request) -> None:
        if self.settings.api_keys and not _token_matches(_bearer(request), self.settings.api_keys):
            raise RequestError(
                "invalid or missing API key", status=401, code="invalid_api_key", type_="authentication_error"
            )

    def check_admin(self, request: web.Request) -> None:
        token = self.settings.admin_token
        if token is None:
            # No admin token: /debug is as open as the API, never more (it tells which prompts are cached where).
            self.check_client(request)
        elif not _token_matches(_bearer(request), [token]):
            raise RequestError(
                "admin token required", status=401, code="invalid_admin_token", type_="authentication_error"
            )

    async def read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = RequestError(f"request body is larger than {limit} bytes", status=413, code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    # -- completions ----------------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "completion")

    async def _completion(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        start = self.clock()
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        if self.active >= self.settings.max_concurrency:
            busy = RequestError("router is at its concurrency limit; retry later", status=429, code="overloaded")
            return error_response(busy, request_id)
        self.active += 1
        try:
            self.check_client(request)
            raw = await self.read_body(request)
            parsed = parse_request(endpoint, raw)
            facts = await self.router.facts(parsed)
            return await self._dispatch(request, raw, parsed, facts, request_id, start)
        except RequestError as error:
            return error_response(error, request_id)
        finally:
            self.active -= 1

    async def _dispatch(
        self,
        request: web.Request,
        raw: bytes,
        parsed: ParsedRequest,
        facts: RoutingFacts,
        request_id: str,
        start: float,
    ) -> web.StreamResponse:
        route = _ROUTES[parsed.endpoint]
        tried: list[ReplicaName] = []
        refused: Refused | None = None
        for _attempt in range(self.settings.max_retries + 1):
            candidates = self.replicas.routable(exclude=tried)
            if not candidates:
                break
            began = self.clock()
            decision = self.router.decide(facts, [replica.route for replica in candidates])
            replica = self.replicas.by_name[decision.chosen]
            ticket = self.router.commit(decision, facts, replica.route)
            if isinstance(self.router.index, FeedbackLookup) and facts.prompts:
                keys = facts.keys(replica.route.block_size, self.router.hash_seed)
                self.router.index.expect(id(ticket), replica.name, keys, replica.route.block_size)
            self.metrics.decision_seconds.observe(self.clock() - began)
            chosen = decision.score_of(decision.chosen)
            predicted = chosen.cached_tokens if chosen is not None else 0
            if log.isEnabledFor(logging.DEBUG):
                # Prompt text reaches the logs only when the operator asked for it (`log_prompts`).
                body = f" body {raw[:1000]!r}" if self.settings.log_prompts else ""
                log.debug("request %s -> %s, predicted cached %d%s", request_id, replica.name, predicted, body)
            tried.append(replica.name)
            replica.begin_attempt()
            try:
                outcome = await self._forward(
                    request, raw, route, replica, ticket, predicted, request_id, start, stream=parsed.stream
                )
            finally:
                replica.end_attempt()
                self.load.finish(ticket)
            if not isinstance(outcome, Refused):
                return outcome
            refused = outcome
            self.metrics.retries.labels(replica.name, "status" if outcome.status else "connect").inc()
            log.info("request %s: %s refused (%s)", request_id, replica.name, outcome.reason)
        if refused is not None and refused.status:
            # Every attempt was refused with an answer: the client gets the last one, as the replica sent it.
            headers = refused.headers or CIMultiDict()
            self.metrics.requests.labels(tried[-1], route, str(refused.status)).inc()
            return web.Response(status=refused.status, body=refused.body, headers=headers)
        message = "no healthy replica is available" if refused is None else f"no replica answered: {refused.reason}"
        self.metrics.requests.labels("none", route, "503").inc()
        unavailable = RequestError(message, status=503, code="no_replica_available", type_="server_error")
        return error_response(unavailable, request_id)

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        route: str,
        replica: ReplicaState,
        ticket: Ticket,
        predicted: int,
        request_id: str,
        start: float,
        *,
        stream: bool = False,
    ) -> web.StreamResponse | Refused:
        headers = upstream_headers(
            request.headers,
            request.headers.items(),
            request_id,
            forward_authorization=self.settings.forward_authorization,
        )
        try:
            upstream = await self.client_session().post(replica.base_url + route, data=raw, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as error:
            reason = f"{type(error).__name__}: {error}"
            self.replicas.record_failure(replica, reason, error)
            return Refused(reason)
        try:
            status = upstream.status
            if status >= 500 or status == 429:
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, TimeoutError):
                    body = b""
                if status >= 500:
                    self.replicas.record_failure(replica, f"answered {status}")
                out_headers = downstream_headers(upstream.headers, upstream.headers.items(), replica.name, request_id)
                return Refused(f"answered {status}", status, body, out_headers)
            if stream and status == 200 and upstream.content_type != EVENT_STREAM:
                # A broken replica or something else listening at its address; another replica may do better.
                reason = f"answered a streaming request with {upstream.content_type or 'no content type'}"
                self.replicas.record_failure(replica, reason)
                bad = RequestError(
                    f"replica {replica.name} {reason}", status=502, code="bad_upstream_response", type_="server_error"
                )
                headers = CIMultiDict({"Content-Type": "application/json", REQUEST_ID_HEADER: request_id})
                return Refused(reason, 502, json.dumps(bad.body()).encode(), headers)
            replica.record_success()
            out_headers = downstream_headers(upstream.headers, upstream.headers.items(), replica.name, request_id)
            if upstream.content_type == EVENT_STREAM:
                return await self._relay_stream(
                    request, upstream, out_headers, route, replica, ticket, predicted, start
                )
            body = await upstream.read()
            self.load.first_token(ticket)
            if "content-encoding" not in upstream.headers:
                self._observe_cached(replica, predicted, cached_tokens_in_body(body), ticket)
            self.metrics.requests.labels(replica.name, route, str(status)).inc()
            self.metrics.timers(replica.name, route).duration.observe(self.clock() - start)
            return web.Response(status=status, body=body, headers=out_headers)
        except (aiohttp.ClientError, TimeoutError) as error:
            # The replica answered but the body broke before anything was sent on: still safe to retry.
            reason = f"{type(error).__name__}: {error}"
            self.replicas.record_failure(replica, reason)
            return Refused(reason)
        finally:
            upstream.close()

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: CIMultiDict[str],
        route: str,
        replica: ReplicaState,
        ticket: Ticket,
        predicted: int,
        start: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        timers = self.metrics.timers(replica.name, route)
        scanner = UsageScanner()
        first = True
        status = str(upstream.status)
        try:
            await response.prepare(request)
            read_timeout = self.settings.read_timeout_s
            while True:
                try:
                    # Our own per-chunk deadline on top of the session's sock_read: aiohttp drops its read timer
                    # when the replica's chunked framing is malformed mid-body, and the read would never end.
                    async with asyncio.timeout(read_timeout):
                        chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as error:
                    # Too late to retry: an SSE error event says why (OpenAI clients raise it as an APIError), then
                    # the connection is cut without the chunked terminator so the truncation shows, not a clean end.
                    status = "upstream_error"
                    reason = f"stream broke: {type(error).__name__}: {error}"
                    self.replicas.record_failure(replica, reason)
                    broke = RequestError(
                        f"replica {replica.name} {reason}", status=502, code="upstream_error", type_="server_error"
                    )
                    with contextlib.suppress(ConnectionError):
                        await response.write(b"data: " + json.dumps(broke.body()).encode() + b"\n\n")
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                if first:
                    first = False
                    self.load.first_token(ticket)
                    timers.ttft.observe(self.clock() - start)
                scanner.feed(chunk)
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            status = "client_disconnect"
        except asyncio.CancelledError:
            status = "client_disconnect"
            raise
        finally:
            self.metrics.requests.labels(replica.name, route, status).inc()
            timers.duration.observe(self.clock() - start)
            scanner.close()
            self._observe_cached(replica, predicted, scanner.cached_tokens, ticket)
        return response

    def _observe_cached(self, replica: ReplicaState, predicted: int, actual: int | None, ticket: Ticket) -> None:
        if isinstance(self.router.index, FeedbackLookup):
            self.router.index.settle(id(ticket), predicted, actual, self.clock())
        if actual is not None:
            self.metrics.observe_cached(replica.name, predicted, actual)

    # -- everything else goes to a replica -----------------------------------------------------------------

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other path goes, unchanged, to one routable replica (tokenize, detokenize, responses, ...)."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            self.check_client(request)
            raw = await self.read_body(request) if request.body_exists else None
        except RequestError as error:
            return error_response(error, request_id)
        headers = upstream_headers(
            request.headers,
            request.headers.items(),
            request_id,
            forward_authorization=self.settings.forward_authorization,
        )
        tried: list[ReplicaName] = []
        for _attempt in range(self.settings.max_retries + 1):
            replica = self.replicas.for_passthrough(exclude=tried)
            if replica is None:
                break
            tried.append(replica.name)
            ticket = self.load.begin(replica.name, 0)
            try:
                try:
                    upstream = await self.client_session().request(
                        request.method, replica.base_url + request.rel_url.raw_path_qs, data=raw, headers=headers
                    )
                except (aiohttp.ClientError, TimeoutError) as error:
                    self.replicas.record_failure(replica, f"{type(error).__name__}: {error}")
                    continue
                try:
                    return await self._relay_any(request, upstream, replica, request_id, ticket)
                finally:
                    upstream.close()
            finally:
                self.load.finish(ticket)
        unavailable = RequestError(
            "no healthy replica is available", status=503, code="no_replica_available", type_="server_error"
        )
        return error_response(unavailable, request_id)

    async def _relay_any(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        replica: ReplicaState,
        request_id: str,
        ticket: Ticket,
    ) -> web.StreamResponse:
        headers = downstream_headers(upstream.headers, upstream.headers.items(), replica.name, request_id)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        try:
            await response.prepare(request)
            while True:
                try:
                    async with asyncio.timeout(self.settings.read_timeout_s):  # see _relay_stream
                        chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError):
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                self.load.first_token(ticket)
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            pass  # the client left; closing `upstream` (the caller does) is all that is left to do
        return response
