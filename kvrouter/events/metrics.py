"""Prometheus collectors of the KV-event plane, registered on an injected registry.

Shared by the router's embedded ingest and the relay: `events` counts every event and every frame problem by
(replica, type, status) — status "ok", or the reason it was skipped (see `ingest` and `zmq_source`);
`index_blocks` is the blocks tracked per replica — set by the relay from its book, or, once `read_index_blocks`
names a reader (the router's prefix index, `PrefixIndex.held_counts`), read at scrape time, so it reports what the
index holds then rather than a count kept per batch; `ingest_lag` is how old the engine's last batch was when it
was applied (engine clock vs. ours, so it includes clock skew); `index_bytes` is the router index's table memory,
read at scrape time; `index_anomalies` counts what the index met and repaired (an engine hash re-stored for
other tokens, a mask bit no source owned), read from the index at scrape time; `load_only` is 1 when no tokenizer
is configured and every request is routed on load alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, Metric

from kvrouter.metric_children import LabelledChildren

HeldBlocks = Callable[[], Mapping[str, float]]
"""-> a value per followed replica (blocks held, 0 included; seconds since the last event), read at scrape time."""
AnomalyCounts = Callable[[], Mapping[str, int]]
"""-> running count per anomaly kind, read at scrape time."""


class EventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "kvrouter_kv_events",
            "vLLM KV-cache events and event frames, by replica, type and status (ok or why it was skipped).",
            ["replica", "type", "status"],
            registry=registry,
        )
        self.index_blocks = _HeldGauge(
            "kvrouter_index_blocks", "KV blocks the prefix index holds per replica.", ["replica"], registry=registry
        )
        self.event_age = _HeldGauge(
            "kvrouter_kv_event_age_seconds",
            "Seconds since the replica's last KV-event batch arrived (since the router began following it, when "
            "none has yet). An engine publishes only when blocks change, so a long age on a replica that is being "
            "sent requests means its kv_events endpoint is wrong or unreachable. Embedded events only.",
            ["replica"],
            registry=registry,
        )
        self.ingest_lag = Gauge(
            "kvrouter_kv_event_lag_seconds",
            "Age of the replica's last applied event batch (router clock minus engine timestamp).",
            ["replica"],
            registry=registry,
        )
        # Per batch: held children (replicas, event types and statuses are bounded sets; `forget` drops a replica's).
        self._events = LabelledChildren(self.events)
        self._ingest_lag = LabelledChildren(self.ingest_lag)
        self.index_bytes = Gauge(
            "kvrouter_index_bytes",
            "Bytes the router's prefix index holds in its block tables (tier tables and engine-hash maps; the pure-"
            "Python fallback's figure is an estimate). Router only.",
            registry=registry,
        )
        self.index_anomalies = _ReadCounter(
            "kvrouter_index_anomalies",
            "Anomalies the prefix index met in KV events and repaired, by kind: hash_reuse (an engine hash stored "
            "again for other tokens: the old block's credit is dropped first), orphaned_bit (a mask bit no source "
            "owns, skipped by a lookup). Router only.",
            "kind",
        )
        registry.register(self.index_anomalies)
        self.load_only = Gauge(
            "kvrouter_routing_load_only",
            "1 when no tokenizer is configured, so requests are routed on load alone (no prefix matching).",
            registry=registry,
        )

    def count(self, replica: str, kind: str, status: str) -> None:
        self._events(replica, kind, status).inc()

    def lag(self, replica: str, seconds: float) -> None:
        """`ingest_lag` of `replica`: how old its batch just applied was."""
        self._ingest_lag(replica).set(seconds)

    def read_index_blocks(self, held: HeldBlocks) -> None:
        """Report `index_blocks` from `held` at every scrape (replicas it no longer names are dropped)."""
        self.index_blocks.held = held

    def read_event_ages(self, ages: HeldBlocks) -> None:
        self.event_age.held = ages

    def read_index_anomalies(self, counts: AnomalyCounts) -> None:
        self.index_anomalies.read = counts

    def forget(self, replica: str) -> None:
        self._ingest_lag.forget(replica)
        for gauge in (self.index_blocks, self.ingest_lag, self.event_age):
            with contextlib.suppress(KeyError):
                gauge.remove(replica)


class _HeldGauge(Gauge):
    """A gauge that, when scraped, first takes its values from `held` (if set)."""

    held: HeldBlocks | None = None
    _shown: frozenset[str] = frozenset()

    def collect(self) -> Iterable[Metric]:
        if self.held is not None:
            counts = self.held()
            for replica in self._shown - counts.keys():
                with contextlib.suppress(KeyError):
                    self.remove(replica)
            for replica, blocks in counts.items():
                self.labels(replica).set(blocks)
            self._shown = frozenset(counts)
        return super().collect()


class _ReadCounter:
    """A counter family whose values live elsewhere (the index's own tallies) and are read at scrape time."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        self._name = name
        self._documentation = documentation
        self._label = label
        self.read: AnomalyCounts | None = None

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self._name, self._documentation, labels=[self._label])]

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        if self.read is not None:
            for kind, count in sorted(self.read().items()):
                family.add_metric([kind], count)
        return [family]
