"""Endpoints that look at the router rather than forward through it: /v1/models (merged from routable
replicas), /health (the router and every replica's breaker, load and KV-event stream), /metrics (Prometheus) and
POST /debug/route — the decision the router would make for a request body, with every candidate's breakdown,
computed by `Router.decide` without committing anything (guarded by `admin_token` when set).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from kvrouter.metrics import CostSource
from kvrouter.openai_request import Endpoint, ParsedRequest, RequestError, parse_request
from kvrouter.routing.adapters import unavailable as adapter_unavailable
from kvrouter.server.streaming import BodyTooLarge, read_capped
from kvrouter.server.worker_metrics import metrics_response
from kvrouter.typedefs import ReplicaName

if TYPE_CHECKING:
    from kvrouter.config import Settings
    from kvrouter.flow.classes import FlowClass
    from kvrouter.metrics import RouterMetrics
    from kvrouter.policies.base import Decision
    from kvrouter.routing.load import LoadBook
    from kvrouter.routing.router import Router
    from kvrouter.server.disagg_legs import PdLegs
    from kvrouter.server.flow_gate import FlowGate
    from kvrouter.server.replicas import ReplicaSet, ReplicaState

_CANDIDATE_FIELDS = frozenset({"replica", "cached_tokens", "score"})


class EventStreams(Protocol):
    def describe(self, replica: ReplicaName) -> dict[str, object] | None:
        """A replica's KV-event stream (endpoint, age of its last batch) for /health; None when it has none."""
        ...


EVENT_STREAMS = web.AppKey("kvrouter_event_streams", EventStreams)
"""Set by the app factory when this process follows KV events itself (embedded mode)."""


class StatusHost(Protocol):
    """What these endpoints need of the request path (the proxy provides it; status never imports the proxy)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def router(self) -> Router: ...
    @property
    def replicas(self) -> ReplicaSet: ...
    @property
    def load(self) -> LoadBook: ...
    @property
    def metrics(self) -> RouterMetrics: ...
    @property
    def gate(self) -> FlowGate | None: ...
    @property
    def legs(self) -> PdLegs | None: ...
    def check_client(self, request: web.Request) -> None: ...
    def check_admin(self, request: web.Request) -> None: ...
    def client_session(self) -> aiohttp.ClientSession: ...
    async def read_body(self, request: web.Request) -> bytes: ...
    def flow_of(self, request: web.Request, parsed: ParsedRequest) -> FlowClass | None: ...
    def session_of(self, request: web.Request, parsed: ParsedRequest) -> str | None: ...


def _error(error: RequestError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


class StatusEndpoints:
    def __init__(self, proxy: StatusHost) -> None:
        self.proxy = proxy

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.proxy.check_client(request)
        except RequestError as error:
            return _error(error)
        answers = await self.listed_models()
        merged: dict[str, dict[str, Any]] = {}
        for entries in answers:
            for entry in entries:
                merged.setdefault(str(entry.get("id")), entry)
        if not merged and not any(answers):
            unavailable = RequestError(
                "no healthy replica listed its models", status=503, code="no_replica_available", type_="server_error"
            )
            return _error(unavailable)
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def listed_models(self) -> list[list[dict[str, Any]]]:
        """What every routable replica's /v1/models lists (an empty list for one that did not answer)."""
        session = self.proxy.client_session()
        timeout = aiohttp.ClientTimeout(total=self.proxy.settings.connect_timeout_s + 5.0)

        async def fetch(replica: ReplicaState) -> list[dict[str, Any]]:
            try:
                url = f"{replica.base_url}/v1/models"
                async with session.get(url, timeout=timeout, allow_redirects=False) as response:
                    if response.status != 200:
                        return []
                    payload = json.loads(await read_capped(response, self.proxy.settings.max_scrape_bytes))
            except (aiohttp.ClientError, TimeoutError, ValueError, BodyTooLarge):
                return []
            data = payload.get("data") if isinstance(payload, dict) else None
            return [entry for entry in data if isinstance(entry, dict)] if isinstance(data, list) else []

        return list(await asyncio.gather(*(fetch(replica) for replica in self.proxy.replicas.routable())))

    async def health(self, request: web.Request) -> web.Response:
        body, routable = self.health_view(request.app.get(EVENT_STREAMS))
        return web.json_response(body, status=200 if routable else 503)

    def health_view(self, streams: EventStreams | None) -> tuple[dict[str, Any], bool]:
        """/health's body, and whether any replica is routable."""
        replicas = {}
        for replica in self.proxy.replicas:
            described = replica.describe()
            described["in_flight"] = self.proxy.load.snapshot(replica.name).in_flight
            if streams is not None and (stream := streams.describe(replica.name)) is not None:
                described["kv_events"] = stream
            replicas[replica.name] = described
        routable = sum(1 for replica in self.proxy.replicas if replica.routable)
        total = len(self.proxy.replicas.replicas)
        status = "ok" if routable == total else "degraded" if routable else "unavailable"
        body = {"status": status, "policy": self.proxy.router.policy.name, "replicas": replicas}
        return body, routable > 0

    def own_exposition(self) -> bytes:
        """This process's metrics, gauges brought up to date."""
        self.proxy.replicas.update_gauges()
        return generate_latest(self.proxy.metrics.registry)

    async def prometheus(self, request: web.Request) -> web.Response:
        return await metrics_response(request, self.own_exposition())  # under --workers, every worker's

    async def debug_route(self, request: web.Request) -> web.Response:
        """The decision the router would make for this body, with every candidate's breakdown; sends nothing."""
        try:
            self.proxy.check_admin(request)
            raw = await self.proxy.read_body(request)
            endpoint = self._debug_endpoint(request, raw)
            parsed = parse_request(endpoint, raw)
            gate = self.proxy.gate
            flow = self.proxy.flow_of(request, parsed)
            session = self.proxy.session_of(request, parsed)
            facts = await self.proxy.router.facts(parsed)
            facts.session = session
        except RequestError as error:
            return _error(error)
        candidates = self.proxy.replicas.routable()
        if not candidates:
            return _error(RequestError("no healthy replica is available", status=503, code="no_replica_available"))
        routes = self.proxy.router.serving(facts, [replica.route for replica in candidates])
        if not routes:
            assert facts.lora is not None
            return _error(adapter_unavailable(facts.lora))
        decision = self.proxy.router.decide(facts, routes)
        flow_view: dict[str, Any] | None = None
        if gate is not None and flow is not None:
            reasons = gate.saturation_reasons()
            held = gate.enabled and (len(gate.queue) > 0 or all(reason is not None for reason in reasons.values()))
            flow_view = {
                "enabled": gate.enabled,
                "band": gate.config.bands[flow.band].name,
                "tenant": flow.label,
                "would_queue": held,
                "queued_in_band": gate.queue.lengths()[gate.config.bands[flow.band].name],
                "replicas": reasons,
            }
        sessions, clock = self.proxy.router.sessions, self.proxy.router.clock
        sources = _cost_sources(self.proxy.router.policy, decision)
        group = self.proxy.router.blind_group
        blind_view: dict[str, Any] | None = None
        if group is not None:
            # Shared load (kvrouter/routing/herding.py): this instance's place among its peers and its wait.
            rank = group.rank
            blind_view = {
                "rank": None if rank is None else rank[0],
                "instances": None if rank is None else rank[1],
                "horizon_s": group.config.horizon_s,
                "stagger_s": group.stagger_s(),
                "expected_unseen": group.measured_unseen,
            }
        legs = self.proxy.legs
        pd_view: dict[str, Any] | None = None
        if legs is not None and legs.active:
            plan = legs.planner.plan(facts, [replica.route for replica in candidates])
            pd_view = {
                "mode": legs.planner.settings.mode,
                "plan": plan.reason,
                "split": plan.split,
                "prefill": None if plan.prefill is None else plan.prefill.chosen,
                "decode": plan.decode.chosen,
                "local_uncached_tokens": plan.local_uncached,
                "max_local_prefill_tokens": legs.planner.settings.max_local_prefill_tokens,
                "decode_candidates": [
                    {"replica": c.replica, "score": c.score, **c.breakdown} for c in plan.decode.candidates
                ],
            }
        return web.json_response(
            {
                "chosen": decision.chosen if pd_view is None else pd_view["decode"],
                "disaggregation": pd_view,
                "policy": self.proxy.router.policy.name,
                "session_mode": None if sessions is None else sessions.mode,
                "session_replica": None if sessions is None else sessions.replica_of(facts.session, clock()),
                "without_session_hint": decision.without_hint,
                "endpoint": endpoint,
                "model": parsed.model,
                "lora_adapter": facts.lora,
                "not_serving_adapter": sorted({r.name for r in candidates} - {r.name for r in routes}),
                "prompt_tokens": facts.prompt_tokens,
                "flow": flow_view,
                "blind_group": blind_view,
                "candidates": [
                    {
                        "replica": c.replica,
                        "cached_tokens": c.cached_tokens,
                        "score": c.score,
                        **{key: value for key, value in c.breakdown.items() if key not in _CANDIDATE_FIELDS},
                        **({} if c.replica not in sources else {"cost_source": sources[c.replica]}),
                    }
                    for c in decision.candidates
                ],
            }
        )

    async def debug_queue(self, request: web.Request) -> web.Response:
        """The router queue now: saturation per replica, lengths per band, and who waits where (the first 100);
        `?request_id=` gives one queued request's position."""
        try:
            self.proxy.check_admin(request)
        except RequestError as error:
            return _error(error)
        gate = self.proxy.gate
        if gate is None:
            return web.json_response({"enabled": False})
        request_id = request.query.get("request_id")
        if request_id is not None:
            position = gate.position(request_id)
            if position is None:
                return _error(RequestError("no such request in the queue", status=404, code="not_queued"))
            return web.json_response({"request_id": request_id, **position})
        return web.json_response(gate.snapshot())

    @staticmethod
    def _debug_endpoint(request: web.Request, raw: bytes) -> Endpoint:
        named = request.match_info.get("endpoint") or request.query.get("endpoint")
        if named is not None:
            if named in ("chat", "chat/completions", "chat_completions"):
                return "chat"
            if named in ("completion", "completions"):
                return "completion"
            raise RequestError("endpoint must be 'chat' or 'completion'", param="endpoint")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return "chat"  # parse_request reports the JSON problem (too deep a nesting included) as a 400
        return "completion" if isinstance(body, dict) and "prompt" in body and "messages" not in body else "chat"


def _cost_sources(policy: object, decision: Decision) -> dict[str, dict[str, str]]:
    """Where each candidate's costs came from (kv_aware: fit, peers, fleet, start, engine or pinned), read right
    after the decision (nothing awaited in between, so they are the ones it priced with)."""
    if not isinstance(policy, CostSource):
        return {}
    weights = [(c.replica, c.breakdown.get("weight", 1.0)) for c in decision.candidates]
    return {
        replica: {
            "prefill_tokens_per_s": costs.rate_source,
            "pass_fixed_s": costs.source,
            "decode_s_per_request": costs.source,
        }
        for replica, costs in policy.priced_costs(weights).items()
    }
