"""The application factory: every long-lived object of a router process is built here and nowhere else.

`create_app(settings, fleet)` wires the load book, the policy, the router core, the replica set, the metrics
(on the given registry, or a fresh one), the proxy handlers and the background work: one pooled client session
(connect timeout, per-chunk read timeout, no automatic decompression so bodies cross unchanged), the /health
prober and the engine /metrics scraper. They live in `cleanup_ctx`, so they start with the server and stop
when it shuts down. Shared objects are reachable through typed `web.AppKey`s.

`build_prefix_parts` is the one place where the prefix index, the tokenizer, the learning overlays
(`kvrouter.routing.overlays`: kv_feedback, kv_survival) and their background work (KV-event ingest, which tells the
overlays what it applies) are made; without them the router routes on load alone. A replica whose cache is gone
(it refused a connection, or left the fleet) is cleared from the index and from every overlay (`forget_replica`).

TCP_NODELAY: aiohttp sets it on every connection it makes or accepts (client and server protocols alike), so
small SSE chunks are never held back by Nagle's algorithm on either hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvrouter.admin.control import install_admin
from kvrouter.blocks import native_block_keys
from kvrouter.config import ConfigError, FleetConfig, Settings
from kvrouter.events.embedded import EmbeddedEvents
from kvrouter.index import PrefixIndex
from kvrouter.index_writer import CountingIndexWriter
from kvrouter.metrics import CalibrationCollector, CostSource, LostHitCollector, RouterMetrics, SessionCollector
from kvrouter.policies import build_policy
from kvrouter.policies.kv_aware import KvAwarePolicy
from kvrouter.redisplane.loadplane import LoadPlaneCollector, RedisLoadPlane, build_load_plane, instance_name
from kvrouter.redisplane.wiring import build_follower
from kvrouter.routing.calibration import PYTHON_FIT_ENV, CostCalibrator, native_cost_fit
from kvrouter.routing.disagg import DisaggSettings, PdPlanner
from kvrouter.routing.herding import BlindGroup, BlindGroupConfig
from kvrouter.routing.lifecycle import EventListener, RequestListener, tell_cleared
from kvrouter.routing.load import LoadBook
from kvrouter.routing.overlays import overlays_from_settings
from kvrouter.routing.quality import RoutingQuality, SaturationConfig
from kvrouter.routing.router import PrefixLookup, PromptTokenizer, Router
from kvrouter.routing.sessions import SessionTable
from kvrouter.routing.sharing import LoadShare, PeerCalibrationSink, PeerPrefillSink, ShareLimits
from kvrouter.server.client_limits import EDGE, ClientEdge, EdgeLimits, prompt_limits, soft_fd_limit
from kvrouter.server.disagg_legs import PdLegs
from kvrouter.server.engine_costs import EngineCostFeed
from kvrouter.server.flow_gate import FlowGate
from kvrouter.server.local_loadplane import LocalLoadPlane
from kvrouter.server.proxy import Proxy
from kvrouter.server.quality_metrics import QualityCollector
from kvrouter.server.replicas import ReplicaSet
from kvrouter.server.status import EVENT_STREAMS
from kvrouter.tokenization import HfPromptTokenizer
from kvrouter.typedefs import ReplicaName

CleanupContext = Callable[[web.Application], AsyncIterator[None]]
log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", Settings)
FLEET = web.AppKey("fleet", FleetConfig)
METRICS = web.AppKey("metrics", RouterMetrics)
LOAD = web.AppKey("load", LoadBook)
ROUTER = web.AppKey("router", Router)
REPLICAS = web.AppKey("replicas", ReplicaSet)
PROXY = web.AppKey("proxy", Proxy)
SESSION = web.AppKey("session", aiohttp.ClientSession)
INDEX = web.AppKey("index", PrefixIndex)
"""The fleet's prefix index, when it has one (set with a tokenizer or without: events fill it either way)."""


@dataclass(slots=True)
class PrefixParts:
    """What KV-aware routing adds to the router: the index, the tokenizer and the tasks that feed the index."""

    index: PrefixIndex | None = None
    lookup: PrefixLookup | None = None
    """What the router asks: the index wrapped by the overlays the settings turn on."""
    request_listeners: list[RequestListener] = field(default_factory=list)
    event_listeners: list[EventListener] = field(default_factory=list)
    tokenizer: PromptTokenizer | None = None
    contexts: list[CleanupContext] = field(default_factory=list)
    events: object | None = None
    """Follows replicas' KV events (`fleet_control.EventFollower`), so a reload can add or drop replicas."""


def build_prefix_parts(
    settings: Settings,
    fleet: FleetConfig,
    metrics: RouterMetrics,
    clock: Callable[[], float],
    load: LoadBook | None = None,
) -> PrefixParts:
    """The prefix index, its overlays (reading `load`, the router's load book), the fleet's tokenizer and the
    ingest of every replica's KV events (embedded ZMQ, or the Redis follower)."""
    index = PrefixIndex(provisional_ttl_s=settings.provisional_ttl_s, max_blocks=settings.index_max_blocks)
    if index.backend.name != "native":
        log.warning(
            "the prefix index runs on its pure-Python tables (kvrouter._blocktable was not built: install with a C "
            "compiler present): ~3x the memory per block and slower lookups"
        )
    if not native_block_keys():
        log.warning("block keys are hashed from Python (kvrouter._blockkeys was not built): ~5x slower, same keys")
    metrics.events.index_bytes.set_function(index.table_bytes)
    metrics.events.read_index_anomalies(lambda: {"hash_reuse": index.hash_reuses, "orphaned_bit": index.orphaned_bits})
    overlays = overlays_from_settings(settings, index, load if load is not None else LoadBook())
    if overlays.lost_hits is not None:
        metrics.registry.register(LostHitCollector(overlays.lost_hits))
    parts = PrefixParts(
        index=index,
        lookup=overlays.lookup,
        request_listeners=overlays.request_listeners,
        event_listeners=overlays.event_listeners,
    )
    if fleet.tokenizer is None:
        log.warning("replicas.yaml names no tokenizer: requests are routed on load only, without prefix matching")
        metrics.events.load_only.set(1)
    else:
        try:
            tokenizer = HfPromptTokenizer(
                fleet.tokenizer,
                threads=settings.tokenizer_threads,
                inline_chars=settings.tokenizer_inline_chars,
                limits=prompt_limits(settings),
                cache_bytes=settings.tokenizer_cache_bytes,
                on_refused=lambda reason: metrics.client_rejections.labels(reason).inc(),
            )
        except ValueError as error:
            raise ConfigError(f"tokenizer: {error}") from None
        parts.tokenizer = tokenizer
        metrics.tokenizer_cache_bytes.set_function(lambda: tokenizer.cache.nbytes)
        metrics.tokenizer_cache_entries.set_function(lambda: len(tokenizer.cache))

        async def close_tokenizer(app: web.Application) -> AsyncIterator[None]:
            yield
            tokenizer.close()

        parts.contexts.append(close_tokenizer)
    if settings.redis_url is None:
        events = EmbeddedEvents(
            fleet,
            index,
            metrics.events,
            rcv_hwm=settings.events_rcv_hwm,
            silent_after_s=settings.events_silent_after_s,
            listeners=parts.event_listeners,
            clock=clock,
        )
        parts.events = events
        parts.contexts.append(events.context)
    else:
        # Relay mode: the events come through Redis (`kvrouter relay`); readiness waits for the index to load.
        follower = build_follower(
            settings.redis_url, fleet, index, metrics.registry, clock=clock, listeners=parts.event_listeners
        )
        followed = follower.replicas
        metrics.events.read_index_blocks(lambda: {name: index.held_counts().get(name, 0) for name in followed})
        parts.events = follower
        parts.contexts.append(follower.context)
    return parts


def create_app(
    settings: Settings,
    fleet: FleetConfig,
    *,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
    reload_on_sighup: bool = True,
) -> web.Application:
    """A ready-to-run application; the caller runs it (with handler cancellation, see `kvrouter.serve`).
    `reload_on_sighup` False: SIGHUP is not this app's (one fleet of several, `kvrouter.server.fleets`)."""
    metrics = RouterMetrics(registry if registry is not None else CollectorRegistry(auto_describe=True))
    # The client edge reads every body first (outermost middleware) and bounds connections (kvrouter/client_limits).
    edge = ClientEdge(EdgeLimits.from_settings(settings, soft_fd_limit()), metrics)
    app = web.Application(
        client_max_size=settings.max_body_bytes, handler_args=edge.handler_args(), middlewares=[edge.middleware]
    )
    app[EDGE] = edge
    app.on_response_prepare.append(edge.on_response_prepare)
    load = LoadBook()
    prefix = build_prefix_parts(settings, fleet, metrics, clock, load)
    replicas = ReplicaSet(fleet, settings, load, metrics, clock)
    quality = RoutingQuality()
    share = None
    blind_group = None
    sharing = settings.redis_url is not None or settings.load_share_dir is not None
    if settings.load_share and sharing:
        # Shared load (kvrouter/routing/sharing.py): this instance's own counts out, the other instances' in.
        name = instance_name()
        if settings.load_share_blind_group:
            # The peers' decisions this instance cannot see yet (kvrouter/routing/herding.py). Its horizon
            # follows the plane's measured staleness (LoadShare: twice the largest recent echo); until the first
            # echo, two ticks.
            horizon = BlindGroupConfig(
                horizon_s=2 * settings.load_share_interval_s, stagger_max_s=settings.load_share_stagger_max_s
            )
            blind_group = BlindGroup(horizon, random.Random(name))
        share = LoadShare(
            name,
            load,
            lambda: [state.name for state in replicas],
            lookup=prefix.lookup,
            limits=ShareLimits(expiry_s=settings.load_share_expiry_s, prefix_blocks=settings.load_share_prefix_blocks),
            blind_group=blind_group,
        )
        plane: RedisLoadPlane | LocalLoadPlane
        if settings.redis_url is not None:
            plane = build_load_plane(
                settings.redis_url,
                share,
                metrics.registry,
                interval_s=settings.load_share_interval_s,
                heartbeat_s=settings.load_share_heartbeat_s,
                clock=clock,
            )
        else:
            # One host, no Redis (`--workers`): Unix datagrams in a private directory (local_loadplane).
            assert settings.load_share_dir is not None
            plane = LocalLoadPlane(
                share,
                settings.load_share_dir,
                interval_s=settings.load_share_interval_s,
                heartbeat_s=settings.load_share_heartbeat_s,
                clock=clock,
            )
            metrics.registry.register(LoadPlaneCollector(plane))
        prefix.contexts.append(plane.context)
    policy = build_policy(fleet.policy or settings.policy, settings, clock=clock)
    if share is not None and isinstance(policy, PeerPrefillSink):
        share.progress = policy  # the peers' prefills queue in its progress estimate as its own do
    if share is not None and settings.load_share_calibration and isinstance(policy, PeerCalibrationSink):
        share.share_calibration(policy)  # every instance fits the fleet's observations, as one router would
    sessions = None
    if settings.session_mode != "off" and settings.session_key_from != "off":
        sessions = SessionTable(
            mode=settings.session_mode, max_sessions=settings.session_max, ttl_s=settings.session_ttl_s
        )
        metrics.registry.register(SessionCollector(sessions))
    router = Router(
        policy=policy,
        load=load,
        index=prefix.lookup,
        tokenizer=prefix.tokenizer,
        hash_seed=fleet.hash_seed,
        lora_adapters=fleet.all_adapters,
        listeners=[*prefix.request_listeners, quality, *([share] if share is not None else [])],
        sessions=sessions,
        blind_group=blind_group,
        clock=clock,
    )
    if isinstance(policy, KvAwarePolicy) and policy.calibration is not None and not native_cost_fit():
        log.warning(
            "kv_aware's cost refit runs in Python (kvrouter._costfit was not built, or %s is set): ~30x slower, "
            "same fits",
            PYTHON_FIT_ENV,
        )
    cost_source = policy if isinstance(policy, CostSource) else None
    engine_rates = None
    engine_feed = None
    if isinstance(policy, KvAwarePolicy) and policy.calibration is not None and settings.kv_engine_metrics:
        # The engines' own /metrics: a lower bound on each replica's prefill rate (kvrouter/routing/engine_rates.py).
        engine_feed = replicas.on_engine_totals = EngineCostFeed(policy, metrics)
        engine_rates = policy.engine_rates
    if cost_source is not None:
        collector = CalibrationCollector(
            cost_source, lambda: [(r.name, r.route.weight) for r in replicas], engine_rates=engine_rates
        )
        metrics.registry.register(collector)
    saturation = SaturationConfig(settings.kv_prefill_tokens_per_s, settings.saturation_queue_s)
    metrics.registry.register(QualityCollector(quality, replicas, load, saturation, costs=cost_source))
    calibration = policy.calibration if isinstance(policy, KvAwarePolicy) else None
    forget = forget_replica(prefix.index, prefix.event_listeners, clock, sessions, engine_feed, calibration)
    replicas.on_gone = forget
    flow = fleet.flow
    if settings.flow_control is not None:
        flow = flow.model_copy(update={"enabled": settings.flow_control})
    disaggregated = any(replica.role == "prefill" for replica in fleet.replicas)
    if disaggregated and flow.enabled:
        # The queue's saturation rule counts one kind of replica; a fleet of prefill and decode workers would need
        # one per role, so a disaggregated fleet runs without the router queue (docs/disaggregation.md).
        log.warning("flow control is off: the fleet has prefill workers (role: prefill), which it does not cover")
        flow = flow.model_copy(update={"enabled": False})
    pd = fleet.disaggregation
    planner = PdPlanner(
        router,
        DisaggSettings(pd.mode, pd.max_local_prefill_tokens or settings.kv_batch_tokens),
        disaggregated=disaggregated,
    )
    legs = PdLegs(
        planner,
        replicas,
        metrics.registry,
        prefill_timeout_s=pd.prefill_timeout_s,
        max_retries=settings.max_retries,
        forward_authorization=settings.forward_authorization,
        clock=clock,
    )
    gate = FlowGate(
        flow,
        router=router,
        replicas=replicas,
        batch_tokens=settings.kv_batch_tokens,
        registry=metrics.registry,
        clock=clock,
    )
    proxy = Proxy(
        settings=settings,
        router=router,
        replicas=replicas,
        load=load,
        metrics=metrics,
        clock=clock,
        gate=gate,
        legs=legs,
    )
    app[SETTINGS] = settings
    app[FLEET] = fleet
    app[METRICS] = metrics
    app[LOAD] = load
    app[ROUTER] = router
    app[REPLICAS] = replicas
    app[PROXY] = proxy
    if prefix.index is not None:
        app[INDEX] = prefix.index
    proxy.add_routes(app)
    if isinstance(prefix.events, EmbeddedEvents):
        app[EVENT_STREAMS] = prefix.events
    install_admin(
        app,
        fleet=fleet,
        fleet_path=settings.replicas,
        admin_token=settings.admin_token,
        replicas=replicas,
        load=load,
        metrics=metrics,
        registry=metrics.registry,
        index=prefix.index,
        events=prefix.events,
        redis_url=settings.redis_url,
        forget=forget,
        reload_on_sighup=reload_on_sighup,
    )
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_replica_watch)
    app.cleanup_ctx.append(gate.context)
    app.cleanup_ctx.extend(prefix.contexts)
    return app


def forget_replica(
    index: CountingIndexWriter | None,
    listeners: Sequence[EventListener],
    clock: Callable[[], float],
    sessions: SessionTable | None = None,
    engine_feed: EngineCostFeed | None = None,
    costs: CostCalibrator | None = None,
) -> Callable[[ReplicaName], None]:
    """A replica's cache is gone (it refused a connection: its engine is down; or it left the fleet): its blocks
    leave the index, every overlay forgets what it learnt about it, its sessions are free to go elsewhere, its
    engine's prefill history no longer counts (an engine that comes back starts its totals again) and kv_aware
    drops its fitted costs (what comes back may be another GPU: it is priced like its peers until its own
    requests fit it again)."""

    def forget(replica: ReplicaName) -> None:
        if index is not None:
            if index.blocks_of(replica):
                log.warning(
                    "replica %s is gone (refused a connection or removed), and with it its cached blocks", replica
                )
            index.clear(replica)
        tell_cleared(listeners, replica, clock())
        if sessions is not None:
            sessions.forget(replica)
        if engine_feed is not None:
            engine_feed.forget(replica)
        if costs is not None:
            costs.forget(replica)

    return forget


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=settings.upstream_keepalive_s, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        # Only what the client sent goes upstream: no invented Accept-Encoding (the engine might compress for a
        # client that cannot decompress) and no aiohttp User-Agent.
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    app[SESSION] = session
    app[PROXY].session = session
    yield
    await session.close()


async def _replica_watch(app: web.Application) -> AsyncIterator[None]:
    replicas = app[REPLICAS]
    session = app[SESSION]
    tasks = [
        asyncio.create_task(replicas.run_probes(session), name="kvrouter-health-probes"),
        asyncio.create_task(replicas.run_scrapes(session), name="kvrouter-metrics-scrapes"),
    ]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
