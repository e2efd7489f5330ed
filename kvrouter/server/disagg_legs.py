"""The two legs of a disaggregated request on the wire, as vLLM's own disaggregated-serving proxy sends them.

The planner (`kvrouter.routing.disagg`) decides whether a request is split and where its legs go; this module
speaks vLLM's KV-transfer protocol for the split ones:

1. The prefill leg: the client's body with `stream` false, `max_tokens` 1 (`max_completion_tokens`, `min_tokens`
   and `stream_options` dropped, `n` 1) and `kv_transfer_params` asking for a remote decode
   (`{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
   "remote_host": null, "remote_port": null}`), sent to the chosen prefill worker. Its answer is one small JSON
   object whose top-level `kv_transfer_params` (NixlConnector: `do_remote_prefill`, `remote_engine_id`,
   `remote_block_ids`, `remote_host`, `remote_port`, `tp_size`, ...) tell a decode worker where the prompt's KV is.
   The parser keeps whatever object the engine sent, field for field, so other connectors' and versions' fields
   pass unchanged; it only requires an object.
2. The decode leg: the client's body as sent, plus the prefill worker's `kv_transfer_params`, through the proxy's
   ordinary path (streaming, assembly, retries before the first byte, cancellation) to the decode worker.

Failures never reach the client as a hang or a duplicated answer: a prefill worker that refuses a connection,
answers 5xx or 429, stalls past `prefill_timeout_s`, or answers without transfer parameters is charged like any
replica fault and the leg is tried on another prefill worker, then given up — the request then runs whole on a
decode-capable replica (counted in `kvrouter_pd_fallbacks_total`). A prefill 4xx other than 429 is the request's
own fault (a prompt too long, a bad field) and goes back to the client as the engine sent it. A decode leg whose
connection fails (refused, or timed out connecting: nothing reached the decode worker) is sent once more to the
same worker by the proxy, committed anew, since the prefill worker holds the prompt's KV for it (counted in
`kvrouter_pd_decode_retries_total`). A decode worker that rejects the transfer (or fails before its first byte, that
retry included) is retried by the proxy's loop with the whole request, on another decode-capable replica. A client
that disconnects during the prefill leg cancels it (the connection to the prefill worker closes, which makes vLLM
abort the request); during the decode leg, as for any request.

A client's own `kv_transfer_params` are refused (400) in a disaggregated fleet: they address engines' KV memory,
and only the router may set them there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvrouter.openai_request import ParsedRequest, RequestError
from kvrouter.routing.disagg import PdPlan, PdPlanner
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.router import RoutingFacts
from kvrouter.server.json_body import compact_json
from kvrouter.server.replicas import ReplicaSet, ReplicaState
from kvrouter.server.streaming import (
    REQUEST_ID_HEADER,
    BodyTooLarge,
    downstream_headers,
    read_capped,
    usage_in_body,
)
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

KV_TRANSFER_PARAMS = "kv_transfer_params"
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill leg asks of its engine: compute the prompt, keep its KV for a remote decode worker."""
PREFILL_ANSWER_BYTES = 1 << 20
"""A prefill answer is one token and a few hundred bytes of parameters; more than this is not one."""
_DROPPED = ("max_completion_tokens", "min_tokens", "stream_options")
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def prefill_body(parsed: ParsedRequest) -> bytes:
    """The prefill leg's body: the client's, made a one-token non-streaming request for a remote decode."""
    body = {key: value for key, value in parsed.body.items() if key not in _DROPPED}
    body["stream"] = False
    body["max_tokens"] = 1
    if "n" in body:
        body["n"] = 1
    body[KV_TRANSFER_PARAMS] = dict(REMOTE_DECODE)
    return compact_json(body)


def decode_request(parsed: ParsedRequest, params: Mapping[str, Any]) -> tuple[ParsedRequest, bytes]:
    """The decode leg: the client's request plus the prefill worker's transfer parameters, parsed and encoded."""
    body = {**parsed.body, KV_TRANSFER_PARAMS: dict(params)}
    return replace(parsed, body=body), compact_json(body)


def transfer_params(body: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` object of a prefill answer; None when it has none (or is not a JSON object)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    params = payload.get(KV_TRANSFER_PARAMS) if isinstance(payload, dict) else None
    return params if isinstance(params, dict) and params else None


def stream_error(first: bytes) -> bytes | None:
    """The error object when a stream's first event is one (vLLM answers a decode leg whose KV pull failed with
    200 and `data: {"error": {...}}`), as JSON bytes; None for an ordinary first event."""
    head = first.lstrip()
    if not head.startswith(b"data:"):
        return None
    line = head[5:].split(b"\n", 1)[0].strip()
    if not line.startswith(b'{"error"') and not line.startswith(b'{ "error"'):
        return None
    try:
        payload = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict) and len(payload) == 1:
        return line
    return None


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    params: dict[str, Any] | None = None
    """The transfer parameters for the decode leg; None: run the request whole."""
    answer: web.Response | None = None
    """The prefill worker's 4xx for the request itself, to give the client as it is."""
    replica: ReplicaName | None = None


class PdMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.plans = Counter(
            "kvrouter_pd_plans",
            "Requests of disaggregated fleets by plan: split, short (whole on a decode worker), prefill_busy (whole: "
            "the prefill workers are too backed up), off, no_prefill_worker, no_decode_worker.",
            ["plan"],
            registry=registry,
        )
        self.prefill_legs = Counter(
            "kvrouter_pd_prefill_legs",
            "Prefill legs by prefill worker and outcome (ok, no_params, client_error, server_error, busy, "
            "connect, timeout, bad_answer).",
            ["replica", "outcome"],
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "kvrouter_pd_prefill_seconds",
            "Time from sending a prefill leg to its answer (the prompt's prefill), by prefill worker.",
            ["replica"],
            buckets=PREFILL_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "kvrouter_pd_fallbacks",
            "Split requests that ran whole instead, by reason (prefill_failed: every prefill worker tried failed; "
            "decode_refused: the decode worker refused the transfer before its first byte).",
            ["reason"],
            registry=registry,
        )
        self.decode_retries = Counter(
            "kvrouter_pd_decode_retries",
            "Decode legs sent once more to their decode worker after a connection that failed before anything was "
            "sent (refused, or timed out connecting), by outcome (ok: it answered, the split kept; refused: it "
            "answered but refused the transfer; failed: no answer again; not_routable: not sent, the failure opened "
            "its breaker or it is draining). All but ok then run the request whole, as any refused decode leg or "
            "connect failure does.",
            ["outcome"],
            registry=registry,
        )


class PdLegs:
    """The prefill leg of split requests, and the plan of each request of a disaggregated fleet."""

    def __init__(
        self,
        planner: PdPlanner,
        replicas: ReplicaSet,
        registry: CollectorRegistry,
        *,
        prefill_timeout_s: float,
        max_retries: int,
        forward_authorization: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.planner = planner
        self.replicas = replicas
        self.metrics = PdMetrics(registry)
        self.prefill_timeout_s = prefill_timeout_s
        self.max_retries = max_retries
        self.forward_authorization = forward_authorization
        self.clock = clock

    @property
    def active(self) -> bool:
        """Whether the fleet has prefill workers (read each time: a live reload may add or remove them)."""
        disaggregated = any(state.route.role == "prefill" for state in self.replicas)
        self.planner.disaggregated = disaggregated
        return disaggregated

    def plan(self, facts: RoutingFacts, parsed: ParsedRequest, routable: Sequence[ReplicaState]) -> PdPlan:
        if KV_TRANSFER_PARAMS in parsed.body:
            raise RequestError(
                "'kv_transfer_params' is set by the router in a disaggregated fleet; remove it from the request",
                param=KV_TRANSFER_PARAMS,
                code="kv_transfer_params_not_allowed",
            )
        plan = self.planner.plan(facts, [state.route for state in routable])
        self.metrics.plans.labels(plan.reason).inc()
        return plan

    def decode_capable(self, routable: Sequence[ReplicaState]) -> list[ReplicaState]:
        """Who may serve a request whole in a disaggregated fleet: decode and both replicas (prefill workers only
        when nothing else is routable)."""
        capable = [state for state in routable if state.route.role != "prefill"]
        return capable or list(routable)

    async def prefill(
        self,
        session: aiohttp.ClientSession,
        headers: CIMultiDict[str],
        plan: PdPlan,
        facts: RoutingFacts,
        parsed: ParsedRequest,
        route: str,
        request_id: str,
        arrival: float,
    ) -> PrefillOutcome:
        """Run the prefill leg of a split `plan`, on its prefill worker and then on others; never raises for a
        replica's fault. `headers` are the upstream headers the decode leg gets too (same request id)."""
        assert plan.prefill is not None
        body = prefill_body(parsed)
        tried: list[ReplicaName] = []
        decision = plan.prefill
        for attempt in range(self.max_retries + 1):
            replica = self.replicas.by_name.get(decision.chosen)
            if replica is None:
                break
            tried.append(replica.name)
            outcome, label = await self._one_leg(session, headers, plan, decision, facts, replica, body, route, arrival)
            self.metrics.prefill_legs.labels(replica.name, label).inc()
            if outcome is not None:
                return outcome
            log.info("request %s: prefill leg on %s failed (%s)", request_id, replica.name, label)
            if attempt == self.max_retries:
                break
            others = [state.route for state in self.replicas.routable(exclude=tried) if state.route.role == "prefill"]
            if not others:
                break
            decision = self.planner.router.decide(facts, others)
        self.metrics.fallbacks.labels("prefill_failed").inc()
        return PrefillOutcome()

    async def _one_leg(
        self,
        session: aiohttp.ClientSession,
        headers: CIMultiDict[str],
        plan: PdPlan,
        decision: Any,
        facts: RoutingFacts,
        replica: ReplicaState,
        body: bytes,
        route: str,
        arrival: float,
    ) -> tuple[PrefillOutcome | None, str]:
        leg = replace(plan, prefill=decision)
        routed = self.planner.commit_prefill(leg, facts, replica.route, arrival=arrival)
        replica.begin_attempt()
        try:
            return await self._send(session, headers, replica, body, route, routed)
        finally:
            replica.end_attempt()
            routed.finish(self.clock())

    async def _send(
        self,
        session: aiohttp.ClientSession,
        headers: CIMultiDict[str],
        replica: ReplicaState,
        body: bytes,
        route: str,
        routed: Routed,
    ) -> tuple[PrefillOutcome | None, str]:
        sent_at = self.clock()
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                async with session.post(
                    replica.base_url + route, data=body, headers=headers, allow_redirects=False
                ) as upstream:
                    status = upstream.status
                    answer = await read_capped(upstream, PREFILL_ANSWER_BYTES)
                    out_headers = downstream_headers(
                        upstream.headers, upstream.headers.items(), replica.name, headers.get(REQUEST_ID_HEADER, "")
                    )
        except TimeoutError:
            self.replicas.record_stall(replica, f"prefill leg took over {self.prefill_timeout_s:g}s")
            return None, "timeout"
        except BodyTooLarge:
            self.replicas.reject(replica, "prefill_answer_too_large")
            return None, "bad_answer"
        except aiohttp.ClientError as error:
            self.replicas.record_failure(replica, f"{type(error).__name__}: {error}", error)
            return None, "connect"
        replica.record_progress()
        if status >= 500:
            self.replicas.record_failure(replica, f"prefill leg answered {status}", probe_blind=True)
            return None, "server_error"
        if status == 429:
            return None, "busy"
        if status >= 400:
            # The request's own fault (too long, a bad field): the decode worker would say the same.
            refused = web.Response(status=status, body=answer, headers=out_headers)
            return PrefillOutcome(answer=refused, replica=replica.name), "client_error"
        if status != 200:
            self.replicas.reject(replica, "prefill_status")
            return None, "bad_answer"
        replica.record_success()
        now = self.clock()
        self.metrics.prefill_seconds.labels(replica.name).observe(now - sent_at)
        params = transfer_params(answer)
        if params is None:
            # An engine without a KV connector (or one that lost the request's KV) answers plainly: counted, and
            # the request runs whole rather than decoding from nothing.
            self.replicas.reject(replica, "prefill_without_transfer_params")
            return None, "no_params"
        routed.first_token(now)
        cached, _ = usage_in_body(answer)
        routed.served(cached, now)
        return PrefillOutcome(params=params, replica=replica.name), "ok"


__all__ = [
    "KV_TRANSFER_PARAMS",
    "REMOTE_DECODE",
    "PdLegs",
    "PdMetrics",
    "PrefillOutcome",
    "decode_request",
    "stream_error",
]
