"""Routing quality and fleet capacity, the two questions an operator asks of a KV-aware router (pure).

Quality. For every decision `RoutingQuality` (a `RequestListener`) compares the best cached overlap any
candidate had with the overlap of the replica chosen: the difference is what load balancing cost in cache, in
blocks of the chosen replica's size (`blocks_lost`), and a decision that did not take a best-cached replica
counts in `not_best` (their ratio to `decisions` is the share of decisions load overrode the cache). Decisions
where no candidate had anything cached count in `decisions` only. Whether the prediction was right (predicted vs
the engine's reported cached tokens) is measured elsewhere, per request (`kvrouter_cached_tokens_error`).

Capacity. `replica_saturation` says how close one replica is to what it can absorb, in [0, 1]: the larger of its
prefill pressure — queued prefill tokens (this router's and, with shared load, the other instances') over what it
prefills in `queue_target_s` at `prefill_tokens_per_s` — and its KV cache usage as the engine reports it (blocks
held by running requests; cached blocks that are free to evict do not count). `fleet_saturation` is the
weight-weighted mean over the replicas in service: the autoscaling signal (docs/scaling.md). With shared load
every router instance reports the same fleet figure, so any of them — or their max — can be scaled on.

Knobs: `queue_target_s` (`KVROUTER_SATURATION_QUEUE_S`: seconds of queued prefill that count as full) and
`prefill_tokens_per_s` (kv_aware's `KVROUTER_KV_PREFILL_TOKENS_PER_S`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvrouter.policies.base import ReplicaLoad
from kvrouter.routing.lifecycle import Routed


@dataclass(slots=True)
class RoutingQuality:
    decisions: int = 0
    decisions_with_cache: int = 0
    """Decisions where at least one candidate had some of the prompt cached."""
    not_best: int = 0
    blocks_lost: int = 0
    tokens_lost: int = 0

    def on_commit(self, routed: Routed) -> None:
        self.decisions += 1
        best = max((candidate.cached_tokens for candidate in routed.decision.candidates), default=0)
        if best <= 0:
            return
        self.decisions_with_cache += 1
        lost = best - routed.predicted_cached
        if lost > 0:
            self.not_best += 1
            self.tokens_lost += lost
            self.blocks_lost += -(-lost // max(1, routed.block_size))

    def on_first_token(self, routed: Routed, now: float) -> None:
        return

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        return

    def on_finish(self, routed: Routed, now: float) -> None:
        return


@dataclass(frozen=True, slots=True)
class SaturationConfig:
    prefill_tokens_per_s: float = 48_000.0
    queue_target_s: float = 2.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.queue_target_s <= 0:
            raise ValueError("prefill_tokens_per_s and queue_target_s must be positive")


def replica_saturation(load: ReplicaLoad, weight: float, config: SaturationConfig, rate: float | None = None) -> float:
    """`rate`: the replica's own prefill rate when the policy has learnt it (kv_aware's calibration); without it
    the configured rate per unit of weight."""
    tokens_per_s = rate if rate is not None and rate > 0 else config.prefill_tokens_per_s * max(weight, 1e-9)
    capacity = tokens_per_s * config.queue_target_s
    prefill = max(0, load.pending_prefill_tokens) / capacity
    kv = load.kv_usage if load.kv_usage is not None else 0.0
    return min(1.0, max(0.0, prefill, kv))


def fleet_saturation(
    replicas: Iterable[tuple[ReplicaLoad | None, float]],
    config: SaturationConfig,
    rates: Sequence[float | None] = (),
) -> float:
    """Weighted mean saturation of `(load, weight)` pairs, the fleet's replicas in service (draining ones left
    out); a replica that cannot take requests now (load None: its breaker is open) absorbs nothing and counts
    as full, and so does an empty fleet (1.0): both are reasons to add capacity, never to remove it."""
    total = weighted = 0.0
    for position, (load, weight) in enumerate(replicas):
        rate = rates[position] if position < len(rates) else None
        total += weight
        weighted += weight * (1.0 if load is None else replica_saturation(load, weight, config, rate))
    return weighted / total if total > 0 else 1.0


__all__ = ["RoutingQuality", "SaturationConfig", "fleet_saturation", "replica_saturation"]
