"""Request handlers and the relay: the async shell around `Router`.

A completion request is read (size-capped), parsed once (`parse_request`), turned into routing facts, and sent to
the replica the policy picks, its body as the client sent it (inflated) unless `flow.engine_priority` writes the
header's band into its `priority` (`kvrouter.server.priority_field`). Connect failures, stalls, redirects, 5xx and
429 answers are retried on another replica — only while nothing has been written to the client; which of those
count against the replica's breaker is decided in `kvrouter.server.replicas` (a 5xx that a second replica repeats
is the request's, not theirs); a split request's decode leg whose connect failed is first sent once more to its own
decode worker, which the prefill worker's KV is waiting for (`_retry_decode`). The answer
is relayed as it arrives: SSE chunk by chunk (the first chunk is awaited before anything reaches the client, so a
stream that never starts is retried too), JSON bodies whole and unchanged up to `max_upstream_body_bytes` (502 past
it). A non-streaming request of the common shape is fetched as a stream and its JSON answer assembled as the replica
would have sent it (`kvrouter.server.assembly`, `assemble_non_streaming`), so its first token is seen when the
engine produces it. What follows the decision is the router's (`kvrouter.routing.lifecycle`): `Router.commit`
returns a `Routed` handle and the proxy reports only what it sees on it — `first_token` at the first body chunk,
`served` with the cached tokens the engine's usage reports, `finish` on every path out — and the load book, the
policy (kv_tune) and the learning overlays (kv_feedback) hear it from there. A client that disconnects cancels its
handler (the server runs with handler cancellation), which closes the upstream connection at once so the engine
stops generating.

A request naming a LoRA adapter is tried only on replicas that serve it (`kvrouter.routing.adapters`); with none
routable it is a 503 that names the adapter, counted in `kvrouter_lora_unavailable_total`.

A request's session key (`x-session-id` or `user`, `session_key_from`) travels in its routing facts: the session's
last replica is a hint for the policy (`kvrouter.routing.sessions`); a malformed `x-session-id` is a 400.

Hostile input stops at the edge: a request target that is not origin-form (`OPTIONS *`, `GET http://host/x`)
gets a 400 before any replica is involved, and nothing that fails while building an upstream request is charged
to a replica. Redirects from replicas are never followed (a 3xx is a bad answer, retried elsewhere).

Other endpoints: GET /v1/models merged from routable replicas; /health; /metrics; POST /debug/route (a dry run
of the routing decision, guarded by `admin_token`); the paths in `passthrough_paths` (vLLM's tokenize,
embeddings, pooling, ...) are passed through to one routable replica and count against `max_concurrency`;
anything else is a 404. Knobs come from `Settings`: max_body_bytes, max_retries, max_concurrency,
first_byte_timeout_s, max_upstream_body_bytes, passthrough_paths, api_keys, admin_token, forward_authorization.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict

from kvrouter.config import Settings
from kvrouter.flow.classes import FlowClass
from kvrouter.metrics import RouterMetrics
from kvrouter.openai_request import Endpoint, ParsedRequest, RequestError, parse_request
from kvrouter.routing.adapters import serves
from kvrouter.routing.adapters import unavailable as adapter_unavailable
from kvrouter.routing.disagg import PdPlan
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.load import LoadBook, Ticket
from kvrouter.routing.router import Router, RoutingFacts
from kvrouter.server.assembly import (
    AnswerFetch,
    AnswerLayouts,
    Plan,
    StreamedAnswer,
    StreamError,
    assemblable,
    assemble,
)
from kvrouter.server.chunk_reads import ChunkReader
from kvrouter.server.disagg_legs import PdLegs, decode_request, stream_error
from kvrouter.server.flow_gate import Admission, FlowGate
from kvrouter.server.priority_field import with_priority
from kvrouter.server.replicas import ReplicaSet, ReplicaState
from kvrouter.server.request_ids import RequestIds
from kvrouter.server.session_keys import SESSION_HEADER, session_key
from kvrouter.server.status import StatusEndpoints
from kvrouter.server.streaming import (
    REDIRECTS,
    REQUEST_ID_HEADER,
    BodyTooLarge,
    UsageScanner,
    downstream_headers,
    read_capped,
    upstream_headers,
    usage_in_body,
)
from kvrouter.server.worker_metrics import EXPOSITION
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

EVENT_STREAM = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
"""The last event of an OpenAI-style stream."""
_ROUTES: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_ERROR_BODY_BYTES = 1 << 20
"""A replica's error answer is read (to hand it on if no replica does better) up to this many bytes."""
# A sub-path allowed by a `/prefix/*` entry: plain segments only, none starting with a dot (no `..`), no escapes.
_SUB_PATH = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9_.~:-]*(/[A-Za-z0-9_~-][A-Za-z0-9_.~:-]*)*")
T = TypeVar("T")


@dataclass(slots=True)
class Refused:
    """An attempt that may be retried elsewhere: nothing reached the client. `status` 0 means no answer."""

    reason: str
    status: int = 0
    body: bytes = b""
    headers: CIMultiDict[str] | None = None
    server_error: bool = False
    """A 5xx answer, not yet charged to the replica: whose fault it is depends on what other replicas answer."""
    unsent: bool = False
    """The connection failed (refused, or timed out connecting): the request provably never reached the replica."""


class RelayedStream(web.StreamResponse):
    """A relayed SSE answer whose head goes out in one send with its first chunk, which the proxy already holds
    when it prepares the response: the same bytes as sending the head alone first, one socket write fewer per
    stream (aiohttp's `web.Response` buffers its head the same way)."""

    _send_headers_immediately = False


class Stalled(Exception):
    """No first byte within a whole first-byte window while the replica showed no progress on any request."""


class _ProgressWatch:
    """One first-byte wait's window: re-armed while the replica shows progress, else it ends the wait (`deadline`).

    A slotted object rather than a closure that re-arms itself: such a closure refers to itself through its cell,
    a reference cycle (with its cells, the handle and the Timeout) per wait that only the garbage collector frees;
    two waits per request made them most of the router's cyclic garbage."""

    __slots__ = ("_deadline", "_handle", "_loop", "_replica", "_since", "_window")

    def __init__(self, replica: ReplicaState, window: float, deadline: asyncio.Timeout) -> None:
        self._loop = asyncio.get_running_loop()
        self._replica = replica
        self._window = window
        self._deadline = deadline
        self._since = replica.progress_at
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(window, self._check)

    def _check(self) -> None:
        progress = self._replica.progress_at
        if progress > self._since:
            self._since = progress
            self._handle = self._loop.call_later(self._window, self._check)
        else:
            self._handle = None
            self._deadline.reschedule(self._loop.time())

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None  # a cancelled uvloop handle keeps its callback, this object's bound method


class PathAllowList:
    """`passthrough_paths`: exact paths, and `/prefix/*` entries that allow plain sub-paths of the prefix."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.exact = frozenset(e for e in entries if not e.endswith("/*"))
        self.prefixes = tuple(e[:-1] for e in entries if e.endswith("/*"))

    def allows(self, raw_path: str) -> bool:
        # The raw (still percent-encoded) path is matched and forwarded, so what is checked is what is sent.
        if raw_path in self.exact:
            return True
        return any(
            raw_path.startswith(prefix) and _SUB_PATH.fullmatch(raw_path, len(prefix)) is not None
            for prefix in self.prefixes
        )


def error_response(error: RequestError, request_id: str | None = None) -> web.Response:
    headers = dict(error.headers) if error.headers else {}
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return web.json_response(error.body(), status=error.status, headers=headers or None)


def refuse_request_target(metrics: RouterMetrics) -> web.Response:
    """`OPTIONS *` (asterisk-form) or `GET http://host/x` (absolute-form): both are for proxies and servers
    themselves, never for an API; forwarded, they made invalid upstream URLs charged to every replica. Counted."""
    metrics.client_rejections.labels("request_target").inc()
    refused = RequestError(
        "the request target must be a path (origin-form), not '*' or an absolute URL",
        status=400,
        code="invalid_request_target",
    )
    return error_response(refused)


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
        request_ids: Callable[[], str] | None = None,
        gate: FlowGate | None = None,
        legs: PdLegs | None = None,
    ) -> None:
        self.settings = settings
        self.gate = gate
        """The router queue (kvrouter.server.flow_gate); None: every request is sent at once."""
        self.legs = legs
        """Disaggregated prefill/decode (kvrouter.server.disagg_legs); None: every request is served whole."""
        self.request_ids = request_ids or RequestIds()
        self.router = router
        self.replicas = replicas
        self.load = load
        self.metrics = metrics
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None
        self.active = 0
        self.passthrough_paths = PathAllowList(settings.passthrough_paths)
        self.layouts = AnswerLayouts(clock)
        """Per replica, the learned shape of its non-streaming answers (kvrouter.server.assembly)."""

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        status = StatusEndpoints(self)
        app.router.add_get("/v1/models", status.models)
        app.router.add_get("/health", status.health)
        app.router.add_get("/metrics", status.prometheus)
        app[EXPOSITION] = status.own_exposition
        app.router.add_post("/debug/route", status.debug_route)
        app.router.add_post("/debug/route/{endpoint}", status.debug_route)
        app.router.add_get("/debug/queue", status.debug_queue)
        # Unmatched paths go to a replica through a middleware rather than a catch-all route, so routes that
        # other modules register later (admin, readiness) are never shadowed.
        app.middlewares.append(self.passthrough_unmatched)
        # Outermost: a request target that is not a path never reaches a handler (nor any replica).
        app.middlewares.insert(0, self.origin_form_only)

    @web.middleware
    async def origin_form_only(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.raw_path.startswith("/"):
            return await handler(request)
        return refuse_request_target(self.metrics)

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

    def flow_of(self, request: web.Request, parsed: ParsedRequest) -> FlowClass | None:
        """The request's band and tenant (`kvrouter.flow.classes`); None with flow control off, when nothing reads
        them (not even a malformed header is refused then)."""
        gate = self.gate
        if gate is None or not gate.enabled:
            return None
        return gate.classify(request.headers, _bearer(request), parsed)

    def session_of(self, request: web.Request, parsed: ParsedRequest) -> str | None:
        """The request's session key (`kvrouter.server.session_keys`); None when session hints are off."""
        if self.router.sessions is None:
            return None
        return session_key(request.headers.get(SESSION_HEADER), parsed, self.settings.session_key_from)

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
        return await self.completion(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.completion(request, "completion")

    async def completion(
        self, request: web.Request, endpoint: Endpoint, parsed: ParsedRequest | None = None
    ) -> web.StreamResponse:
        """`parsed`: the body as already parsed where it was read (the model dispatch, kvrouter.server.fleets)."""
        start = self.clock()
        request_id = request.headers.get(REQUEST_ID_HEADER) or self.request_ids()
        if self.active >= self.settings.max_concurrency:
            busy = RequestError("router is at its concurrency limit; retry later", status=429, code="overloaded")
            return error_response(busy, request_id)
        self.active += 1
        try:
            self.check_client(request)
            raw = await self.read_body(request)
            parsed = parse_request(endpoint, raw) if parsed is None else parsed
            flow = self.flow_of(request, parsed)
            if flow is not None and flow.engine_priority is not None:
                parsed, raw = with_priority(parsed, flow.engine_priority)  # flow.engine_priority: the header's band
            session = self.session_of(request, parsed)
            facts = await self.router.facts(parsed)
            facts.session = session
            admission = None
            if self.gate is not None and flow is not None:
                admission = await self.gate.admit(flow, facts, request_id)
            return await self._dispatch(request, raw, parsed, facts, request_id, start, admission)
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
        admission: Admission | None = None,
    ) -> web.StreamResponse:
        route = _ROUTES[parsed.endpoint]
        tried: list[ReplicaName] = []
        refused: Refused | None = None
        answered_5xx: list[tuple[ReplicaState, str]] = []
        legs = self.legs if self.legs is not None and self.legs.active else None
        for attempt in range(self.settings.max_retries + 1):
            leg_parsed, leg_raw = parsed, raw
            split: PdPlan | None = None
            if attempt == 0 and admission is not None and admission.dispatched is not None:
                # Queued, then dispatched by the gate: it chose the replica and committed when capacity freed.
                replica, routed = admission.dispatched.replica, admission.dispatched.routed
            elif attempt == 0 and legs is not None:
                first = await self._disaggregated(request, legs, raw, parsed, facts, request_id, start)
                if isinstance(first, web.StreamResponse):
                    return first
                if first is None:
                    break
                replica, routed, leg_parsed, leg_raw, split = first
            else:
                candidates = [r for r in self.replicas.routable(exclude=tried) if serves(r.route, facts.lora)]
                if legs is not None:
                    candidates = legs.decode_capable(candidates)
                if not candidates:
                    break
                if attempt == 0:
                    await self._stagger()
                began = self.clock()
                decision = self.router.decide(facts, [replica.route for replica in candidates])
                replica = self.replicas.by_name[decision.chosen]
                routed = self.router.commit(decision, facts, replica.route, arrival=start)
                self.metrics.decision_seconds.observe(self.clock() - began)
            if attempt == 0 and admission is not None and self.gate is not None:
                self.gate.charge_routed(admission.flow, routed)
            predicted = routed.predicted_cached
            if log.isEnabledFor(logging.DEBUG):
                # Prompt text reaches the logs only when the operator asked for it (`log_prompts`).
                body = f" body {raw[:1000]!r}" if self.settings.log_prompts else ""
                log.debug("request %s -> %s, predicted cached %d%s", request_id, replica.name, predicted, body)
            tried.append(replica.name)
            outcome = await self._attempt(request, leg_parsed, leg_raw, replica, routed, request_id, start)
            if legs is not None and split is not None and isinstance(outcome, Refused) and outcome.unsent:
                outcome, retried = await self._retry_decode(
                    legs, split, facts, request, leg_parsed, leg_raw, replica, request_id, start, outcome
                )
                routed = retried or routed
            if not isinstance(outcome, Refused):
                self._settle_5xx(answered_5xx, answered_elsewhere=True)
                return outcome
            refused = outcome
            if legs is not None and routed.leg == "decode" and outcome.status:
                # The decode worker answered that the transfer failed (the prefill worker died after answering, or
                # lost the blocks): the retry runs the request whole, and that worker may take it (a failed
                # connection, by contrast, keeps it excluded once its own retry failed). Not charged as a 5xx.
                legs.metrics.fallbacks.labels("decode_refused").inc()
                tried.remove(replica.name)
            elif outcome.server_error:
                answered_5xx.append((replica, outcome.reason))
            self.metrics.retries.labels(replica.name, "status" if outcome.status else "connect").inc()
            log.info("request %s: %s refused (%s)", request_id, replica.name, outcome.reason)
        self._settle_5xx(answered_5xx, answered_elsewhere=False)
        if refused is not None and refused.status:
            # Every attempt was refused with an answer: the client gets the last one, as the replica sent it.
            headers = refused.headers or CIMultiDict()
            self.metrics.count_request(tried[-1], route, str(refused.status))
            return web.Response(status=refused.status, body=refused.body, headers=headers)
        message = "no healthy replica is available" if refused is None else f"no replica answered: {refused.reason}"
        self.metrics.count_request("none", route, "503")
        unavailable = RequestError(message, status=503, code="no_replica_available", type_="server_error")
        if refused is None and facts.lora is not None:
            unavailable = self.lora_unavailable(facts.lora, request_id)
        return error_response(unavailable, request_id)

    async def _disaggregated(
        self,
        request: web.Request,
        legs: PdLegs,
        raw: bytes,
        parsed: ParsedRequest,
        facts: RoutingFacts,
        request_id: str,
        start: float,
    ) -> web.StreamResponse | tuple[ReplicaState, Routed, ParsedRequest, bytes, PdPlan | None] | None:
        """The first attempt in a disaggregated fleet: the plan, the prefill leg of a split request, and the
        answer's leg committed (the decode leg with the transfer parameters and its plan, or the request whole and
        None). A response: the prefill worker's 4xx for the request; None: no replica is routable."""
        routable = [state for state in self.replicas.routable() if serves(state.route, facts.lora)]
        if not routable:
            return None
        began = self.clock()
        plan = legs.plan(facts, parsed, routable)
        self.metrics.decision_seconds.observe(self.clock() - began)
        if plan.split:
            headers = upstream_headers(
                request.headers,
                request.headers.items(),
                request_id,
                forward_authorization=self.settings.forward_authorization,
            )
            route = _ROUTES[parsed.endpoint]
            outcome = await legs.prefill(self.client_session(), headers, plan, facts, parsed, route, request_id, start)
            if outcome.answer is not None:
                self.metrics.count_request(outcome.replica or "none", route, str(outcome.answer.status))
                return outcome.answer
            decode = self.replicas.by_name.get(plan.decode.chosen)
            if outcome.params is not None and decode is not None and decode.routable:
                leg_parsed, leg_raw = decode_request(parsed, outcome.params)
                routed = legs.planner.commit_decode(plan, facts, decode.route, arrival=start)
                return decode, routed, leg_parsed, leg_raw, plan
        # Served whole: the plan's replica, or (the prefill leg failed) the best decode-capable one now.
        if plan.split:
            candidates = legs.decode_capable(
                [state for state in self.replicas.routable() if serves(state.route, facts.lora)]
            )
            if not candidates:
                return None
            decision = self.router.decide(facts, [state.route for state in candidates])
        else:
            decision = plan.decode
        replica = self.replicas.by_name[decision.chosen]
        return replica, self.router.commit(decision, facts, replica.route, arrival=start), parsed, raw, None

    async def _attempt(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        raw: bytes,
        replica: ReplicaState,
        routed: Routed,
        request_id: str,
        start: float,
    ) -> web.StreamResponse | Refused:
        """One send of the request (`parsed`, encoded as `raw`) to `replica`; `routed` is finished on every way out."""
        answer = self._answer_plan(parsed, replica)
        replica.begin_attempt()
        try:
            return await self._forward(
                request,
                raw,
                _ROUTES[parsed.endpoint],
                replica,
                routed,
                request_id,
                start,
                stream=parsed.stream,
                answer=answer,
                decode_leg=routed.leg == "decode",
            )
        finally:
            replica.end_attempt()
            routed.finish(self.clock())

    async def _retry_decode(
        self,
        legs: PdLegs,
        plan: PdPlan,
        facts: RoutingFacts,
        request: web.Request,
        parsed: ParsedRequest,
        raw: bytes,
        replica: ReplicaState,
        request_id: str,
        start: float,
        failed: Refused,
    ) -> tuple[web.StreamResponse | Refused, Routed | None]:
        """A decode leg whose connection failed never reached its worker, while the prefill worker holds the prompt's
        KV for it: it is sent once more to the same worker before the request falls back to running whole, so a
        connect that a starved router or a busy worker let time out does not cost the split and the prefill done.
        The failed attempt's commitment was released with it, so the retry is committed anew, as the first was
        (`routed`, the second value; None when nothing was sent: the worker is no longer routable, its breaker
        opened by this failure, or it is draining)."""
        if replica not in self.replicas.routable():
            legs.metrics.decode_retries.labels("not_routable").inc()
            log.info("request %s: decode leg on %s not sent again after %s", request_id, replica.name, failed.reason)
            return failed, None
        self.metrics.retries.labels(replica.name, "connect").inc()
        routed = legs.planner.commit_decode(plan, facts, replica.route, arrival=start)
        outcome = await self._attempt(request, parsed, raw, replica, routed, request_id, start)
        label = "ok" if not isinstance(outcome, Refused) else "refused" if outcome.status else "failed"
        legs.metrics.decode_retries.labels(label).inc()
        log.info("request %s: decode leg on %s sent again after %s: %s", request_id, replica.name, failed.reason, label)
        return outcome, routed

    async def _stagger(self) -> None:
        """With shared load, wait this instance's stagger before a first decision: the instances ranked before it
        decided the same burst's requests first and their reports are here by then (kvrouter/routing/herding.py)."""
        group = self.router.blind_group
        wait = 0.0 if group is None else group.stagger_s()
        if group is not None and wait > 0:
            group.waited(wait)
            await asyncio.sleep(wait)

    def lora_unavailable(self, lora: str, request_id: str) -> RequestError:
        """No routable replica serves the request's adapter (placement, kvrouter.routing.adapters): counted."""
        self.metrics.lora_unavailable.labels(lora).inc()
        log.warning("request %s: no routable replica serves the LoRA adapter %r", request_id, lora)
        return adapter_unavailable(lora)

    def _answer_plan(self, parsed: ParsedRequest, replica: ReplicaState) -> AnswerFetch | None:
        """How a non-streaming request's answer is fetched from `replica` (None: a streaming request)."""
        if parsed.stream:
            return None
        if not self.settings.assemble_non_streaming:
            return AnswerFetch(parsed, Plan.WHOLE, None, "disabled")
        if not assemblable(parsed):
            return AnswerFetch(parsed, Plan.WHOLE, None, "request_shape")
        plan, layout = self.layouts.plan(replica.name, parsed.endpoint)
        reason = {Plan.LEARN: "learning", Plan.WHOLE: "replica_layout", Plan.ASSEMBLE: "assembled"}[plan]
        return AnswerFetch(parsed, plan, layout, reason)

    def _settle_5xx(self, answered_5xx: list[tuple[ReplicaState, str]], *, answered_elsewhere: bool) -> None:
        """Charge a request's 5xx answers to their replicas only when they were the replicas' fault.

        One 5xx followed by a good answer from another replica: that replica is ill, count it. Two replicas
        answering 5xx to the same request: the request is the cause (poison input); a request that got no good
        answer anywhere fails alone. Neither case touches a breaker; both are counted as `request_5xx`.
        """
        if answered_elsewhere and len(answered_5xx) == 1:
            replica, reason = answered_5xx[0]
            self.replicas.record_failure(replica, reason, probe_blind=True)
            return
        for replica, _reason in answered_5xx:
            self.replicas.reject(replica, "request_5xx")

    async def _until_first_byte(self, replica: ReplicaState, pending: Awaitable[T]) -> T:
        """Await `pending` (an answer's headers, a stream's first chunk); `Stalled` when the replica shows no
        progress on any request for a whole `first_byte_timeout_s` window. A replica that is slow but moving
        (decoding other requests, engine token counters rising) is waited for, window after window."""
        window = self.settings.first_byte_timeout_s
        watch: _ProgressWatch | None = None
        try:
            async with asyncio.timeout(None) as deadline:
                watch = _ProgressWatch(replica, window, deadline)
                return await pending
        except TimeoutError:
            if deadline.expired():
                raise Stalled(f"no first byte within {window:g}s and no progress on any request") from None
            raise
        finally:
            if watch is not None:
                watch.cancel()

    def _bad_answer(self, replica: ReplicaState, request_id: str, label: str, reason: str) -> Refused:
        """An answer that is the replica's fault (a redirect, a stream without SSE): counted, retried elsewhere."""
        self.replicas.reject(replica, label)
        self.replicas.record_failure(replica, reason)
        bad = RequestError(
            f"replica {replica.name} {reason}", status=502, code="bad_upstream_response", type_="server_error"
        )
        headers = CIMultiDict({"Content-Type": "application/json", REQUEST_ID_HEADER: request_id})
        return Refused(reason, 502, json.dumps(bad.body()).encode(), headers)

    async def _error_body(self, replica: ReplicaState, upstream: aiohttp.ClientResponse) -> tuple[bytes, bool]:
        """A 5xx/429 body, bounded; (body, replaced) where an oversized body is replaced by our own JSON."""
        try:
            return await read_capped(upstream, _ERROR_BODY_BYTES), False
        except BodyTooLarge as error:
            self.replicas.reject(replica, "error_body_too_large")
            oversized = RequestError(
                f"replica {replica.name} answered {upstream.status} with a {error}",
                status=upstream.status,
                code="upstream_error",
                type_="server_error",
            )
            return json.dumps(oversized.body()).encode(), True
        except (aiohttp.ClientError, TimeoutError):
            return b"", False

    def _chunks(self, upstream: aiohttp.ClientResponse) -> ChunkReader:
        # Our own per-chunk deadline on top of the session's sock_read: aiohttp drops its read timer when the
        # replica's chunked framing is malformed mid-body, and the read would never end.
        return ChunkReader(upstream.content, self.settings.read_timeout_s)

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        route: str,
        replica: ReplicaState,
        routed: Routed,
        request_id: str,
        start: float,
        *,
        stream: bool = False,
        answer: AnswerFetch | None = None,
        decode_leg: bool = False,
    ) -> web.StreamResponse | Refused:
        headers = upstream_headers(
            request.headers,
            request.headers.items(),
            request_id,
            forward_authorization=self.settings.forward_authorization,
        )
        data = raw
        if answer is not None:
            self.metrics.count_non_streaming(replica.name, answer.reason)
            if answer.plan is Plan.ASSEMBLE:
                data = answer.streamed_body()
                # The stream is parsed here: it must come as the replica writes it, not compressed for the client.
                headers.popall("Accept-Encoding", None)
        session = self.client_session()
        try:
            sent = session.post(replica.base_url + route, data=data, headers=headers, allow_redirects=False)
            upstream = await self._until_first_byte(replica, sent)
        except Stalled as stall:
            self.replicas.record_stall(replica, str(stall))
            return Refused(str(stall))
        except (aiohttp.ClientError, TimeoutError) as error:
            reason = f"{type(error).__name__}: {error}"
            self.replicas.record_failure(replica, reason, error)
            self.layouts.forget(replica.name)
            # Raised only while connecting, before a byte of the request is written (aiohttp never retries them
            # either); a reset, a disconnect or a read timeout may come after the replica took the request.
            unsent = isinstance(error, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
            return Refused(reason, unsent=unsent)
        chunks: ChunkReader | None = None
        try:
            replica.record_progress()
            status = upstream.status
            if status in REDIRECTS:
                return self._bad_answer(
                    replica, request_id, "redirect", f"answered {status} (a redirect: not followed)"
                )
            if status >= 500 or status == 429:
                body, replaced = await self._error_body(replica, upstream)
                out_headers = downstream_headers(upstream.headers, upstream.headers.items(), replica.name, request_id)
                if replaced:
                    out_headers["Content-Type"] = "application/json"
                    out_headers.popall("Content-Encoding", None)
                return Refused(f"answered {status}", status, body, out_headers, server_error=status >= 500)
            if stream and status == 200 and upstream.content_type != EVENT_STREAM:
                # A broken replica or something else listening at its address; another replica may do better.
                reason = f"answered a streaming request with {upstream.content_type or 'no content type'}"
                return self._bad_answer(replica, request_id, "not_event_stream", reason)
            out_headers = downstream_headers(upstream.headers, upstream.headers.items(), replica.name, request_id)
            if upstream.content_type == EVENT_STREAM:
                chunks = self._chunks(upstream)
                # The first chunk often comes with the head: then it is taken as it is, without the first-byte
                # watch's two timers (nothing can stall a read that does not wait).
                first = chunks.buffered()
                if not first:
                    try:
                        first = await self._until_first_byte(replica, chunks.read())
                    except Stalled as stall:
                        self.replicas.record_stall(replica, str(stall))
                        return Refused(str(stall))
                failed = stream_error(first) if decode_leg else None
                if failed is not None:
                    # vLLM answers a decode leg whose KV pull failed with 200 and one error event: nothing has
                    # reached the client, so the request can still run whole elsewhere.
                    self.replicas.reject(replica, "decode_leg_failed")
                    error_headers = CIMultiDict({"Content-Type": "application/json", REQUEST_ID_HEADER: request_id})
                    return Refused(f"decode leg failed: {failed[:200]!r}", 502, failed, error_headers)
                replica.record_success()
                replica.record_progress()
                if answer is not None and answer.layout is not None:
                    return await self._assemble(
                        upstream, chunks, first, out_headers, route, replica, routed, request_id, start, answer
                    )
                return await self._relay_stream(
                    request, upstream, chunks, first, out_headers, route, replica, routed, start
                )
            replica.record_success()
            try:
                body = await read_capped(upstream, self.settings.max_upstream_body_bytes)
            except BodyTooLarge as error:
                # The answer is whole but too large to hold: the request asked for it (n, logprobs), so the
                # replica is not charged and another one would only answer the same.
                self.replicas.reject(replica, "body_too_large")
                self.metrics.count_request(replica.name, route, "502")
                too_large = RequestError(
                    f"replica {replica.name} answered a {error} (max_upstream_body_bytes)",
                    status=502,
                    code="upstream_body_too_large",
                    type_="server_error",
                )
                return error_response(too_large, request_id)
            replica.record_progress()
            routed.first_token(self.clock())
            if "content-encoding" not in upstream.headers:
                cached, routed.generated_tokens = usage_in_body(body)
                self._observe_cached(replica, routed, cached)
                if answer is not None and answer.plan is Plan.LEARN and status == 200:
                    self._learn(replica, answer.parsed.endpoint, body)
            self.metrics.count_request(replica.name, route, str(status))
            self.metrics.timers(replica.name, route).duration.observe(self.clock() - start)
            return web.Response(status=status, body=body, headers=out_headers)
        except (aiohttp.ClientError, TimeoutError) as error:
            # The replica answered but the body broke before anything was sent on: still safe to retry.
            reason = f"{type(error).__name__}: {error}"
            self.replicas.record_failure(replica, reason)
            self.layouts.forget(replica.name)
            return Refused(reason)
        finally:
            if chunks is not None:
                chunks.close()
            upstream.close()

    def _learn(self, replica: ReplicaState, endpoint: Endpoint, body: bytes) -> None:
        if self.layouts.learn(replica.name, endpoint, body) is None:
            log.info(
                "replica %s: its non-streaming %s answers cannot be assembled from a stream (fields beyond what a "
                "stream carries, or JSON this router cannot reproduce); they stay whole",
                replica.name,
                endpoint,
            )

    async def _assemble(
        self,
        upstream: aiohttp.ClientResponse,
        chunks: ChunkReader,
        first: bytes,
        headers: CIMultiDict[str],
        route: str,
        replica: ReplicaState,
        routed: Routed,
        request_id: str,
        start: float,
        fetch: AnswerFetch,
    ) -> web.StreamResponse | Refused:
        """A non-streaming request's answer, assembled from the stream the replica sends (kvrouter.server.assembly).

        Nothing reaches the client before the stream ends, so a stream that breaks is retried elsewhere like a
        whole answer that breaks."""
        assert fetch.layout is not None
        endpoint = fetch.parsed.endpoint
        if "content-encoding" in upstream.headers:
            self.layouts.refuse(replica.name, endpoint)
            return self._bad_answer(replica, request_id, "encoded_stream", "compressed a stream it was not asked to")
        now = self.clock()
        routed.first_token(now)
        timers = self.metrics.timers(replica.name, route)
        timers.ttft.observe(now - start)
        collected = StreamedAnswer(endpoint, self.settings.max_upstream_body_bytes)
        chunk = first
        try:
            while chunk:
                collected.feed(chunk)
                chunk = await chunks.read()
                replica.record_progress()
            collected.close()
            if not collected.done and collected.error is None:
                raise StreamError("the stream ended before its [DONE] event")
        except StreamError as error:
            self.layouts.refuse(replica.name, endpoint)
            return self._bad_answer(replica, request_id, "bad_stream", f"sent a broken stream: {error}")
        if collected.error is not None:
            status = collected.error_status
            error_headers = CIMultiDict(headers)
            error_headers["Content-Type"] = "application/json"
            if status >= 500 or status == 429:
                reason = f"answered {status} in its stream"
                return Refused(reason, status, collected.error, error_headers, server_error=status >= 500)
            self.metrics.count_request(replica.name, route, str(status))
            return web.Response(status=status, body=collected.error, headers=error_headers)
        if collected.too_large:
            self.replicas.reject(replica, "body_too_large")
            self.metrics.count_request(replica.name, route, "502")
            too_large = RequestError(
                f"replica {replica.name} answered more than {self.settings.max_upstream_body_bytes} bytes "
                "(max_upstream_body_bytes)",
                status=502,
                code="upstream_body_too_large",
                type_="server_error",
            )
            return error_response(too_large, request_id)
        body, unexpected = assemble(fetch.layout, collected)
        if unexpected:
            self.layouts.forget(replica.name)
            self.metrics.assembly_mismatches.labels(replica.name).inc()
            log.warning(
                "replica %s: request %s's stream carried %s, which its learned answer layout cannot hold; the "
                "layout is relearned",
                replica.name,
                request_id,
                ", ".join(sorted(set(unexpected))),
            )
        self._observe_cached(replica, routed, collected.cached_tokens)
        self.metrics.count_request(replica.name, route, "200")
        timers.duration.observe(self.clock() - start)
        headers["Content-Type"] = "application/json"
        return web.Response(status=200, body=body, headers=headers)

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        chunks: ChunkReader,
        first: bytes,
        headers: CIMultiDict[str],
        route: str,
        replica: ReplicaState,
        routed: Routed,
        start: float,
    ) -> web.StreamResponse:
        response = RelayedStream(status=upstream.status, headers=headers)
        timers = self.metrics.timers(replica.name, route)
        scanner = UsageScanner()
        status = str(upstream.status)
        first_at: float | None = None
        try:
            await response.prepare(request)
            chunk = first
            if chunk:
                first_at = self.clock()
                timers.ttft.observe(first_at - start)
            while chunk:
                scanner.feed(chunk)
                if chunks.at_end():
                    # The replica's end came with this chunk: chunk and terminator go out in one send.
                    break
                # A stream's `data: [DONE]` is its last event and the replica's end follows at once: it is held for
                # that read and goes out with the terminator, one send fewer per stream (what follows it, if
                # anything, or a broken read, finds it written first: the client gets the same bytes).
                held = chunk.endswith(SSE_DONE)
                if not held:
                    await response.write(chunk)
                    if first_at is not None:
                        # The first token's bookkeeping (load book, cost refit, listeners) after the client has it,
                        # timed when it arrived: a refit must not delay the first byte.
                        routed.first_token(first_at)
                        first_at = None
                try:
                    following = await chunks.read()
                except (aiohttp.ClientError, TimeoutError) as error:
                    status = "upstream_error"
                    await self._stream_broke(request, response, replica, error, chunk if held else b"")
                    return response
                replica.record_progress()
                if held:
                    if not following:
                        break
                    await response.write(chunk)
                chunk = following
            await response.write_eof(chunk)
        except ConnectionError:
            status = "client_disconnect"
        except asyncio.CancelledError:
            status = "client_disconnect"
            raise
        finally:
            if first_at is not None:
                routed.first_token(first_at)
            self.metrics.count_request(replica.name, route, status)
            timers.duration.observe(self.clock() - start)
            scanner.close()
            routed.generated_tokens = scanner.completion_tokens
            self._observe_cached(replica, routed, scanner.cached_tokens)
        return response

    async def _stream_broke(
        self, request: web.Request, response: web.StreamResponse, replica: ReplicaState, error: Exception, held: bytes
    ) -> None:
        """Too late to retry: what was held back goes out, then an SSE error event says why (OpenAI clients raise it
        as an APIError), then the connection is cut without the chunked terminator so the truncation shows, not a
        clean end."""
        reason = f"stream broke: {type(error).__name__}: {error}"
        self.replicas.record_failure(replica, reason)
        broke = RequestError(
            f"replica {replica.name} {reason}", status=502, code="upstream_error", type_="server_error"
        )
        with contextlib.suppress(ConnectionError):
            await response.write(held + b"data: " + json.dumps(broke.body()).encode() + b"\n\n")
        if request.transport is not None:
            request.transport.close()

    def _observe_cached(self, replica: ReplicaState, routed: Routed, actual: int | None) -> None:
        routed.served(actual, self.clock())
        if actual is not None:
            self.metrics.observe_cached(replica.name, routed.predicted_cached, actual)

    # -- the allow-listed pass-through paths go to a replica -------------------------------------------------

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """An allow-listed path goes, unchanged, to one routable replica (tokenize, embeddings, ...); others 404."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or self.request_ids()
        try:
            self.check_client(request)
            if not self.passthrough_paths.allows(request.raw_path.partition("?")[0]):
                self.metrics.client_rejections.labels("path_not_allowed").inc()
                raise RequestError(f"no such endpoint: {request.method} {request.path}", status=404, code="not_found")
        except RequestError as error:
            return error_response(error, request_id)
        if self.active >= self.settings.max_concurrency:
            busy = RequestError("router is at its concurrency limit; retry later", status=429, code="overloaded")
            return error_response(busy, request_id)
        self.active += 1
        try:
            return await self._passthrough(request, request_id)
        except RequestError as error:
            return error_response(error, request_id)
        finally:
            self.active -= 1

    async def _passthrough(self, request: web.Request, request_id: str) -> web.StreamResponse:
        raw = await self.read_body(request) if request.body_exists else None
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
                    url = replica.base_url + request.rel_url.raw_path_qs
                    sent = self.client_session().request(
                        request.method, url, data=raw, headers=headers, allow_redirects=False
                    )
                    upstream = await self._until_first_byte(replica, sent)
                except aiohttp.InvalidURL:
                    # Built from what the client sent: its fault, never the replica's (this opened every breaker).
                    self.metrics.client_rejections.labels("request_target").inc()
                    raise RequestError(
                        "the request target cannot be forwarded", code="invalid_request_target"
                    ) from None
                except Stalled as stall:
                    self.replicas.record_stall(replica, str(stall))
                    continue
                except (aiohttp.ClientError, TimeoutError) as error:
                    self.replicas.record_failure(replica, f"{type(error).__name__}: {error}", error)
                    continue
                try:
                    replica.record_progress()
                    if upstream.status in REDIRECTS:
                        self.replicas.reject(replica, "redirect")
                        self.replicas.record_failure(replica, f"answered {upstream.status} (a redirect: not followed)")
                        continue
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
        chunks = self._chunks(upstream)
        try:
            await response.prepare(request)
            while True:
                try:
                    chunk = await chunks.read()
                except (aiohttp.ClientError, TimeoutError):
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                replica.record_progress()
                self.load.first_token(ticket)
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            pass  # the client left; closing `upstream` (the caller does) is all that is left to do
        finally:
            chunks.close()
        return response
