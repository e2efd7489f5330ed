"""Warm-ups: copy a hot prefix to another replica before traffic needs it there.

A warm-up is a `max_tokens=1` request carrying just the prefix: the target computes and caches it, so later
requests that share it find it cached there. Two planners decide when, both pure (no I/O, the caller's clock):

- `HotPrefixReplicator` (hot-prefix replication). After a routing decision it looks at the winner: if the
  request went to a replica holding at least `min_prefix_tokens` of it while that replica's estimated TTFT is above
  `saturated_s`, and another replica that does not hold the prefix would start it at least `gain_s` sooner, it
  asks for a warm-up of the held prefix on that replica (at most one per prefix per `cooldown_s`). Later requests
  then weigh two holders, and load spreads without each overflow paying a cold prefill.
- `PrefixHeat` (drain with warm-up). It counts, per replica, the prefixes routed there with a cache hit
  (decaying with `half_life_s`); `hottest(replica, n)` gives the prefixes to warm elsewhere before that replica
  is drained, so its traffic lands on a replica that already holds them.

Neither is on in the live router: in trace replay both added work when the fleet was busiest and did not lower
TTFT (docs/benchmarks.md, "Beyond kv_aware"); `kvrouter replay --replicate / --drain-warm` runs them.

Knobs: `min_prefix_tokens` [4096], `saturated_s` [1.0], `gain_s` [0.5], `cooldown_s` [30]; heat `half_life_s`
[120], `min_blocks` [8].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvrouter.policies.base import Decision
from kvrouter.typedefs import BlockKey, ReplicaName


@dataclass(frozen=True, slots=True)
class WarmUp:
    replica: ReplicaName
    blocks: int
    """Leading blocks of the request's prompt to compute there."""


@dataclass(frozen=True, slots=True)
class ReplicationConfig:
    min_prefix_tokens: int = 4096
    saturated_s: float = 1.0
    gain_s: float = 0.5
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.min_prefix_tokens < 1 or min(self.saturated_s, self.gain_s, self.cooldown_s) < 0:
            raise ValueError("min_prefix_tokens must be positive; times not negative")


class HotPrefixReplicator:
    def __init__(self, config: ReplicationConfig | None = None) -> None:
        self.config = config or ReplicationConfig()
        self._last: dict[BlockKey, float] = {}
        self.warmups = 0

    def consider(self, decision: Decision, keys: Sequence[BlockKey], block_size: int, now: float) -> WarmUp | None:
        """A warm-up to send after `decision` (a kv_aware one: breakdowns carry `ttft_estimate_s`), or None."""
        config = self.config
        chosen = decision.score_of(decision.chosen)
        if chosen is None or chosen.cached_tokens < config.min_prefix_tokens:
            return None
        blocks = min(chosen.cached_tokens // block_size, len(keys))
        if blocks <= 0:
            return None
        busy = chosen.breakdown.get("ttft_estimate_s", 0.0)
        if busy < config.saturated_s:
            return None
        # A replica holding less than half of the prefix is a candidate for a copy.
        spare = [
            c
            for c in decision.candidates
            if c.replica != decision.chosen and c.cached_tokens * 2 < chosen.cached_tokens
        ]
        if not spare:
            return None
        # Its estimate for this very request (its queue plus the prompt it lacks) bounds when a copy is ready.
        queue = {c.replica: c.breakdown.get("ttft_estimate_s", math.inf) for c in spare}
        target = min(spare, key=lambda c: (queue[c.replica], str(c.replica)))
        if queue[target.replica] + config.gain_s > busy:
            return None
        key = keys[blocks - 1]
        last = self._last.get(key)
        if last is not None and now - last < config.cooldown_s:
            return None
        self._last[key] = now
        if len(self._last) > 4096:
            horizon = now - config.cooldown_s
            self._last = {k: t for k, t in self._last.items() if t >= horizon}
        self.warmups += 1
        return WarmUp(target.replica, blocks)


@dataclass(slots=True)
class _Heat:
    score: float
    at: float
    keys: tuple[BlockKey, ...]


class PrefixHeat:
    """Decaying counts of the cached prefixes routed to each replica."""

    def __init__(self, *, half_life_s: float = 120.0, min_blocks: int = 8, capacity: int = 2048) -> None:
        if half_life_s <= 0 or min_blocks < 1 or capacity < 1:
            raise ValueError("half_life_s, min_blocks and capacity must be positive")
        self.half_life_s = half_life_s
        self.min_blocks = min_blocks
        self.capacity = capacity
        self._heat: dict[ReplicaName, dict[BlockKey, _Heat]] = {}

    def record(self, replica: ReplicaName, keys: Sequence[BlockKey], cached_blocks: int, now: float) -> None:
        """A request with `keys` went to `replica`, which held its first `cached_blocks`."""
        if cached_blocks < self.min_blocks:
            return
        table = self._heat.setdefault(replica, {})
        key = keys[cached_blocks - 1]
        entry = table.get(key)
        if entry is None:
            if len(table) >= self.capacity:
                coldest = min(table, key=lambda k: self._value(table[k], now))
                del table[coldest]
            table[key] = _Heat(1.0, now, tuple(keys[:cached_blocks]))
        else:
            entry.score = self._value(entry, now) + 1.0
            entry.at = now

    def hottest(self, replica: ReplicaName, count: int, now: float) -> list[tuple[BlockKey, ...]]:
        table = self._heat.get(replica, {})
        ranked = sorted(table.values(), key=lambda entry: -self._value(entry, now))
        return [entry.keys for entry in ranked[:count]]

    def _value(self, entry: _Heat, now: float) -> float:
        return entry.score * math.pow(0.5, (now - entry.at) / self.half_life_s)
