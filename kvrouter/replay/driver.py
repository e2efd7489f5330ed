"""The virtual-clock replay loop: trace arrivals, engine passes, KV events and metric scrapes on one event heap.

Routing goes through the live router's own objects — `Router` (candidates from the `PrefixIndex`, the engine's
cached-token rule, the policy's pure `select`, then `commit`: policy state, provisional entries, a `LoadBook`
ticket, and a `Routed` handle that takes the request's first token, cached-token report and finish, exactly as the
live proxy reports them; `kvrouter.routing.lifecycle`) — only the clock is virtual. Each engine runs passes back to back
while it has work; a pass starts at the end of the previous one, or when a request reaches an idle engine. What a
pass produced becomes visible at its end: first tokens and finishes move the load book, and its KV events reach the
index then (plus `event_delay_s`, to model a slow event path). Engine gauges are sampled every `scrape_interval_s`
of virtual time into `LoadBook.observe_engine`, as the live router scrapes /metrics. At equal times, pass ends and
events come before scrapes and arrivals, and passes start last, so simultaneous arrivals share a pass.

Options beyond the plain router: `feedback`, `survival` and `lost_hits` turn on the learning overlays, built by
the same `kvrouter.routing.overlays.build_overlays` the live app uses and fed the same way: a request's first
`StepResult.cached_tokens` goes to `Routed.served` when it finishes (live, the usage arrives at the end of the
answer), and every KV event the index applies goes to the overlays' `EventListener` methods (stores, removals,
clears). The policy hears each first token through the handle (kv_aware's `kv_tune` learns from it). `replicate`
sends the warm-ups `HotPrefixReplicator` (kvrouter/routing/replication.py) asks for after a decision;
`drain_at_s` takes the last engine out of routing at that time (it finishes what it has), after warming its
`drain_warm` hottest prefixes on the others. A warm-up is a 1-token request carrying the prefix: it counts in
the load book and marks provisional entries like a routed request, and is left out of the results.
`sessions` gives requests session keys (`session_mode` soft or sticky: the live router's session hints).
`lost_removals` drops that share of the first engine's `BlockRemoved` events on their way to the router (a lossy
event path: its index keeps blocks the engine no longer has).

Disaggregated prefill/decode: `roles` gives each engine a role; when some are `prefill`, every arrival is planned by
the live router's `PdPlanner` (`kvrouter.routing.disagg`, `disaggregation` its mode and threshold). A request the
plan keeps whole is committed with `commit_decode` and runs as usual. A split one: its prefill leg (the prompt with
one output token) is committed with `commit_prefill` at arrival and added to the prefill engine; when that leg
finishes (the prefill worker's answer reaches the router) the decode leg is committed with `commit_decode` on the
plan's decode worker, and reaches that engine `kv_transfer.seconds(prompt)` later as a request whose KV was
transferred (`EngineRequest.kv_transferred`). The request's record follows what the client sees: TTFT from its
arrival to the decode worker's first token, ITL from the decode worker's tokens; its cached tokens are the prefill
leg's (the work the fleet saved). The disaggregated replay runs with one router, no router queue, no warm-ups and no
drain.

Replicas sharing a GPU (`device`, a profile's `replicas_per_device`): engines 0..N-1 share the first device and so
on; their passes end when the shared device (`kvrouter.sim.device.SharedDevice`, processor sharing) says so, so a
pass beside busy co-located engines takes longer. One device event per device stands for the earliest pass end in
flight; a pass starting or ending there replaces it (a stale one is skipped)."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from kvrouter.flow.classes import FlowClass, FlowClassifier
from kvrouter.flow.kv_reserve import KvReserve
from kvrouter.flow.queue import FlowQueue
from kvrouter.flow.saturation import SaturationRule
from kvrouter.flow.settings import FlowConfig
from kvrouter.flow.shares import BandShares, TenantShares, both
from kvrouter.index import PrefixIndex
from kvrouter.index_writer import IndexWriter
from kvrouter.policies.base import Policy, ReplicaLoad
from kvrouter.replay.engine_metrics import PrefillTotals
from kvrouter.replay.prompts import PreparedPrompt, PromptCatalog, SizedPrompt
from kvrouter.replay.routers import LoadReport, RouterInstance, RouterSpread, Spreader, deliver
from kvrouter.replay.trace import TraceRequest
from kvrouter.routing.disagg import DisaggSettings, PdPlan, PdPlanner, is_disaggregated
from kvrouter.routing.engine_rates import EngineRates
from kvrouter.routing.feedback import FeedbackLookup
from kvrouter.routing.herding import BlindGroup
from kvrouter.routing.lifecycle import Routed, tell_cleared
from kvrouter.routing.load import EngineGauges, LoadBook, Ticket
from kvrouter.routing.overlays import build_overlays
from kvrouter.routing.replication import HotPrefixReplicator, PrefixHeat
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.routing.sessions import SessionTable
from kvrouter.routing.sharing import PeerCalibrationSink
from kvrouter.routing.survival import SurvivalLookup
from kvrouter.sim.device import DeviceSharing, SharedDevice
from kvrouter.sim.model import CacheCleared, EngineModel, EngineRequest, KvEvent, RemovedBlocks, StepResult
from kvrouter.sim.profiles import KvTransfer
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, ReplicaRole, SessionMode

EngineFactory = Callable[[], EngineModel]
"""Builds one simulated engine; `Replay` takes one for every engine alike, or one per engine (a mixed fleet)."""

_PASS_END, _DEVICE, _KV_EVENTS, _LOAD_SHARE, _SCRAPE, _DRAIN, _EXPIRE, _TRANSFER, _ARRIVAL, _PASS_START, _STAGGERED = (
    range(11)
)


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    replicas: int = 4
    event_delay_s: float = 0.0
    """Extra delay between a pass's end and its KV events reaching the index."""
    scrape_interval_s: float = 1.0
    """Virtual seconds between engine gauge samples (0: never)."""
    hash_seed: int = 0
    provisional_ttl_s: float = 5.0
    feedback: bool = False
    survival: bool = False
    lost_hits: bool = False
    prefill_tokens_per_s: float = 48_000.0
    """Survival's wait estimate (`kv_prefill_tokens_per_s`, as live)."""
    lost_removals: float = 0.0
    """Share of engine-0's BlockRemoved events never delivered (evenly spread, deterministic)."""
    replicate: bool = False
    drain_at_s: float | None = None
    drain_warm: int = 0
    whole_answers: bool = False
    """The router hears each first token only when the answer ends (live: non-streaming requests with
    `assemble_non_streaming` off); the records keep the engine's real first-token time."""
    routers: RouterSpread = field(default_factory=RouterSpread)
    """K router instances and how they share load (`kvrouter.replay.routers`); the default is one router."""
    flow: FlowConfig | None = None
    """The router queue (`kvrouter.flow`): None or disabled sends every request at once, as without it."""
    batch_tokens: int = 8192
    """Prompt tokens an engine pass computes (`kv_batch_tokens`): the unit of the queue's saturation rule."""
    tenants: Mapping[int, str] | None = None
    """Tenant per trace index (`kvrouter.replay.tenancy`); None: every request is `anonymous`."""
    urgent: frozenset[int] = frozenset()
    """Trace indices in the most urgent band; the others are in the default band."""
    fairness_window_s: float = 10.0
    """Window of the service-share fairness measure (`ReplayResult.fairness`): long against one request's service
    (a 100k-token prompt is a dozen engine passes), or a single large prompt decides the window."""
    sessions: Mapping[int, str] | None = None
    """Session key per trace index (`kvrouter.replay.trace.conversations`); None: no request has one."""
    session_mode: SessionMode = "off"
    """How a session's last replica weighs on its next request (`kvrouter.routing.sessions`)."""
    session_ttl_s: float = 600.0
    session_max: int = 65_536
    roles: Sequence[ReplicaRole] | None = None
    """Each engine's role in a disaggregated fleet; None: every engine serves whole requests (no planner)."""
    disaggregation: DisaggSettings = field(default_factory=DisaggSettings)
    """The planner's mode and threshold, when `roles` has prefill workers."""
    kv_transfer: KvTransfer | None = None
    """What a decode leg's KV transfer costs (the profile's); None: nothing."""
    device: DeviceSharing = field(default_factory=DeviceSharing)
    """How the engines share GPUs (the profile's `device_sharing()`); the default gives each its own."""
    placements: Mapping[int, int] | None = None
    """Replica number (0-based) per trace index: the request goes there whatever the policy chose, and the record
    keeps the policy's own choice (`policy_choice`). Replays a recorded run's routing to ask, request by request,
    whether the router would have decided alike in the simulated state of that history."""
    engine_metrics: bool = False
    """Feed each scrape's prefill totals (`kvrouter.replay.engine_metrics`) to the policies' engine source, as the
    live router does with `kv_engine_metrics`; off by default, so the replay figures are the router's view alone."""


@dataclass(slots=True)
class RequestRecord:
    index: int
    replica: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    predicted_cached: int
    cached_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None
    preemptions: int = 0
    tenant: str = "anonymous"
    band: str = ""
    queued_s: float = 0.0
    """Time waited in the router queue (part of the TTFT)."""
    admitted: float | None = None
    """When its engine first admitted it (scheduled its first prefill chunk); None: never, or a split request."""
    rejected: str | None = None
    """Why the router turned it away (`queue_full`, `ttl`, `predicted_ttl`), never sent to an engine."""
    pd_reason: str | None = None
    """The P/D plan's reason (`kvrouter.routing.disagg.PlanReason`); None without a planner."""
    prefill_replica: str | None = None
    """Where the prefill leg of a split request ran (`replica` is its decode worker)."""
    transfer_s: float = 0.0
    """A split request's KV transfer time (part of its TTFT)."""
    policy_choice: str | None = None
    """The replica the policy chose when `ReplayOptions.placements` placed the request (None without)."""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        """Mean time between output tokens (the bench's `itl_mean_s`); None with fewer than two tokens."""
        if self.first_token is None or self.finish is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    @property
    def engine_wait(self) -> float | None:
        """Time from reaching its engine to being admitted there: behind the prefill queued ahead of it, or waiting
        for free KV blocks for its whole prompt (part of the TTFT, like `queued_s`); None when never admitted."""
        if self.admitted is None or self.prefill_replica is not None:
            return None
        return max(0.0, self.admitted - self.arrival - self.queued_s)

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival


@dataclass(slots=True)
class ReplayResult:
    policy: str
    records: list[RequestRecord]
    replicas: list[str]
    passes: int = 0
    end_time: float = 0.0
    warmups: int = 0
    fairness: list[float] = field(default_factory=list)
    """Jain's index of weighted service among the tenants backlogged through each fairness window (2 or more)."""
    sessions: dict[str, int] = field(default_factory=dict)
    """The first router's session table at the end: tracked, hinted and changed decisions (empty without hints)."""


@dataclass(slots=True)
class _PrefillLeg:
    """A split request whose prefill leg is on its way; its decode leg follows the prefill worker's answer."""

    request_id: str
    position: int
    plan: PdPlan
    facts: RoutingFacts


@dataclass(slots=True)
class _Device:
    """A GPU shared by engines: its passes in flight and the generation of its one pending device event."""

    model: SharedDevice
    results: dict[ReplicaName, StepResult] = field(default_factory=dict)
    generation: int = 0


@dataclass(slots=True)
class _Engine:
    name: ReplicaName
    model: EngineModel
    busy: bool = False
    start_queued: bool = False
    passes: int = field(default=0)
    device: _Device | None = None


def replica_names(count: int) -> list[ReplicaName]:
    return [ReplicaName(f"engine-{number}") for number in range(count)]


class VirtualClock:
    """The replay's time, read by the router and by any policy built with it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Replay:
    """One policy over one trace; `run()` once. A policy that reads a clock must be built with `clock`."""

    def __init__(
        self,
        *,
        requests: Sequence[TraceRequest],
        prompts: Sequence[PreparedPrompt],
        catalog: PromptCatalog,
        policy: Policy,
        engine_factory: EngineFactory | Sequence[EngineFactory],
        options: ReplayOptions | None = None,
        clock: VirtualClock | None = None,
        policy_factory: Callable[[], Policy] | None = None,
    ) -> None:
        self.options = options or ReplayOptions()
        self.requests = requests
        self.prompts = prompts
        self.catalog = catalog
        self.clock = clock or VirtualClock()
        spread = self.options.routers
        if spread.routers > 1 and policy_factory is None:
            raise ValueError("several routers need a policy_factory (each instance has its own policy)")
        self.instances = [
            self._instance(number, policy if number == 0 or policy_factory is None else policy_factory())
            for number in range(spread.routers)
        ]
        first = self.instances[0]
        self.index = first.index
        self.load = first.load
        self.survival: SurvivalLookup | None = first.survival
        self.feedback: FeedbackLookup | None = first.feedback
        self.event_listeners = first.event_listeners
        self.policy = policy
        self.router = first.router
        self.prefill_totals = PrefillTotals() if self.options.engine_metrics else None
        self._engine_rates = [EngineRates() for _ in self.instances] if self.options.engine_metrics else []
        self._spreader = Spreader(spread)
        self._instance_of: dict[str, RouterInstance] = {}
        self._removals_lost = 0.0
        names = replica_names(self.options.replicas)
        if callable(engine_factory):
            factories: Sequence[EngineFactory] = [engine_factory] * len(names)
        elif len(engine_factory) == len(names):
            factories = engine_factory
        else:
            raise ValueError(f"{len(engine_factory)} engine factories for {len(names)} replicas")
        self.engines = [_Engine(name, factory()) for name, factory in zip(names, factories, strict=True)]
        sharing = self.options.device
        if sharing.shared:
            devices = [_Device(model) for model in sharing.build_all(len(self.engines))]
            for number, engine in enumerate(self.engines):
                engine.device = devices[sharing.device_of(number)]
        block_size = self.engines[0].model.block_size
        if block_size != catalog.block_size:
            raise ValueError(f"the engines' block size {block_size} differs from the prompts' {catalog.block_size}")
        placements = self.options.placements or {}
        outside = sorted({number for number in placements.values() if not 0 <= number < len(self.engines)})
        if outside:
            raise ValueError(f"placements name replicas {outside}: the fleet has {len(self.engines)}")
        roles = self.options.roles
        if roles is not None and len(roles) != len(self.engines):
            raise ValueError(f"{len(roles)} roles for {len(self.engines)} replicas")
        self.routes = [
            Route(engine.name, block_size, role="both" if roles is None else roles[number])
            for number, engine in enumerate(self.engines)
        ]
        self.planner: PdPlanner | None = None
        if is_disaggregated(self.routes):
            options = self.options
            if spread.routers > 1 or options.replicate or options.drain_at_s is not None or options.placements:
                raise ValueError("a disaggregated fleet replays with one router, no warm-ups, drain or placements")
            if options.flow is not None and options.flow.enabled:
                raise ValueError("a disaggregated fleet replays without the router queue")
            self.planner = PdPlanner(self.router, options.disaggregation)
        self._legs: dict[str, _PrefillLeg] = {}
        self._route_of = {route.name: route for route in self.routes}
        self.replicator = HotPrefixReplicator() if self.options.replicate else None
        self.heat = PrefixHeat() if self.options.drain_warm > 0 else None
        self._heat_source: dict[BlockKey, int] = {}
        self.warmups: list[tuple[float, str, int]] = []
        """(time, replica, blocks) of every warm-up sent."""
        self._by_name = {engine.name: engine for engine in self.engines}
        self._heap: list[tuple[float, int, int, object]] = []
        self._sequence = 0
        self._routed: dict[str, Routed] = {}
        self._warm_tickets: dict[str, Ticket] = {}
        self._reported: dict[str, int] = {}
        self._records: dict[str, RequestRecord] = {}
        self._unfinished = 0
        self._result = ReplayResult(policy.name, [], [str(engine.name) for engine in self.engines])
        flow = self.options.flow
        self.queue: FlowQueue[int] | None = None
        self.shares: TenantShares | None = None
        self.band_shares: BandShares | None = None
        self.kv_reserve: KvReserve | None = None
        if flow is not None and flow.enabled:
            if spread.routers > 1:
                raise ValueError("the router queue replays with one router (--routers 1)")
            self.queue = FlowQueue(flow)
            # The engines' max_num_seqs is the replay's to know: taken from them unless the flow section sets it.
            max_seqs = flow.max_seqs or min(engine.model.max_num_seqs for engine in self.engines)
            self.saturation = SaturationRule(
                int(flow.hold_passes * self.options.batch_tokens), flow.engine_waiting, flow.kv_usage, max_seqs
            )
            if flow.tenant_headroom:
                self.shares = TenantShares()
                self.instances[0].router.add_listener(self.shares)
            if flow.band_headroom and len(flow.bands) > 1:
                self.band_shares = BandShares(len(flow.bands))
                self.instances[0].router.add_listener(self.band_shares)
            capacity = flow.kv_capacity_tokens or self._kv_capacity()
            if flow.band_kv_reserve and len(flow.bands) > 1 and capacity:
                self.kv_reserve = KvReserve(len(flow.bands), capacity)
        classifier = FlowClassifier(flow or FlowConfig())
        self._band_names = [band.name for band in classifier.config.bands]
        urgent, default = 0, classifier.default_band
        self._default_band = default
        tenants = self.options.tenants or {}
        self._flows = {
            request.index: classifier.of(
                urgent if request.index in self.options.urgent else default,
                tenants.get(request.index, "anonymous"),
            )
            for request in requests
        }
        self._window_start = 0.0
        self._window_backlogged: set[str] = set()
        self._window_service: dict[str, float] = {}
        self._tenant_waiting: dict[str, int] = {}
        self._tenant_idle_at: dict[str, float] = {}
        """When each tenant's last queued request left the queue (it stopped being backlogged)."""

    @property
    def now(self) -> float:
        return self.clock.now

    def _instance(self, number: int, policy: Policy) -> RouterInstance:
        index = PrefixIndex(provisional_ttl_s=self.options.provisional_ttl_s)
        load = LoadBook()
        overlays = build_overlays(
            index,
            load,
            feedback=self.options.feedback,
            survival=self.options.survival,
            lost_hits=self.options.lost_hits,
            prefill_tokens_per_s=self.options.prefill_tokens_per_s,
        )
        options = self.options
        sessions = None
        if options.session_mode != "off" and options.sessions:
            sessions = SessionTable(
                mode=options.session_mode, max_sessions=options.session_max, ttl_s=options.session_ttl_s
            )
        spread = options.routers
        shares = spread.routers > 1 and spread.share_delay_s is not None and spread.share_calibration
        if shares and isinstance(policy, PeerCalibrationSink):
            policy.share_observations()  # its reports carry its calibration observations (routers.py)
        blind = spread.blind_group_config()
        group = None
        if blind is not None:
            group = BlindGroup(blind, random.Random(f"{options.routers.seed}/{number}"))
            group.rank_among(number, options.routers.routers)
        router = Router(
            policy=policy,
            load=load,
            index=overlays.lookup,
            hash_seed=self.options.hash_seed,
            listeners=overlays.request_listeners,
            sessions=sessions,
            blind_group=group,
            clock=self.clock,
        )
        return RouterInstance(
            f"router-{number}", index, load, router, overlays.event_listeners, overlays.survival, overlays.feedback
        )

    def _share(self, instance: RouterInstance, replica: ReplicaName, keys: Sequence[BlockKey] = ()) -> None:
        """`instance`'s own load on `replica` changed: the others hear it after the share delay (if shared)."""
        delay = self.options.routers.share_delay_s
        if delay is None or len(self.instances) == 1:
            return
        policy = instance.router.policy
        observations = tuple(policy.take_observations()) if isinstance(policy, PeerCalibrationSink) else ()
        report = LoadReport(
            self.instances.index(instance), replica, instance.load.own()[replica], tuple(keys), observations
        )
        if delay == 0:
            deliver(self.instances, report, self.now)
        else:
            self._push(_microsecond(self.now + delay), _LOAD_SHARE, report)

    def _push(self, time: float, kind: int, payload: object) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, (time, kind, self._sequence, payload))

    def run(self) -> ReplayResult:
        for position in range(len(self.requests)):
            self._push(self.requests[position].arrival, _ARRIVAL, position)
        self._unfinished = len(self.requests)
        if self.options.scrape_interval_s > 0:
            self._push(0.0, _SCRAPE, None)
        if self.options.drain_at_s is not None:
            self._push(self.options.drain_at_s, _DRAIN, None)
        heap = self._heap
        while heap:
            time, kind, _, payload = heapq.heappop(heap)
            self.clock.now = time
            if kind == _PASS_END:
                self._pass_end(cast(tuple[_Engine, StepResult], payload))
            elif kind == _DEVICE:
                device, generation = cast(tuple[_Device, int], payload)
                if generation == device.generation:
                    self._device_due(device)
            elif kind == _PASS_START:
                self._pass_start(cast(_Engine, payload))
            elif kind == _ARRIVAL:
                self._arrival(cast(int, payload))
            elif kind == _KV_EVENTS:
                engine, events = cast(tuple[_Engine, list[KvEvent]], payload)
                self._apply_events(engine.name, events)
            elif kind == _LOAD_SHARE:
                deliver(self.instances, cast(LoadReport, payload), time)
            elif kind == _SCRAPE:
                self._scrape()
            elif kind == _DRAIN:
                self._drain()
            elif kind == _EXPIRE:
                self._expire()
            elif kind == _TRANSFER:
                self._transferred(cast(tuple[_PrefillLeg, ReplicaName], payload))
            elif kind == _STAGGERED:
                self._route(*cast(tuple[int, int], payload))
        result = self._result
        result.records = [self._records[str(request.index)] for request in self.requests]
        result.passes = sum(engine.passes for engine in self.engines)
        result.end_time = self.now
        result.warmups = len(self.warmups)
        table = self.router.sessions
        if table is not None:
            result.sessions = {
                "tracked": len(table),
                "hinted_decisions": table.hinted_decisions,
                "changed_decisions": table.changed_decisions,
            }
        return result

    # -- handlers --------------------------------------------------------------------------------------------

    def _arrival(self, position: int) -> None:
        request = self.requests[position]
        flow = self._flows[request.index]
        request_id = str(request.index)
        record = RequestRecord(
            index=request.index,
            replica="",
            arrival=self.now,
            prompt_tokens=request.input_length,
            output_tokens=request.output_length,
            predicted_cached=0,
            tenant=flow.tenant,
            band=self._band_names[flow.band],
        )
        self._records[request_id] = record
        queue = self.queue
        if self.shares is not None:
            self.shares.arrived(flow, request.input_length, self.now)
        if self.band_shares is not None:
            self.band_shares.arrived(flow, request.input_length, self.now)
        if self.kv_reserve is not None:
            self.kv_reserve.arrived(flow, request.input_length, self.now)
        if queue is not None and (len(queue) > 0 or self._saturated() or not self._eligible(flow)):
            predicted = queue.predicted_wait(flow) if queue.config.fail_fast else None
            if predicted is not None and predicted > queue.bands[flow.band].ttl_s:
                record.rejected = "predicted_ttl"
                self._unfinished -= 1
                return
            waiter = queue.push(position, flow, self.now)
            if waiter is None:
                record.rejected = "queue_full"
                self._unfinished -= 1
            else:
                self._push(waiter.deadline, _EXPIRE, None)
                self._tenant_waiting[flow.tenant] = self._tenant_waiting.get(flow.tenant, 0) + 1
            return
        self._route(position)

    def _saturated(self) -> bool:
        load = self.load
        estimate = getattr(self.policy, "queued_prefill_tokens", None)
        loads = ((load.snapshot(route.name), route) for route in self.routes)
        return self.saturation.saturated(
            (snapshot, None if estimate is None else estimate(route.name, snapshot, route.weight))
            for snapshot, route in loads
        )

    def _loads(self) -> Iterator[tuple[ReplicaLoad, float | None]]:
        """Each replica's load and the policy's estimate of its queued prefill (None: the load book's)."""
        load = self.load
        estimate = getattr(self.policy, "queued_prefill_tokens", None)
        for route in self.routes:
            snapshot = load.snapshot(route.name)
            yield snapshot, None if estimate is None else estimate(route.name, snapshot, route.weight)

    def _dispatchable(self) -> Callable[[FlowClass], bool] | None:
        """Which flows may go now (`TenantShares.eligible`: heavy tenants wait while the fleet's room is the
        light tenants' reserve; `BandShares.eligible`: a band waits while the room is the more urgent bands'
        reserve); None: every flow."""
        shares, bands, queue = self.shares, self.band_shares, self.queue
        if (shares is None and bands is None) or queue is None:
            return None
        budget = self.saturation.prefill_tokens * len(self.routes)
        room = self.saturation.room(self._loads())
        tenants = None if shares is None else shares.eligible(budget, room, queue.waiting_weights())
        return both(both(tenants, None if bands is None else bands.eligible(budget, room)), self._kv_open())

    def _kv_capacity(self) -> int | None:
        """The engines' smallest KV cache in tokens (the replay knows its engines), None when a model hides it."""
        sizes = [getattr(getattr(engine.model, "config", None), "num_blocks", None) for engine in self.engines]
        if any(size is None for size in sizes):
            return None
        return min(cast(int, size) for size in sizes) * self.engines[0].model.block_size

    def _kv_open(self) -> Callable[[FlowClass], bool] | None:
        """Which bands some replica with room keeps the KV reserve for (`KvReserve`); None: every band."""
        reserve = self.kv_reserve
        if reserve is None:
            return None
        loads = ((load, self.saturation.reason(load, queued) is None) for load, queued in self._loads())
        opened = reserve.open_bands(loads, self.now)
        if all(opened):
            return None
        return lambda flow: opened[flow.band]

    def _eligible(self, flow: FlowClass) -> bool:
        tenants_idle = self.shares is None or len(self.shares.weights) < 2
        kv_idle = self.kv_reserve is None or self.kv_reserve.reserve(flow.band, self.now) <= 0
        if tenants_idle and kv_idle and (self.band_shares is None or not self.band_shares.may_hold(flow.band)):
            return True  # the queue is empty here: nobody is held for another tenant or band
        eligible = self._dispatchable()
        return eligible is None or eligible(flow)

    def _pump(self) -> None:
        """Capacity may have freed: dispatch queued requests while some replica can take more work."""
        queue = self.queue
        if queue is None or len(queue) == 0:
            return
        self._fairness_tick()
        while len(queue) > 0 and not self._saturated():
            waiter = queue.pop(self.now, self._dispatchable())
            if waiter is None:
                break
            self._records[str(self.requests[waiter.payload].index)].queued_s = waiter.waited(self.now)
            self._left_queue(waiter.flow.tenant)
            self._route(waiter.payload, stagger=False)  # dispatched as capacity frees, as live: no wait

    def _expire(self) -> None:
        if self.queue is None:
            return
        for waiter in self.queue.expire(self.now):
            self._records[str(self.requests[waiter.payload].index)].rejected = "ttl"
            self._unfinished -= 1
            self._left_queue(waiter.flow.tenant)

    def _left_queue(self, tenant: str) -> None:
        waiting = self._tenant_waiting[tenant] - 1
        self._tenant_waiting[tenant] = waiting
        if waiting == 0:
            self._tenant_idle_at[tenant] = self.now

    def _fairness_tick(self) -> None:
        """Close the fairness window when it is over: Jain's index of weighted service among the tenants that
        were backlogged through all of it (queued at its start, and never without a queued request since)."""
        now = self.now
        if now - self._window_start < self.options.fairness_window_s:
            return
        backlogged = {tenant for tenant, waiting in self._tenant_waiting.items() if waiting > 0}
        start = self._window_start
        steady = {
            tenant
            for tenant in self._window_backlogged & backlogged
            if self._tenant_idle_at.get(tenant, float("-inf")) < start
        }
        if len(steady) >= 2:
            shares = [self._window_service.get(tenant, 0.0) for tenant in steady]
            total = sum(shares)
            squares = sum(share * share for share in shares)
            if squares > 0:
                self._result.fairness.append(total * total / (len(shares) * squares))
        self._window_start = now
        self._window_backlogged = backlogged
        self._window_service = {}

    def _route(self, position: int, number: int | None = None, *, stagger: bool = True) -> None:
        if number is None:
            number = self._spreader.pick()
            group = self.instances[number].router.blind_group
            wait = 0.0 if group is None or not stagger else group.stagger_s()
            if group is not None and wait > 0:
                # The instance's stagger (kvrouter/routing/herding.py): it decides after the ones ranked before it.
                group.waited(wait)
                self._push(_microsecond(self.now + wait), _STAGGERED, (position, number))
                return
        request = self.requests[position]
        prepared = self.prompts[position]
        block_size = self.catalog.block_size
        facts = RoutingFacts(
            [cast(list[int], SizedPrompt(self.catalog, request))],
            max_tokens=request.output_length,
            session=None if self.options.sessions is None else self.options.sessions.get(request.index),
            _keys={block_size: prepared.keys},
        )
        instance = self.instances[number]
        instance.routed += 1
        if self.planner is not None:
            self._route_pd(position, facts, instance)
            return
        decision = instance.router.decide(facts, self._kv_routes(request.index))
        placements = self.options.placements
        placed = None if placements is None else placements.get(request.index)
        if placed is not None:
            policy_choice = decision.chosen
            decision = replace(decision, chosen=self.engines[placed].name)
        engine = self._by_name[decision.chosen]
        routed = instance.router.commit(decision, facts, self._route_of[engine.name])
        request_id = str(request.index)
        self._routed[request_id] = routed
        self._instance_of[request_id] = instance
        self._share(instance, engine.name, routed.keys)
        chosen = decision.score_of(decision.chosen)
        if chosen is not None and self.heat is not None:
            cached_blocks = chosen.cached_tokens // block_size
            self.heat.record(engine.name, prepared.keys, cached_blocks, self.now)
            if cached_blocks >= self.heat.min_blocks:
                self._heat_source[prepared.keys[cached_blocks - 1]] = position
        if self.replicator is not None:
            warm = self.replicator.consider(decision, prepared.keys, block_size, self.now)
            if warm is not None:
                self._warm(warm.replica, position, warm.blocks)
        record = self._records[request_id]
        record.replica = str(engine.name)
        record.predicted_cached = routed.predicted_cached
        if placed is not None:
            record.policy_choice = str(policy_choice)
        if self.queue is not None:
            flow = self._flows[request.index]
            computed = request.input_length - routed.predicted_cached
            self.queue.charge(flow, computed, self.now)
            if self.shares is not None:
                self.shares.routed(routed, flow)
            if self.band_shares is not None:
                self.band_shares.routed(routed, flow)
            served = (computed + request.output_length) / flow.weight
            self._window_service[flow.tenant] = self._window_service.get(flow.tenant, 0.0) + served
        engine.model.add(
            EngineRequest(
                request_id=request_id,
                prompt_len=request.input_length,
                block_hashes=prepared.engine_hashes,
                max_tokens=request.output_length,
                arrival=self.now,
                priority=self._engine_priority(request.index),
            )
        )
        self._queue_start(engine)

    def _kv_routes(self, index: int) -> list[Route]:
        """The routes a request may take: with the KV reserve, those keeping its band's reserve (all when none)."""
        reserve = self.kv_reserve
        if reserve is None:
            return self.routes
        tokens = reserve.reserve(self._flows[index].band, self.now)
        if tokens <= 0:
            return self.routes
        keeping = [route for route in self.routes if reserve.keeps(self.load.snapshot(route.name), tokens)]
        return keeping or self.routes

    def _engine_priority(self, index: int) -> int:
        """vLLM's `priority` for the request: its band's distance from the default band (the integer that
        `kvrouter.flow.classes` reads as that band, and the router writes with `flow.engine_priority`)."""
        return self._flows[index].band - self._default_band

    def _route_pd(self, position: int, facts: RoutingFacts, instance: RouterInstance) -> None:
        """Plan a request in a disaggregated fleet: whole on one replica, or its prefill leg now."""
        planner = self.planner
        assert planner is not None
        request = self.requests[position]
        prepared = self.prompts[position]
        request_id = str(request.index)
        record = self._records[request_id]
        plan = planner.plan(facts, self.routes)
        record.pd_reason = plan.reason
        if plan.prefill is None:
            engine = self._by_name[plan.decode.chosen]
            routed = planner.commit_decode(plan, facts, self._route_of[engine.name], arrival=None)
            self._routed[request_id] = routed
            self._instance_of[request_id] = instance
            record.replica = str(engine.name)
            record.predicted_cached = routed.predicted_cached
            engine.model.add(
                EngineRequest(
                    request_id,
                    request.input_length,
                    prepared.engine_hashes,
                    request.output_length,
                    self.now,
                    priority=self._engine_priority(request.index),
                )
            )
            self._queue_start(engine)
            return
        engine = self._by_name[plan.prefill.chosen]
        routed = planner.commit_prefill(plan, facts, self._route_of[engine.name], arrival=None)
        leg_id = f"{request_id}:prefill"
        self._routed[leg_id] = routed
        self._instance_of[leg_id] = instance
        self._legs[leg_id] = _PrefillLeg(request_id, position, plan, facts)
        record.replica = str(plan.decode.chosen)
        record.prefill_replica = str(engine.name)
        record.predicted_cached = routed.predicted_cached
        priority = self._engine_priority(request.index)
        engine.model.add(
            EngineRequest(leg_id, request.input_length, prepared.engine_hashes, 1, self.now, priority=priority)
        )
        self._queue_start(engine)

    def _prefill_answered(self, leg_id: str) -> None:
        """The prefill worker answered: the decode leg is sent, and its KV reaches the decode worker after the
        transfer."""
        leg = self._legs.pop(leg_id)
        planner = self.planner
        assert planner is not None
        record = self._records[leg.request_id]
        replica = leg.plan.decode.chosen
        routed = planner.commit_decode(leg.plan, leg.facts, self._route_of[replica], arrival=record.arrival)
        self._routed[leg.request_id] = routed
        self._instance_of[leg.request_id] = self.instances[0]  # one router replays a disaggregated fleet
        transfer = self.options.kv_transfer
        record.transfer_s = 0.0 if transfer is None else transfer.seconds(record.prompt_tokens)
        self._push(self.now + record.transfer_s, _TRANSFER, (leg, replica))

    def _transferred(self, payload: tuple[_PrefillLeg, ReplicaName]) -> None:
        leg, replica = payload
        request = self.requests[leg.position]
        engine = self._by_name[replica]
        engine.model.add(
            EngineRequest(
                leg.request_id,
                request.input_length,
                self.prompts[leg.position].engine_hashes,
                request.output_length,
                self.now,
                kv_transferred=True,
                priority=self._engine_priority(request.index),
            )
        )
        self._queue_start(engine)

    def _queue_start(self, engine: _Engine) -> None:
        if not engine.busy and not engine.start_queued:
            engine.start_queued = True
            self._push(self.now, _PASS_START, engine)

    def _pass_start(self, engine: _Engine) -> None:
        engine.start_queued = False
        if engine.busy or not engine.model.has_work():
            return
        result = engine.model.step(self.now)
        engine.passes += 1
        for request_id in result.cached_tokens:
            record = self._records.get(request_id)
            if record is not None and record.admitted is None and request_id not in self._legs:
                record.admitted = self.now
        totals = self.prefill_totals
        if totals is not None:
            for request_id, cached in result.cached_tokens.items():
                record = self._records.get(request_id)
                if record is not None and request_id not in self._legs:
                    totals.admitted(engine.name, request_id, self.now, record.prompt_tokens - cached)
        if result.duration <= 0 and not (result.first_tokens or result.tokens or result.finished):
            return  # nothing schedulable: stay idle until the next arrival
        engine.busy = True
        device = engine.device
        if device is None:
            self._push(self.now + result.duration, _PASS_END, (engine, result))
            return
        device.results[engine.name] = result
        self._device_ended(device, device.model.begin(engine.name, result.duration, self.now))

    def _device_due(self, device: _Device) -> None:
        self._device_ended(device, device.model.advance(self.now))

    def _device_ended(self, device: _Device, ended: Sequence[tuple[float, object]]) -> None:
        """Passes that ended on a shared device end now (at equal times, before anything else); the device's next
        end replaces its pending event."""
        for _, name in ended:
            engine = self._by_name[cast(ReplicaName, name)]
            self._push(self.now, _PASS_END, (engine, device.results.pop(engine.name)))
        device.generation += 1
        end = device.model.next_end()
        if end is not None:
            self._push(end, _DEVICE, (device, device.generation))

    def _pass_end(self, payload: tuple[_Engine, StepResult]) -> None:
        engine, result = payload
        engine.busy = False
        now = self.now
        records = self._records
        # In the order the live proxy sees them: first token; then, at the end, the cached-token report and finish.
        legs = self._legs
        if self.prefill_totals is not None:
            for request_id in result.first_tokens:
                self.prefill_totals.first_token(request_id, now)
            for request_id in result.finished:
                self.prefill_totals.finished(request_id)
        for request_id in result.first_tokens:
            routed = self._routed.get(request_id)
            if routed is None:
                self.load.first_token(self._warm_tickets[request_id])
                continue
            if request_id in legs:
                routed.first_token(now)  # the prefill worker's one token: the router sees it as its answer
                continue
            if not self.options.whole_answers:
                routed.first_token(now)
            records[request_id].first_token = now
            self._share(self._instance_of[request_id], routed.replica)
        for request_id, cached in result.cached_tokens.items():
            leg = legs.get(request_id)
            if leg is not None:
                records[leg.request_id].cached_tokens = cached  # the prefill leg's hits: the work saved
                self._reported.setdefault(request_id, cached)
                continue
            record = records.get(request_id)
            if record is None:
                continue  # a warm-up
            if record.prefill_replica is None:
                record.cached_tokens = cached
            # What vLLM's usage reports is the first admission's count (a preempted request keeps it).
            self._reported.setdefault(request_id, cached)
        for request_id in result.preempted:
            leg = legs.get(request_id)
            if leg is not None:
                records[leg.request_id].preemptions += 1
            elif request_id in records:
                records[request_id].preemptions += 1
        for request_id in result.finished:
            routed = self._routed.pop(request_id, None)
            if routed is None:
                self.load.finish(self._warm_tickets.pop(request_id))
                continue
            # The live proxy reads the usage at the end of the answer, just before the request finishes.
            routed.first_token(now)  # a no-op unless whole answers hid the first token until now
            routed.served(self._reported.pop(request_id, None), now)
            routed.finish(now)
            self._share(self._instance_of.pop(request_id), routed.replica)
            if request_id in legs:
                self._prefill_answered(request_id)
                continue
            record = records[request_id]
            record.finish = now
            self._unfinished -= 1
            if self.queue is not None:
                self.queue.charge(self._flows[record.index], record.output_tokens, now)
        if result.events:
            if self.options.event_delay_s > 0:
                self._push(now + self.options.event_delay_s, _KV_EVENTS, (engine, result.events))
            else:
                self._apply_events(engine.name, result.events)
        self._pump()
        self._queue_start(engine)

    def _warm(self, replica: ReplicaName, position: int, blocks: int) -> None:
        """Compute the first `blocks` blocks of request `position`'s prompt on `replica` (one output token)."""
        prepared = self.prompts[position]
        blocks = min(blocks, len(prepared.engine_hashes), len(prepared.keys))
        if blocks <= 0:
            return
        engine = self._by_name[replica]
        tokens = blocks * self.catalog.block_size
        request_id = f"warm-{len(self.warmups)}"
        self.warmups.append((self.now, str(replica), blocks))
        self._warm_tickets[request_id] = self.load.begin(replica, tokens)
        if self.router.index is not None:
            self.router.index.add_provisional(replica, prepared.keys[:blocks], self.now)
        engine.model.add(EngineRequest(request_id, tokens, prepared.engine_hashes[:blocks], 1, self.now))
        self._queue_start(engine)

    def _drain(self) -> None:
        """The last engine leaves routing; its hottest prefixes are warmed first where they are missing."""
        leaving = self.engines[-1].name
        self.routes = [route for route in self.routes if route.name != leaving]
        if self.heat is None or not self.routes or self.router.index is None:
            return
        for keys in self.heat.hottest(leaving, self.options.drain_warm, self.now):
            held = self.router.index.longest_prefixes(keys, self.now)
            if any(held[route.name].blocks >= len(keys) for route in self.routes if route.name in held):
                continue
            target = min(self.routes, key=lambda route: self.load.snapshot(route.name).pending_prefill_tokens)
            self._warm(target.name, self._heat_source[keys[-1]], len(keys))

    def _lost(self, replica: ReplicaName) -> bool:
        """Whether this BlockRemoved event from `replica` is one the lossy event path drops."""
        share = self.options.lost_removals
        if share <= 0 or replica != self.engines[0].name:
            return False
        self._removals_lost += share
        if self._removals_lost >= 1.0:
            self._removals_lost -= 1.0
            return True
        return False

    def _apply_events(self, replica: ReplicaName, events: Sequence[KvEvent]) -> None:
        """Every router instance follows the same events (the event plane is shared, losses included)."""
        lost = [isinstance(event, RemovedBlocks) and self._lost(replica) for event in events]
        for instance in self.instances:
            self._apply_to(instance, replica, events, lost)

    def _apply_to(
        self, instance: RouterInstance, replica: ReplicaName, events: Sequence[KvEvent], lost: Sequence[bool]
    ) -> None:
        """Events in order, consecutive stores batched into one index call."""
        key_of = self.catalog.keys_by_hash.get
        index: IndexWriter = instance.index
        listeners = instance.event_listeners
        now = self.now

        def store(hashes: list[EngineBlockHash], keys: list[BlockKey]) -> None:
            index.store_keys(replica, hashes, keys)
            for listener in listeners:
                listener.on_stored(replica, keys, now)

        hashes: list[EngineBlockHash] = []
        keys: list[BlockKey] = []
        for event, dropped in zip(events, lost, strict=True):
            if isinstance(event, RemovedBlocks):
                if hashes:
                    store(hashes, keys)
                    hashes, keys = [], []
                if dropped:
                    continue
                if listeners:
                    removed = [key for key in map(key_of, event.block_hashes) if key is not None]
                    for listener in listeners:
                        listener.on_removed(replica, removed, now)
                # Output blocks were never stored (their tokens are not in the trace): the index skips them.
                index.remove_blocks(replica, cast(tuple[EngineBlockHash, ...], event.block_hashes))
            elif isinstance(event, CacheCleared):
                hashes, keys = [], []
                index.clear(replica)
                tell_cleared(listeners, replica, now)
            else:
                found = list(map(key_of, event.block_hashes))
                if None not in found:
                    hashes.extend(cast(tuple[EngineBlockHash, ...], event.block_hashes))
                    keys.extend(cast(list[BlockKey], found))
                else:
                    for block_hash, key in zip(event.block_hashes, found, strict=True):
                        if key is not None:
                            hashes.append(EngineBlockHash(block_hash))
                            keys.append(key)
        if hashes:
            store(hashes, keys)

    def _scrape(self) -> None:
        for engine in self.engines:
            gauges = engine.model.gauges()
            sample = EngineGauges(gauges.num_waiting, gauges.num_running, gauges.kv_usage)
            for instance in self.instances:
                instance.load.observe_engine(engine.name, sample)
            if self.prefill_totals is not None:
                totals = self.prefill_totals.totals(engine.name)
                for instance, rates in zip(self.instances, self._engine_rates, strict=True):
                    rates.observe(engine.name, totals)
                    sink = getattr(instance.router.policy, "set_engine_rate", None)
                    if sink is not None:
                        sink(engine.name, rates.rate(engine.name))
        self._pump()
        if self._unfinished > 0:
            self._push(self.now + self.options.scrape_interval_s, _SCRAPE, None)


def _microsecond(time: float) -> float:
    """`time` on a microsecond grid: a peer's report and a staggered decision due at the same instant (sums of the
    same delays, which can differ in their last bit) then tie, and the report, its kind first, is delivered first."""
    return round(time, 6)


def replay_policy(
    *,
    requests: Sequence[TraceRequest],
    prompts: Sequence[PreparedPrompt],
    catalog: PromptCatalog,
    policy: Policy,
    engine_factory: EngineFactory | Sequence[EngineFactory],
    options: ReplayOptions | None = None,
    clock: VirtualClock | None = None,
    policy_factory: Callable[[], Policy] | None = None,
) -> ReplayResult:
    return Replay(
        requests=requests,
        prompts=prompts,
        catalog=catalog,
        policy=policy,
        engine_factory=engine_factory,
        options=options,
        clock=clock,
        policy_factory=policy_factory,
    ).run()


def floor_ttfts(
    requests: Sequence[TraceRequest], prompts: Sequence[PreparedPrompt], engine_factory: EngineFactory
) -> list[float]:
    """Each request's TTFT alone on an idle engine whose cache holds every block any earlier request had."""
    seen: set[int] = set()
    floors: list[float] = []
    for request, prompt in zip(requests, prompts, strict=True):
        hashes = prompt.engine_hashes
        best = 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            best += 1
        engine = engine_factory()
        if best:
            warm = EngineRequest("warm", best * engine.block_size, hashes[:best], 1, 0.0)
            engine.add(warm)
            while engine.has_work():
                engine.step(0.0)
        engine.add(EngineRequest("probe", request.input_length, hashes, 1, 0.0))
        elapsed = 0.0
        while True:
            step = engine.step(elapsed)
            elapsed += step.duration
            if "probe" in step.first_tokens or not engine.has_work():
                break
        floors.append(elapsed)
        seen.update(hashes)
    return floors
