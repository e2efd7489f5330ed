"""Routing-quality and capacity metrics, read at scrape time from `RoutingQuality` and the load book.

`kvrouter_routing_decisions_total`, `kvrouter_routing_decisions_with_cache_total`,
`kvrouter_routing_not_best_cached_total` (decisions that did not take a best-cached replica: load overrode the
cache), `kvrouter_routing_cache_blocks_lost_total` / `..._tokens_lost_total` (best cached overlap minus the
chosen replica's, summed); `kvrouter_replica_saturation{replica}` and `kvrouter_fleet_saturation` (in [0, 1],
the autoscaling signal: `kvrouter.routing.quality`; a replica's prefill capacity is its calibrated rate when
kv_aware has learnt one). Nothing is kept twice: the collector reads the pure objects.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrouter.metrics import CostSource
from kvrouter.policies.base import ReplicaLoad
from kvrouter.routing.load import LoadBook
from kvrouter.routing.quality import RoutingQuality, SaturationConfig, fleet_saturation, replica_saturation
from kvrouter.server.replicas import ReplicaSet


class QualityCollector(Collector):
    def __init__(
        self,
        quality: RoutingQuality,
        replicas: ReplicaSet,
        load: LoadBook,
        config: SaturationConfig,
        *,
        costs: CostSource | None = None,
    ) -> None:
        self.quality = quality
        self.replicas = replicas
        self.load = load
        self.config = config
        self.costs = costs
        """kv_aware's calibrated costs: each replica's capacity is its learnt prefill rate when there is one."""

    def collect(self) -> Iterator[Metric]:
        quality = self.quality
        counters = (
            ("decisions", "Routing decisions made by this instance.", quality.decisions),
            (
                "decisions_with_cache",
                "Decisions where at least one candidate replica had part of the prompt cached.",
                quality.decisions_with_cache,
            ),
            (
                "not_best_cached",
                "Decisions that did not take a replica with the best cached overlap (load balancing overrode it).",
                quality.not_best,
            ),
            (
                "cache_blocks_lost",
                "Blocks lost to load balancing: best cached overlap available minus the chosen replica's, summed.",
                quality.blocks_lost,
            ),
            ("cache_tokens_lost", "The same in prompt tokens.", quality.tokens_lost),
        )
        for name, help_text, value in counters:
            yield CounterMetricFamily(f"kvrouter_routing_{name}", help_text, value=value)
        per_replica = GaugeMetricFamily(
            "kvrouter_replica_saturation",
            "How close the replica is to its capacity, 0..1: max of queued prefill over saturation_queue_s of "
            "prefill, and the engine's KV usage.",
            labels=["replica"],
        )
        serving: list[tuple[ReplicaLoad | None, float]] = []
        rates: list[float | None] = []
        in_service = [state for state in self.replicas if state.name not in self.replicas.draining]
        priced = {} if self.costs is None else self.costs.priced_costs([(s.name, s.route.weight) for s in in_service])
        for state in in_service:
            load = self.load.snapshot(state.name)
            weight = state.route.weight
            costs = priced.get(state.name)
            rate = None if costs is None else costs.prefill_tokens_per_s
            per_replica.add_metric([state.name], replica_saturation(load, weight, self.config, rate))
            serving.append((load if state.routable else None, weight))
            rates.append(rate)
        yield per_replica
        yield GaugeMetricFamily(
            "kvrouter_fleet_saturation",
            "The fleet's saturation, 0..1 (weighted mean over replicas in service; unroutable ones count as full): "
            "the autoscaling signal.",
            value=fleet_saturation(serving, self.config, rates),
        )
