"""The scrape loop's feed into kv_aware's costs: each replica's engine /metrics as a prefill-rate lower bound.

`ReplicaSet.scrape` hands every /metrics body's prefill totals (`kvrouter.routing.engine_rates.parse_engine_totals`)
to `EngineCostFeed`, which keeps the per-replica `EngineRates`, passes each replica's current bound to the policy
(`set_engine_rate`) and counts every fallback in `kvrouter_kv_engine_metrics_fallbacks_total{replica,reason}`. The
first fallback of each kind per replica is logged once (a fleet of older vLLM would otherwise log on every
scrape); a later one of the same kind is only counted. Built by the app factory when kv_aware calibrates and
`kv_engine_metrics` is on.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvrouter.metrics import RouterMetrics
from kvrouter.routing.engine_rates import EngineRates, EngineTotals, Fallback
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

_WHY = {
    Fallback.MISSING: "its /metrics has no vllm:request_prefill_time_seconds and "
    "vllm:request_prefill_kv_computed_tokens histograms (an older vLLM or another engine)",
    Fallback.INVALID: "its /metrics prefill histograms hold a value that is not a finite count, or a sum that went "
    "down while the count rose",
    Fallback.RESET: "its prefill totals went down (the engine restarted); its engine history starts again",
}


class EngineRateSink(Protocol):
    def set_engine_rate(self, replica: ReplicaName, rate: float | None) -> None: ...


class EngineCostFeed:
    def __init__(self, policy: EngineRateSink, metrics: RouterMetrics, rates: EngineRates | None = None) -> None:
        self.policy = policy
        self.rates = rates or EngineRates()
        self._metrics = metrics
        self._logged: set[tuple[ReplicaName, Fallback]] = set()

    def __call__(self, replica: ReplicaName, scraped: EngineTotals | Fallback) -> None:
        fallback = self.rates.observe(replica, scraped)
        if fallback is not None:
            self._metrics.engine_metrics_fallbacks.labels(replica, fallback.value).inc()
            if (replica, fallback) not in self._logged:
                self._logged.add((replica, fallback))
                log.warning(
                    "replica %s: %s; kv_aware prices it from the router's own observations (counted in "
                    "kvrouter_kv_engine_metrics_fallbacks_total, logged once)",
                    replica,
                    _WHY[fallback],
                )
        self.policy.set_engine_rate(replica, self.rates.rate(replica))

    def forget(self, replica: ReplicaName) -> None:
        self.rates.forget(replica)
        self.policy.set_engine_rate(replica, None)


__all__ = ["EngineCostFeed", "EngineRateSink"]
