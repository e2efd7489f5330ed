"""Prometheus collectors of the KV-event plane, registered on an injected registry.

Shared by the router's embedded ingest and the relay: `events` counts every event and every frame problem by
(replica, type, status) — status "ok", or the reason it was skipped (see `ingest` and `zmq_source`);
`index_blocks` is the blocks tracked per replica; `ingest_lag` is how old the engine's last batch was when it
was applied (engine clock vs. ours, so it includes clock skew); `load_only` is 1 when no tokenizer is configured
and every request is routed on load alone.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge


class EventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "kvrouter_kv_events",
            "vLLM KV-cache events and event frames, by replica, type and status (ok or why it was skipped).",
            ["replica", "type", "status"],
            registry=registry,
        )
        self.index_blocks = Gauge(
            "kvrouter_index_blocks", "KV blocks the prefix index tracks per replica.", ["replica"], registry=registry
        )
        self.ingest_lag = Gauge(
            "kvrouter_kv_event_lag_seconds",
            "Age of the replica's last applied event batch (router clock minus engine timestamp).",
            ["replica"],
            registry=registry,
        )
        self.load_only = Gauge(
            "kvrouter_routing_load_only",
            "1 when no tokenizer is configured, so requests are routed on load alone (no prefix matching).",
            registry=registry,
        )

    def count(self, replica: str, kind: str, status: str) -> None:
        self.events.labels(replica, kind, status).inc()

    def forget(self, replica: str) -> None:
        for gauge in (self.index_blocks, self.ingest_lag):
            with contextlib.suppress(KeyError):
                gauge.remove(replica)
