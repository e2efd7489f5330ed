"""A simulated replica's Prometheus metrics, under vLLM's names and `engine`/`model_name` labels.

Each replica has its own `CollectorRegistry` (several replicas share one process). Engine-side values (running,
waiting, KV usage, prefix-cache query and hit counters) are read from the engine model at scrape time, so they
are never stale; latency histograms are observed by the driver, in wall seconds (what a router timing the replica
sees: at `--time-scale 0.5` the replica is an engine at half the profile's speed, and says so), with vLLM's bucket
bounds — TTFT at the first token; e2e and, as vLLM does when a request finishes, its queue time,
its prefill time (from the pass that first scheduled it to its first token) and the prompt tokens it computed,
which kv_aware's engine source reads (kvrouter/routing/engine_rates.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrouter.sim.model import EngineGaugesSnapshot

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip

TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
"""vLLM's 1-2-5 buckets for token counts (up to 5M, past any model length)."""


class _EngineCollector(Collector):
    def __init__(self, gauges: Callable[[], EngineGaugesSnapshot], labels: dict[str, str]) -> None:
        self._gauges = gauges
        self._names = list(labels)
        self._values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        snapshot = self._gauges()
        specs: list[tuple[str, str, float, bool]] = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             snapshot.num_running, False),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", snapshot.num_waiting, False),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snapshot.kv_usage, False),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             snapshot.prefix_queries, True),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             snapshot.prefix_hits, True),
        ]  # fmt: skip
        for name, documentation, value, is_counter in specs:
            family: GaugeMetricFamily | CounterMetricFamily
            if is_counter:
                family = CounterMetricFamily(name, documentation, labels=self._names)
            else:
                family = GaugeMetricFamily(name, documentation, labels=self._names)
            family.add_metric(self._values, float(value))
            yield family


class ReplicaMetrics:
    def __init__(self, model_name: str, gauges: Callable[[], EngineGaugesSnapshot], engine_index: str = "0") -> None:
        self.registry = CollectorRegistry()
        labels = {"engine": engine_index, "model_name": model_name}
        names = list(labels)
        self._labels = labels
        self.registry.register(_EngineCollector(gauges, labels))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        # Per request when it finishes, as vLLM's v1 loggers observe them: the time it waited to be scheduled, the
        # time from being scheduled to its first token (its prefill passes) and the prompt tokens it computed.
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            names,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.prefill_computed_tokens = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            names,
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=self.registry
        ).labels(**labels)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=self.registry
        ).labels(**labels)
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", names, registry=self.registry
        ).labels(**labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
