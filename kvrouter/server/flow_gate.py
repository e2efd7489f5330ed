"""The live shell of the router queue (`kvrouter.flow`): requests wait here while every replica is saturated.

`FlowGate.admit` is awaited by the proxy before a completion's first attempt. Below saturation (and with nobody
queued) it returns at once with nothing decided — the request is routed as without the gate, and the cost is one
saturation check. Otherwise the request is queued in its band and tenant and its handler sleeps on a future.
Capacity frees when a routed request produces its first token or finishes (the gate is a `RequestListener` of the
router) and on a short tick while anyone waits (engine gauges, other routers' load, replicas coming back): the
gate then dispatches queued requests while some replica can take more work, choosing each one's replica at that
moment (`Router.decide` and `Router.commit` run synchronously in the pump, so the next saturation check already
counts it) and hands the handler the committed `Routed`. The TTFT the client sees counts the wait; the policy
hears the TTFT from dispatch (what the replica did).

Refusals: a full band, a wait past the band's TTL, or (`fail_fast`) a predicted wait past it, is a 429 with
`Retry-After` (the band's recent wait, rounded up, at least 1 s); a fleet with no routable replica while requests
wait gets them a 503. A client that disconnects while queued is taken out of the queue and nothing is sent
upstream.

Metrics (`kvrouter_flow_*`): queue length per band, waits per band and tenant, dispatches, rejections by reason,
cancellations, unknown header values, service tokens charged per tenant, and whether the fleet is saturated now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvrouter.flow.classes import FlowClass, FlowClassifier
from kvrouter.flow.kv_reserve import KvReserve
from kvrouter.flow.queue import FlowQueue, Waiter
from kvrouter.flow.saturation import SaturationRule
from kvrouter.flow.settings import FlowConfig
from kvrouter.flow.shares import BandShares, TenantShares, both
from kvrouter.metric_children import LabelledChildren
from kvrouter.metrics import LATENCY_BUCKETS
from kvrouter.openai_request import ParsedRequest, RequestError
from kvrouter.policies.base import Decision, ReplicaLoad
from kvrouter.routing.adapters import unavailable as adapter_unavailable
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.server.replicas import ReplicaSet, ReplicaState

log = logging.getLogger(__name__)

TICK_S = 0.05
"""While requests wait: how often saturation is re-read without a first token or finish to prompt it."""


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry, bands: list[str]) -> None:
        self.queued = Gauge(
            "kvrouter_flow_queued", "Requests waiting in the router queue, by band.", ["band"], registry=registry
        )
        for band in bands:
            self.queued.labels(band).set(0)
        self.wait = Histogram(
            "kvrouter_flow_wait_seconds",
            "Time requests waited in the router queue before dispatch, by band and tenant.",
            ["band", "tenant"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.dispatched = Counter(
            "kvrouter_flow_dispatched",
            "Requests dispatched by the router queue (queued: waited first; direct: the fleet had room).",
            ["band", "tenant", "path"],
            registry=registry,
        )
        self.rejected = Counter(
            "kvrouter_flow_rejected",
            "Requests the router queue turned away: queue_full, ttl, predicted_ttl (429 with Retry-After), "
            "no_replica (503).",
            ["band", "reason"],
            registry=registry,
        )
        self.cancelled = Counter(
            "kvrouter_flow_cancelled",
            "Queued requests whose client left (nothing sent upstream).",
            ["band"],
            registry=registry,
        )
        self.unknown = Counter(
            "kvrouter_flow_unknown_values",
            "Priority or tenant values naming no configured band or tenant (the default was used).",
            ["field"],
            registry=registry,
        )
        self.service = Counter(
            "kvrouter_flow_service_tokens",
            "Tokens of service charged per tenant for fair sharing (prompt tokens computed, tokens generated).",
            ["tenant"],
            registry=registry,
        )
        self.saturated = Gauge(
            "kvrouter_flow_saturated",
            "1 while every routable replica is saturated (requests queue).",
            registry=registry,
        )
        # Per request: held children (bands and tenant labels are bounded; none is ever removed).
        self.dispatched_child = LabelledChildren(self.dispatched)
        self.service_child = LabelledChildren(self.service)


@dataclass(slots=True)
class Dispatched:
    """What the pump decided for a queued request: the handler's first attempt uses it."""

    replica: ReplicaState
    decision: Decision
    routed: Routed


@dataclass(slots=True)
class Admission:
    """The gate's answer: `dispatched` is None when the request was not queued (route it as usual)."""

    flow: FlowClass
    dispatched: Dispatched | None = None


@dataclass(slots=True, eq=False)
class _Pending:
    facts: RoutingFacts
    future: asyncio.Future[Dispatched]
    request_id: str


@dataclass(slots=True)
class _BandWait:
    """A decayed mean of recent waits in one band (Retry-After's estimate)."""

    mean_s: float = 0.0
    seen: bool = False

    def add(self, wait_s: float) -> None:
        self.mean_s = wait_s if not self.seen else 0.9 * self.mean_s + 0.1 * wait_s
        self.seen = True


class FlowGate:
    def __init__(
        self,
        config: FlowConfig,
        *,
        router: Router,
        replicas: ReplicaSet,
        batch_tokens: int,
        registry: CollectorRegistry,
        clock: Callable[[], float],
        tick_s: float = TICK_S,
    ) -> None:
        self.config = config
        self.enabled = config.enabled
        self.classifier = FlowClassifier(config)
        self.queue: FlowQueue[_Pending] = FlowQueue(config)
        self.rule = SaturationRule(
            int(config.hold_passes * batch_tokens), config.engine_waiting, config.kv_usage, config.max_seqs
        )
        self.router = router
        self.replicas = replicas
        self.clock = clock
        self.tick_s = tick_s
        self.metrics = FlowMetrics(registry, [band.name for band in config.bands])
        self._waits = [_BandWait() for _ in config.bands]
        self._by_request: dict[str, Waiter[_Pending]] = {}
        self._wake = asyncio.Event()
        self._pump_scheduled = False
        self._flows: dict[int, FlowClass] = {}
        """The flow of each routed request still running (by the Routed's id), to charge its generated tokens."""
        router.add_listener(self)
        self.shares = TenantShares() if config.tenant_headroom else None
        if self.shares is not None:
            router.add_listener(self.shares)
        self.band_shares = BandShares(len(config.bands)) if config.band_headroom and len(config.bands) > 1 else None
        if self.band_shares is not None:
            router.add_listener(self.band_shares)
        capacity = config.kv_capacity_tokens
        reserve_on = config.band_kv_reserve and len(config.bands) > 1 and capacity is not None
        self.kv_reserve = KvReserve(len(config.bands), capacity) if reserve_on and capacity is not None else None

    # -- the request path ------------------------------------------------------------------------------------

    def classify(self, headers: Mapping[str, str], api_key: str, parsed: ParsedRequest) -> FlowClass:
        flow = self.classifier.classify(headers, api_key, parsed.body)
        for name in flow.unknown:
            self.metrics.unknown.labels(name.removeprefix("unknown_")).inc()
        return flow

    async def admit(self, flow: FlowClass, facts: RoutingFacts, request_id: str) -> Admission:
        """Wait, if the fleet is saturated, until this request is dispatched; raises RequestError (429 / 503)."""
        band = self.config.bands[flow.band].name
        if not self.enabled:
            return Admission(flow)
        if self.shares is not None:
            self.shares.arrived(flow, facts.prompt_tokens or 0, self.clock())
        if self.band_shares is not None:
            self.band_shares.arrived(flow, facts.prompt_tokens or 0, self.clock())
        if self.kv_reserve is not None:
            self.kv_reserve.arrived(flow, facts.prompt_tokens or 0, self.clock())
        routable = self.replicas.routable()
        if not routable or (
            len(self.queue) == 0
            and not self._saturated(routable)
            and self._eligible(flow, routable)
            and not self._kv_reserved(flow)
        ):
            # No replica at all is the proxy's 503, as without the gate; room now goes straight through.
            self.metrics.dispatched_child(band, flow.label, "direct").inc()
            return Admission(flow)
        predicted = self.queue.predicted_wait(flow) if self.config.fail_fast else None
        ttl_s = self.config.bands[flow.band].ttl_s
        if predicted is not None and predicted > ttl_s:
            self.metrics.rejected.labels(band, "predicted_ttl").inc()
            raise self._busy(flow, f"the router queue of band {band!r} would hold this request past its {ttl_s:g} s")
        loop = asyncio.get_running_loop()
        pending = _Pending(facts, loop.create_future(), request_id)
        waiter = self.queue.push(pending, flow, self.clock())
        if waiter is None:
            self.metrics.rejected.labels(band, "queue_full").inc()
            raise self._busy(flow, f"the router queue of band {band!r} is full")
        self._by_request[request_id] = waiter
        self._queued_changed()
        self._wake.set()
        try:
            dispatched = await pending.future
        except asyncio.CancelledError:
            if self.queue.cancel(waiter):
                self.metrics.cancelled.labels(band).inc()
                self._queued_changed()
            elif pending.future.done() and not pending.future.cancelled() and pending.future.exception() is None:
                # Dispatched in the same instant the client left: the ticket must still be released.
                pending.future.result().routed.finish(self.clock())
            raise
        finally:
            self._by_request.pop(request_id, None)
        return Admission(flow, dispatched)

    def charge_routed(self, flow: FlowClass, routed: Routed) -> None:
        """A request of `flow` was routed: its computed prompt tokens now, its generated tokens when it ends."""
        self._charge(flow, routed.prompt_tokens - routed.predicted_cached)
        self._flows[id(routed)] = flow
        if self.shares is not None:
            self.shares.routed(routed, flow)
        if self.band_shares is not None:
            self.band_shares.routed(routed, flow)

    def _charge(self, flow: FlowClass, tokens: float) -> None:
        if tokens > 0:
            self.queue.charge(flow, tokens, self.clock())
            self.metrics.service_child(flow.label).inc(tokens)

    def _busy(self, flow: FlowClass, message: str) -> RequestError:
        retry_after = max(1, math.ceil(self._waits[flow.band].mean_s))
        error = RequestError(f"{message}; retry after {retry_after} s", status=429, code="queue_full")
        error.headers = {"Retry-After": str(retry_after)}
        return error

    # -- capacity --------------------------------------------------------------------------------------------

    def _queued_changed(self) -> None:
        for band, length in self.queue.lengths().items():
            self.metrics.queued.labels(band).set(length)

    def _saturated(self, routable: list[ReplicaState]) -> bool:
        """Every routable replica saturated. The load book's pending prefill bounds the policy's estimate from
        above, so a replica under the threshold on it has room without asking the policy (the common case)."""
        estimate = getattr(self.router.policy, "queued_prefill_tokens", None)
        rule = self.rule
        snapshot = self.router.load.snapshot
        for replica in routable:
            load = snapshot(replica.name)
            if rule.reason(load) is None:
                return self._saturation(False)
            if estimate is not None and rule.reason(load, estimate(replica.name, load, replica.route.weight)) is None:
                return self._saturation(False)
        return self._saturation(bool(routable))

    def _loads(self, routable: list[ReplicaState]) -> Iterator[tuple[ReplicaLoad, float | None]]:
        estimate = getattr(self.router.policy, "queued_prefill_tokens", None)
        for replica in routable:
            load = self.router.load.snapshot(replica.name)
            yield load, None if estimate is None else estimate(replica.name, load, replica.route.weight)

    def _dispatchable(self, routable: list[ReplicaState]) -> Callable[[FlowClass], bool] | None:
        """Which flows may go now (`TenantShares.eligible`: a heavy tenant waits while the fleet's room is the
        light tenants' reserve; `BandShares.eligible`: a band waits while it is the more urgent bands' reserve);
        None: every flow."""
        shares, bands = self.shares, self.band_shares
        if shares is None and bands is None:
            return None
        budget = self.rule.prefill_tokens * len(routable)
        room = self.rule.room(self._loads(routable))
        tenants = None if shares is None else shares.eligible(budget, room, self.queue.waiting_weights())
        return both(both(tenants, None if bands is None else bands.eligible(budget, room)), self._kv_open(routable))

    def _kv_reserved(self, flow: FlowClass) -> bool:
        """Whether KV is kept for more urgent bands from this request now: then it goes through the queue, whose
        dispatch routes it among the replicas keeping the reserve (the direct path leaves the choice to the proxy)."""
        return self.kv_reserve is not None and self.kv_reserve.reserve(flow.band, self.clock()) > 0

    def _kv_open(self, routable: list[ReplicaState]) -> Callable[[FlowClass], bool] | None:
        """Which bands some replica with room keeps the KV reserve for (`KvReserve`); None: every band."""
        reserve = self.kv_reserve
        if reserve is None:
            return None
        loads = ((load, self.rule.reason(load, queued) is None) for load, queued in self._loads(routable))
        opened = reserve.open_bands(loads, self.clock())
        if all(opened):
            return None
        return lambda flow: opened[flow.band]

    def _kv_routes(self, flow: FlowClass, routes: list[Route]) -> list[Route]:
        """With the KV reserve, the routes keeping the band's reserve (all of them when none does)."""
        reserve = self.kv_reserve
        if reserve is None:
            return routes
        tokens = reserve.reserve(flow.band, self.clock())
        if tokens <= 0:
            return routes
        keeping = [route for route in routes if reserve.keeps(self.router.load.snapshot(route.name), tokens)]
        return keeping or routes

    def _eligible(self, flow: FlowClass, routable: list[ReplicaState]) -> bool:
        shares, bands = self.shares, self.band_shares
        tenants_idle = shares is None or (len(shares.weights) < 2 and len(self.queue) == 0)
        if tenants_idle and (bands is None or not bands.may_hold(flow.band)):
            return True  # nobody is held for another (and no room to compute)
        if shares is not None and len(self.queue) == 0:
            # Nothing queued: the tenant shares answer for this one tenant without scanning them all, unless a near
            # tie leaves it to the scan; the rest is `_dispatchable`'s, computed in the same order.
            budget = self.rule.prefill_tokens * len(routable)
            room = self.rule.room(self._loads(routable))
            admitted = shares.admits(flow.tenant, budget, room)
            if admitted is not None:
                others = both(None if bands is None else bands.eligible(budget, room), self._kv_open(routable))
                return admitted and (others is None or others(flow))
        eligible = self._dispatchable(routable)
        return eligible is None or eligible(flow)

    def _saturation(self, saturated: bool) -> bool:
        self.metrics.saturated.set(1 if saturated else 0)
        return saturated

    def saturation_reasons(self) -> dict[str, str | None]:
        """Per routable replica, why it is saturated (None: it has room) — for /debug."""
        estimate = getattr(self.router.policy, "queued_prefill_tokens", None)
        reasons: dict[str, str | None] = {}
        for replica in self.replicas.routable():
            load = self.router.load.snapshot(replica.name)
            queued = None if estimate is None else estimate(replica.name, load, replica.route.weight)
            reasons[replica.name] = self.rule.reason(load, queued)
        return reasons

    def pump(self) -> None:
        """Dispatch queued requests while some routable replica has room (synchronous: decide and commit here)."""
        self._pump_scheduled = False
        queue = self.queue
        if len(queue) == 0:
            return
        now = self.clock()
        for waiter in queue.expire(now):
            band = self.config.bands[waiter.flow.band].name
            self.metrics.rejected.labels(band, "ttl").inc()
            if not waiter.payload.future.done():
                waiter.payload.future.set_exception(
                    self._busy(waiter.flow, f"waited {waiter.waited(now):.1f} s in the router queue (band {band!r})")
                )
        routable = self.replicas.routable()
        if not routable:
            for waiter in queue.drain():
                self.metrics.rejected.labels(self.config.bands[waiter.flow.band].name, "no_replica").inc()
                if not waiter.payload.future.done():
                    waiter.payload.future.set_exception(
                        RequestError(
                            "no healthy replica is available",
                            status=503,
                            code="no_replica_available",
                            type_="server_error",
                        )
                    )
        while len(queue) > 0 and not self._saturated(routable):
            popped = queue.pop(now, self._dispatchable(routable))
            if popped is None:
                break
            waiter = popped
            pending = waiter.payload
            if pending.future.done():
                continue
            routes = self.router.serving(pending.facts, [replica.route for replica in routable])
            if not routes:
                assert pending.facts.lora is not None
                pending.future.set_exception(adapter_unavailable(pending.facts.lora))
                continue
            decision = self.router.decide(pending.facts, self._kv_routes(waiter.flow, list(routes)))
            replica = self.replicas.by_name[decision.chosen]
            routed = self.router.commit(decision, pending.facts, replica.route, arrival=now)
            band = self.config.bands[waiter.flow.band].name
            wait_s = waiter.waited(now)
            self._waits[waiter.flow.band].add(wait_s)
            self.metrics.wait.labels(band, waiter.flow.label).observe(wait_s)
            self.metrics.dispatched.labels(band, waiter.flow.label, "queued").inc()
            pending.future.set_result(Dispatched(replica, decision, routed))
        self._queued_changed()

    def _schedule_pump(self) -> None:
        if self._pump_scheduled or len(self.queue) == 0:
            return
        self._pump_scheduled = True
        with contextlib.suppress(RuntimeError):  # no running loop (a test driving the router directly)
            asyncio.get_running_loop().call_soon(self.pump)
            return
        self._pump_scheduled = False

    # RequestListener: a first token or a finish frees capacity.
    def on_commit(self, routed: Routed) -> None:
        return None

    def on_first_token(self, routed: Routed, now: float) -> None:
        self._schedule_pump()

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        return None

    def on_finish(self, routed: Routed, now: float) -> None:
        flow = self._flows.pop(id(routed), None)
        if flow is not None and routed.generated_tokens:
            self._charge(flow, routed.generated_tokens)
        self._schedule_pump()

    async def run(self) -> None:
        """The tick: while anyone waits, re-read saturation and expire TTLs every `tick_s`."""
        while True:
            await self._wake.wait()
            while len(self.queue) > 0:
                self.pump()
                await asyncio.sleep(self.tick_s)
            self._wake.clear()
            self.metrics.saturated.set(0)

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.run(), name="kvrouter-flow-tick")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for waiter in self.queue.drain():
            if not waiter.payload.future.done():
                waiter.payload.future.set_exception(
                    RequestError("the router is shutting down", status=503, code="shutting_down", type_="server_error")
                )

    # -- /debug ----------------------------------------------------------------------------------------------

    def position(self, request_id: str) -> dict[str, Any] | None:
        waiter = self._by_request.get(request_id)
        return None if waiter is None else self.queue.position(waiter, self.clock())

    def _held_back(self) -> list[str]:
        """The waiting tenants (labels) kept out of the light tenants' headroom (or, with `band_headroom`, out of
        the more urgent bands' reserve) right now (`kvrouter.flow.shares`)."""
        routable = self.replicas.routable()
        eligible = self._dispatchable(routable) if routable else None
        if eligible is None:
            return []
        return sorted({waiter.flow.label for waiter in self.queue.waiting() if not eligible(waiter.flow)})

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "enabled": self.enabled,
            "saturated_threshold_tokens": self.rule.prefill_tokens,
            "replicas": self.saturation_reasons(),
            "queued": self.queue.lengths(),
            "held_back": self._held_back(),
            "waiting": [
                {"request_id": waiter.payload.request_id, **self.queue.position(waiter, now)}
                for waiter in self.queue.waiting()
            ][:100],
        }


__all__ = ["Admission", "Dispatched", "FlowGate", "FlowMetrics"]
