"""When the fleet is saturated: every eligible replica has enough work queued to stay busy until the router hears
of its next pass.

A replica is saturated when its queued prefill — the uncached prompt tokens of requests routed there that have not
produced a first token, as the load book counts them (other routers' shared load included), less what the policy
estimates is already computed of the request in progress — is at least `hold_passes` x `batch_tokens` (the
engine's max_num_batched_tokens); or when it has `max_seqs` requests in flight (the engine's max_num_seqs: one
more could not start, it would wait in the engine for a running request to end); or, where configured, when the
engine reports `engine_waiting` requests or more waiting, or its KV cache `kv_usage` full or more (both scraped,
so up to a scrape old). Below that on some replica a request goes straight through; above it on every replica,
it waits in the router.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvrouter.policies.base import ReplicaLoad


@dataclass(frozen=True, slots=True)
class SaturationRule:
    prefill_tokens: int
    engine_waiting: int | None = None
    kv_usage: float | None = None
    max_seqs: int | None = None

    def reason(self, load: ReplicaLoad, queued_tokens: float | None = None) -> str | None:
        """Why this replica is saturated, or None when it can take more work now. `queued_tokens`: the policy's
        estimate of the prefill still to compute there (kv_aware: pending less the progress of the request in
        progress); default the load book's pending prefill."""
        queued = load.pending_prefill_tokens if queued_tokens is None else queued_tokens
        if queued >= self.prefill_tokens:
            return f"queued prefill {queued:.0f} >= {self.prefill_tokens} tokens"
        if self.max_seqs is not None and load.in_flight >= self.max_seqs:
            return f"{load.in_flight} requests in flight >= max_seqs {self.max_seqs}"
        if self.engine_waiting is not None and (load.engine_waiting or 0) >= self.engine_waiting:
            return f"engine waiting {load.engine_waiting} >= {self.engine_waiting}"
        if self.kv_usage is not None and (load.kv_usage or 0.0) >= self.kv_usage:
            return f"kv usage {load.kv_usage:.3f} >= {self.kv_usage:g}"
        return None

    def saturated(self, loads: Iterable[tuple[ReplicaLoad, float | None]]) -> bool:
        """True when there is at least one (load, queued tokens) and every one is saturated."""
        seen = False
        for load, queued in loads:
            if self.reason(load, queued) is None:
                return False
            seen = True
        return seen

    def room(self, loads: Iterable[tuple[ReplicaLoad, float | None]]) -> float:
        """Prefill tokens the replicas can still queue before each is saturated by queued prefill (the fleet's
        free budget, for `kvrouter.flow.shares`)."""
        return sum(
            max(0.0, self.prefill_tokens - (load.pending_prefill_tokens if queued is None else queued))
            for load, queued in loads
        )


__all__ = ["SaturationRule"]
