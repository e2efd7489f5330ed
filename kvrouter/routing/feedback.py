"""Self-correcting prefix lookup: learn from what the engines report they actually served from cache.

`FeedbackLookup` wraps any `PrefixLookup` (the `PrefixIndex`) and sits between it and the router. After each
request the engine reports its cached prompt tokens (`usage.prompt_tokens_details.cached_tokens` live,
`StepResult.cached_tokens` in replay); `observe` compares that with what the router predicted for the replica it
chose and corrects two things:

- Repair. When the engine served fewer blocks than predicted, the first block it did not serve is marked suspect
  on that replica: later lookups stop that replica's match before a suspect block, so one lost `BlockRemoved`
  event costs one wrong guess instead of every request that shares the prefix. A suspect is cleared when the
  replica stores that block again (a `BlockStored` event seen through `on_stored`) or after `suspect_ttl_s`.
- Trust. Per replica, an exponentially weighted mean of served / predicted blocks (requests with a prediction
  only); a replica's matched blocks are scaled by its trust (never below `min_trust`), so a replica whose events
  keep overstating its cache loses credit until it behaves.

It hears both sides through the lifecycle's protocols (`kvrouter.routing.lifecycle`), live and in replay alike: as a
`RequestListener`, `on_served` brings each request's reported cached tokens with the handle's replica, keys and
prediction; as an `EventListener`, every store the event path applies reaches `on_stored` and a replica whose
cache is gone (engine restart, reset, replica removed or unreachable) reaches `on_cleared`, which forgets what
was learnt about it. The index itself is never edited (its data layout is not this module's business);
everything lives in this overlay and the overlay observes the same events the index does. Pure and synchronous;
the clock is the caller's `now`.

`kv_feedback` turns it on (off by default). In trace replay it is neutral on a clean event path and, with one
replica's removals lost, cuts TTFT p99 by 4.6-7.3%, all of it from trust (docs/benchmarks.md, "Beyond kv_aware").

Knobs: `trust_alpha` [0.02] weight of one request in the trust mean; `min_trust` [0.25]; `suspect_ttl_s` [120];
`max_suspects` [65,536 per replica, the memory bound].
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.router import PrefixLookup, PrefixMatch
from kvrouter.typedefs import BlockKey, ReplicaName


@dataclass(frozen=True, slots=True)
class FeedbackConfig:
    trust_alpha: float = 0.02
    min_trust: float = 0.25
    suspect_ttl_s: float = 120.0
    max_suspects: int = 65_536
    """Suspect blocks per replica; beyond it expired ones, then the oldest, are forgotten (memory bound: a suspect
    no lookup meets again would otherwise stay)."""
    repair: bool = True
    trust: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.trust_alpha <= 1 or not 0 <= self.min_trust <= 1 or self.suspect_ttl_s <= 0:
            raise ValueError("trust_alpha must be in (0, 1], min_trust in [0, 1], suspect_ttl_s positive")
        if self.max_suspects < 1:
            raise ValueError("max_suspects must be positive")


class FeedbackLookup:
    """A `PrefixLookup` that corrects the wrapped one with the engines' reported cache hits."""

    def __init__(self, inner: PrefixLookup, config: FeedbackConfig | None = None) -> None:
        self.inner = inner
        self.config = config or FeedbackConfig()
        self._trust: dict[ReplicaName, float] = {}
        self._suspects: dict[ReplicaName, dict[BlockKey, float]] = {}
        self.repairs = 0
        """Suspect blocks marked so far (a metric)."""

    def trust(self, replica: ReplicaName) -> float:
        return self._trust.get(replica, 1.0)

    def suspects(self, replica: ReplicaName) -> int:
        return len(self._suspects.get(replica, ()))

    # ---- PrefixLookup --------------------------------------------------------------------------------------

    def longest_prefixes(self, keys: Sequence[BlockKey], now: float) -> Mapping[ReplicaName, PrefixMatch]:
        found = self.inner.longest_prefixes(keys, now)
        if not self._trust and not self._suspects:
            return found
        result: dict[ReplicaName, PrefixMatch] = {}
        for replica, match in found.items():
            blocks = self._repaired(replica, keys, match.blocks, now)
            trust = self._trust.get(replica, 1.0)
            if trust < 1.0:
                blocks = int(blocks * trust)
            if blocks == match.blocks:
                result[replica] = match
            elif blocks > 0:
                result[replica] = match.cut(blocks)
        return result

    def add_provisional(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        self.inner.add_provisional(replica, keys, now)

    # ---- observations --------------------------------------------------------------------------------------

    def observe(
        self,
        replica: ReplicaName,
        keys: Sequence[BlockKey],
        predicted_tokens: int,
        actual_tokens: int,
        block_size: int,
        now: float,
    ) -> None:
        """The engine served `actual_tokens` from cache where the router predicted `predicted_tokens`."""
        predicted = min(predicted_tokens // block_size, len(keys))
        if predicted <= 0:
            return
        served = min(max(actual_tokens, 0) // block_size, predicted)
        config = self.config
        if config.trust:
            old = self._trust.get(replica, 1.0)
            new = old + config.trust_alpha * (served / predicted - old)
            self._trust[replica] = max(config.min_trust, new)
        if config.repair and served < predicted:
            suspects = self._suspects.setdefault(replica, {})
            suspects[keys[served]] = now + config.suspect_ttl_s
            self.repairs += 1
            if len(suspects) > config.max_suspects:
                self._shed(suspects, now)

    # ---- RequestListener -----------------------------------------------------------------------------------

    def on_commit(self, routed: Routed) -> None:
        pass

    def on_first_token(self, routed: Routed, now: float) -> None:
        pass

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        self.observe(routed.replica, routed.keys, routed.predicted_cached, cached_tokens, routed.block_size, now)

    def on_finish(self, routed: Routed, now: float) -> None:
        pass

    # ---- EventListener -------------------------------------------------------------------------------------

    def on_stored(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        """The replica computed `keys` again: they are no longer suspect there."""
        suspects = self._suspects.get(replica)
        if suspects:
            for key in keys:
                suspects.pop(key, None)

    def on_removed(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        pass  # the index drops them; a suspect among them no longer matters

    def on_cleared(self, replica: ReplicaName, now: float) -> None:
        self.forget(replica)

    def forget(self, replica: ReplicaName) -> None:
        """The replica restarted or left: what was learnt about it no longer holds."""
        self._trust.pop(replica, None)
        self._suspects.pop(replica, None)

    def _shed(self, suspects: dict[BlockKey, float], now: float) -> None:
        for key in [key for key, until in suspects.items() if until <= now]:
            del suspects[key]
        excess = len(suspects) - self.config.max_suspects
        if excess > 0:  # insertion order is age order: the oldest go first
            for key in list(itertools.islice(suspects, excess)):
                del suspects[key]

    def _repaired(self, replica: ReplicaName, keys: Sequence[BlockKey], blocks: int, now: float) -> int:
        suspects = self._suspects.get(replica)
        if not suspects:
            return blocks
        first = blocks
        for key in suspects.keys() & keys[:blocks]:
            if suspects[key] <= now:
                del suspects[key]
            else:
                first = min(first, keys.index(key))
        return first
