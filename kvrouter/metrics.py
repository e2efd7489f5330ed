"""Prometheus collectors of the router, registered on an injected `CollectorRegistry`.

`RouterMetrics` groups every collector the proxy shell touches. Nothing here is global: the app factory makes
one per application (tests make a fresh registry each), and `/metrics` renders that registry. Hot-path children
(`labels(...)` lookups cost a lock and a dict probe) are cached per (replica, route) so the proxy pays one dict
lookup per request. Gauges that mirror state kept elsewhere (in-flight per replica, replica health) are set
when `/metrics` is scraped instead of on every request; `CalibrationCollector` reads kv_aware's learnt costs per
replica the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrouter.events.metrics import EventMetrics
from kvrouter.routing.calibration import ReplicaCosts
from kvrouter.routing.lost_hits import LostHitWatch
from kvrouter.routing.sessions import SessionTable

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
CACHED_ERROR_BUCKETS = (
    -65536.0,
    -16384.0,
    -4096.0,
    -1024.0,
    -256.0,
    -64.0,
    -16.0,
    -1.0,
    0.0,
    1.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
)


@dataclass(slots=True)
class RouteTimers:
    """The per-(replica, route) children a finished request observes."""

    ttft: Histogram
    duration: Histogram


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "kvrouter_requests",
            "Requests answered, by replica, route and HTTP status.",
            ["replica", "route", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "kvrouter_ttft_seconds",
            "Time from request arrival to the first response body byte from the replica.",
            ["replica", "route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "kvrouter_request_duration_seconds",
            "Time from request arrival to the end of the response.",
            ["replica", "route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "kvrouter_in_flight_requests",
            "Requests this router has sent to a replica and not finished.",
            ["replica"],
            registry=registry,
        )
        self.replica_healthy = Gauge(
            "kvrouter_replica_healthy",
            "1 when the replica is routable (breaker closed or half-open).",
            ["replica"],
            registry=registry,
        )
        self.breaker_opens = Counter(
            "kvrouter_breaker_opens",
            "Times a replica's circuit breaker opened.",
            ["replica"],
            registry=registry,
        )
        self.lora_unavailable = Counter(
            "kvrouter_lora_unavailable",
            "Requests naming a LoRA adapter that no routable replica serves (answered 503), by adapter.",
            ["adapter"],
            registry=registry,
        )
        self.retries = Counter(
            "kvrouter_retries",
            "Attempts abandoned before any byte reached the client, by replica and reason.",
            ["replica", "reason"],
            registry=registry,
        )
        self.decision_seconds = Histogram(
            "kvrouter_routing_decision_seconds",
            "Time to choose a replica (index lookup and policy).",
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        self.predicted_cached_tokens = Counter(
            "kvrouter_predicted_cached_tokens",
            "Prompt tokens the router predicted the chosen replica had cached.",
            ["replica"],
            registry=registry,
        )
        self.actual_cached_tokens = Counter(
            "kvrouter_actual_cached_tokens",
            "Prompt tokens the engine reported as cached (usage.prompt_tokens_details.cached_tokens).",
            ["replica"],
            registry=registry,
        )
        self.cached_tokens_error = Histogram(
            "kvrouter_cached_tokens_error",
            "Actual minus predicted cached prompt tokens, per request with usage.",
            ["replica"],
            buckets=CACHED_ERROR_BUCKETS,
            registry=registry,
        )
        self.scrape_errors = Counter(
            "kvrouter_engine_scrape_errors",
            "Failed scrapes of a replica's /metrics.",
            ["replica"],
            registry=registry,
        )
        self.engine_metrics_fallbacks = Counter(
            "kvrouter_kv_engine_metrics_fallbacks",
            "Scrapes whose prefill histograms kv_aware could not use, by replica and reason (missing: not exported, "
            "invalid: a value that is not a finite count or a sum that went down while the count rose, reset: the "
            "count went down, the engine restarted); the replica is priced from the router's own view meanwhile.",
            ["replica", "reason"],
            registry=registry,
        )
        self.probe_failures = Counter(
            "kvrouter_health_probe_failures",
            "Failed active /health probes.",
            ["replica"],
            registry=registry,
        )
        # Hostile requests and replicas (issue 15, upstream side): every refusal and every attribution counted.
        self.upstream_rejections = Counter(
            "kvrouter_upstream_rejections",
            "Replica answers or probes refused or re-attributed, by replica and reason (redirect, stalled, "
            "body_too_large, error_body_too_large, scrape_too_large, probe_too_large, request_5xx, bad_stream, "
            "encoded_stream).",
            ["replica", "reason"],
            registry=registry,
        )
        # The client edge (kvrouter/server/client_limits.py, the tokenizer's prompt caps): what hostile clients
        # were refused.
        self.client_rejections = Counter(
            "kvrouter_client_rejections",
            "Client connections or requests refused at the edge, by reason (connections, malformed_request, "
            "header_timeout, body_timeout, body_too_large, body_buffer_full, prompt_too_large, tokenizer_busy, "
            "bad_token_ids, request_target, path_not_allowed).",
            ["reason"],
            registry=registry,
        )
        self.client_connections = Gauge(
            "kvrouter_client_connections",
            "Open client connections (capped by max_client_connections).",
            registry=registry,
        )
        self.client_connections_recycled = Counter(
            "kvrouter_client_connections_recycled",
            "Kept-alive client connections closed after client_keepalive_requests answers (the last one said "
            "Connection: close), so clients reconnect and spread again over the workers and router pods.",
            registry=registry,
        )
        # Non-streaming answers (kvrouter/server/assembly.py): fetched as streams so the first token is seen.
        self.non_streaming = Counter(
            "kvrouter_non_streaming_requests",
            "Attempts of non-streaming completion requests by replica and how the answer was fetched: assembled "
            "(streamed upstream, exact first-token accounting) or whole, because of learning (the replica's answer "
            "layout is being learned), request_shape (fields a stream cannot reproduce: n > 1, logprobs, tools, "
            "...), replica_layout (the replica's answers cannot be assembled) or disabled (assemble_non_streaming "
            "off).",
            ["replica", "reason"],
            registry=registry,
        )
        self.assembly_mismatches = Counter(
            "kvrouter_answer_assembly_mismatches",
            "Assembled answers whose stream carried a field the replica's learned layout cannot hold; the layout "
            "is relearned.",
            ["replica"],
            registry=registry,
        )
        self.tokenizer_cache_bytes = Gauge(
            "kvrouter_tokenizer_cache_bytes",
            "Bytes the tokenizer's render cache holds (texts, token ids, boundaries, block keys; bounded by "
            "tokenizer_cache_bytes).",
            registry=registry,
        )
        self.tokenizer_cache_entries = Gauge(
            "kvrouter_tokenizer_cache_entries",
            "Rendered prompts the tokenizer's render cache holds (bounded by its entry limit).",
            registry=registry,
        )
        self.events = EventMetrics(registry)
        self._timers: dict[tuple[str, str], RouteTimers] = {}
        # Label children looked up once: `labels()` validates and locks on every call (~1.3 µs each here,
        # loadtest/bench_relay_reads.py), and a request made up to six such calls. Children are never removed, so
        # a cached one stays the exported one.
        self._answered: dict[tuple[str, str, str], Counter] = {}
        self._fetched: dict[tuple[str, str], Counter] = {}
        self._cached_children: dict[str, tuple[Counter, Counter, Histogram]] = {}

    def timers(self, replica: str, route: str) -> RouteTimers:
        key = (replica, route)
        timers = self._timers.get(key)
        if timers is None:
            timers = RouteTimers(self.ttft.labels(replica, route), self.duration.labels(replica, route))
            self._timers[key] = timers
        return timers

    def count_request(self, replica: str, route: str, status: str) -> None:
        """`kvrouter_requests_total{replica, route, status}` + 1."""
        key = (replica, route, status)
        child = self._answered.get(key)
        if child is None:
            child = self._answered[key] = self.requests.labels(replica, route, status)
        child.inc()

    def count_non_streaming(self, replica: str, reason: str) -> None:
        """`kvrouter_non_streaming_requests_total{replica, reason}` + 1."""
        key = (replica, reason)
        child = self._fetched.get(key)
        if child is None:
            child = self._fetched[key] = self.non_streaming.labels(replica, reason)
        child.inc()

    def observe_cached(self, replica: str, predicted: int, actual: int) -> None:
        children = self._cached_children.get(replica)
        if children is None:
            children = self._cached_children[replica] = (
                self.predicted_cached_tokens.labels(replica),
                self.actual_cached_tokens.labels(replica),
                self.cached_tokens_error.labels(replica),
            )
        predicted_total, actual_total, error = children
        predicted_total.inc(predicted)
        actual_total.inc(actual)
        error.observe(actual - predicted)


@runtime_checkable
class CostSource(Protocol):
    """A policy that prices replicas with learnt costs (kv_aware with `kv_calibrate`)."""

    def priced_costs(self, replicas: Iterable[tuple[str, float]]) -> Mapping[str, ReplicaCosts]:
        """The current costs of each (replica, weight): calibrated, or the starting estimate before enough samples."""
        ...

    @property
    def cache_weight(self) -> float: ...


class CalibrationCollector(Collector):
    """kv_aware's per-replica costs and cache weight, read from the policy when /metrics is scraped."""

    def __init__(
        self,
        source: CostSource,
        replicas: Callable[[], Iterable[tuple[str, float]]],
        engine_rates: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self.source = source
        self.replicas = replicas
        """The fleet's (replica, weight) pairs now."""
        self.engine_rates = engine_rates
        """The engines' /metrics lower bounds on the prefill rate, per replica (None: that source is off)."""

    def collect(self) -> Iterator[Metric]:
        costs = sorted(self.source.priced_costs(self.replicas()).items())
        families: tuple[tuple[str, str, Callable[[ReplicaCosts], float]], ...] = (
            (
                "prefill_tokens_per_s",
                "Prefill throughput kv_aware prices the replica with, uncached tokens/s.",
                lambda c: c.prefill_tokens_per_s,
            ),
            ("pass_seconds", "Fixed cost of one engine pass kv_aware prices the replica with.", lambda c: c.pass_s),
            (
                "decode_seconds_per_request",
                "Pass time per decoding request kv_aware prices the replica with.",
                lambda c: c.decode_s_per_request,
            ),
            (
                "samples",
                "Requests behind the replica's calibrated costs (0: still the starting estimate).",
                lambda c: float(c.samples),
            ),
        )
        for suffix, text, value in families:
            family = GaugeMetricFamily(f"kvrouter_kv_calibrated_{suffix}", text, labels=["replica"])
            for replica, replica_costs in costs:
                family.add_metric([replica], value(replica_costs))
            yield family
        sources = GaugeMetricFamily(
            "kvrouter_kv_calibrated_source",
            "Where each cost kv_aware prices the replica with comes from (1 for the source in use): fit (its own "
            "requests), peers, fleet (pooled), start, engine (its /metrics lower bound) or pinned.",
            labels=["replica", "cost", "source"],
        )
        for replica, replica_costs in costs:
            sources.add_metric([replica, "prefill_tokens_per_s", replica_costs.rate_source], 1.0)
            sources.add_metric([replica, "pass_seconds", replica_costs.source], 1.0)
            sources.add_metric([replica, "decode_seconds_per_request", replica_costs.source], 1.0)
        yield sources
        if self.engine_rates is not None:
            engine = GaugeMetricFamily(
                "kvrouter_kv_engine_prefill_tokens_per_s",
                "Per replica (label replica), the prefill rate its engine /metrics prove it at least has "
                "(prefill-time and computed-token histograms); absent while it shows none.",
                labels=["replica"],
            )
            for replica, rate in sorted(self.engine_rates().items()):
                engine.add_metric([replica], rate)
            yield engine
        weight = GaugeMetricFamily(
            "kvrouter_kv_cache_weight", "Worth of a cached token in prefill time saved (derived or pinned)."
        )
        weight.add_metric([], self.source.cache_weight)
        yield weight


class LostHitCollector(Collector):
    """Predicted prefix hits the engines evicted before admitting their requests (`kv_lost_hits`), read when
    /metrics is scraped."""

    def __init__(self, watch: LostHitWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[Metric]:
        watch = self.watch
        yield GaugeMetricFamily(
            "kvrouter_kv_lost_hits_watched",
            "Requests waiting for their first token whose predicted prefix hit is watched for evictions "
            "(kv_lost_hits on).",
            value=watch.watched,
        )
        yield CounterMetricFamily(
            "kvrouter_kv_lost_hits",
            "Predicted prefix hits cut back: the engine evicted their blocks before admitting the request "
            "(kv_lost_hits on).",
            value=watch.lost_requests,
        )
        yield CounterMetricFamily(
            "kvrouter_kv_lost_hit_tokens",
            "Prompt tokens predicted cached that went back to their replica's pending prefill (kv_lost_hits on).",
            value=watch.lost_tokens,
        )


class SessionCollector(Collector):
    """The session table's size and what its hints did, read when /metrics is scraped."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table

    def collect(self) -> Iterator[Metric]:
        table = self.table
        yield GaugeMetricFamily(
            "kvrouter_sessions_tracked", "Sessions whose last replica this router remembers.", value=len(table)
        )
        counters = (
            (
                "hinted_decisions",
                "Decisions made with a session hint (the session's replica was a candidate).",
                table.hinted_decisions,
            ),
            (
                "hint_changed_decisions",
                "Decisions the session hint changed (the policy alone chose another replica).",
                table.changed_decisions,
            ),
            ("evicted", "Sessions forgotten to stay within session_max.", table.evicted),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(f"kvrouter_session_{name}", text, value=value)
