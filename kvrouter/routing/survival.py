"""Survival-aware cache credit: count a cached block only if it is likely still there when the request runs.

The index says which blocks a replica holds now; a request routed there is admitted only after the queue ahead
of it, and an engine under memory pressure evicts its least recently used blocks meanwhile. `SurvivalLookup`
wraps a `PrefixLookup` and, per replica, keeps

- the last touch of every block it knows there: routing a request touches its prompt's blocks on the chosen
  replica (`add_provisional`, which the router calls on commit), a `BlockStored` event touches the stored ones;
- the replica's eviction age: a weighted mean of (removal time - last touch) over its `BlockRemoved` events, the
  time an untouched block lasts there at the current memory pressure (no evictions yet: blocks last forever).

A lookup then trims each replica's match to the blocks whose age + the expected wait there (the replica's
pending prefill tokens / `prefill_tokens_per_s`, from the `LoadBook`) stays under `margin` x its eviction age.
Blocks of one prompt are touched together and a shared head is touched more often than its tail, so ages grow
with depth and a binary search finds the cut. Pure and synchronous; the clock is the caller's `now`. It is an
`EventListener` (`kvrouter.routing.lifecycle`): the event path, live or in replay, tells it every store and removal in
the router's keys, and `on_cleared` forgets a replica whose cache is gone.

Off by default (`kv_survival`): on the Mooncake trace it cut credit that was right and raised TTFT p99 (+9.7% at
x3.0; docs/benchmarks.md, "Beyond kv_aware").

Knobs: `prefill_tokens_per_s` [48000] (the kv_aware estimate's), `margin` [1.0], `max_tracked` [1M blocks per
replica, the memory bound], `age_alpha` [0.05] weight of
one removal batch in the eviction-age mean.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import PrefixLookup, PrefixMatch
from kvrouter.typedefs import BlockKey, ReplicaName


@dataclass(frozen=True, slots=True)
class SurvivalConfig:
    prefill_tokens_per_s: float = 48_000.0
    margin: float = 1.0
    age_alpha: float = 0.05
    max_tracked: int = 1_000_000
    """Blocks whose last touch is remembered per replica; beyond it the oldest remembered are forgotten (a block
    with no remembered touch counts as fresh). Bounds memory where blocks are marked but never evicted by events,
    e.g. provisional marks of requests whose engine never stored them."""

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.margin <= 0 or not 0 < self.age_alpha <= 1:
            raise ValueError("prefill_tokens_per_s and margin must be positive, age_alpha in (0, 1]")
        if self.max_tracked < 1:
            raise ValueError("max_tracked must be positive")


class SurvivalLookup:
    """A `PrefixLookup` whose matches stop at the first block unlikely to survive the wait."""

    def __init__(self, inner: PrefixLookup, load: LoadBook | None = None, config: SurvivalConfig | None = None) -> None:
        self.inner = inner
        self.load = load
        self.config = config or SurvivalConfig()
        self._touched: dict[ReplicaName, dict[BlockKey, float]] = {}
        self._eviction_age: dict[ReplicaName, float] = {}
        self.trimmed = 0
        """Lookups whose match was cut short (a metric)."""

    def eviction_age(self, replica: ReplicaName) -> float | None:
        return self._eviction_age.get(replica)

    # ---- PrefixLookup --------------------------------------------------------------------------------------

    def longest_prefixes(self, keys: Sequence[BlockKey], now: float) -> Mapping[ReplicaName, PrefixMatch]:
        found = self.inner.longest_prefixes(keys, now)
        if not self._eviction_age:
            return found
        result: dict[ReplicaName, PrefixMatch] = {}
        for replica, match in found.items():
            blocks = self._surviving(replica, keys, match.blocks, now)
            if blocks == match.blocks:
                result[replica] = match
            else:
                self.trimmed += 1
                if blocks > 0:
                    result[replica] = match.cut(blocks)
        return result

    def add_provisional(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        self.inner.add_provisional(replica, keys, now)
        self.on_stored(replica, keys, now)

    # ---- events --------------------------------------------------------------------------------------------

    def on_stored(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        touched = self._touched.get(replica)
        if touched is None:
            touched = self._touched[replica] = {}
        touched.update(dict.fromkeys(keys, now))
        excess = len(touched) - self.config.max_tracked
        if excess > 0:
            # Insertion order approximates touch order; drop a slack of 1/8 too, so this runs once per many stores.
            for key in list(itertools.islice(touched, excess + self.config.max_tracked // 8)):
                del touched[key]

    def on_removed(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        touched = self._touched.get(replica)
        if not touched:
            return
        ages = [now - touched.pop(key) for key in keys if key in touched]
        if not ages:
            return
        sample = sum(ages) / len(ages)
        old = self._eviction_age.get(replica)
        self._eviction_age[replica] = sample if old is None else old + self.config.age_alpha * (sample - old)

    def on_cleared(self, replica: ReplicaName, now: float) -> None:
        self.forget(replica)

    def forget(self, replica: ReplicaName) -> None:
        self._touched.pop(replica, None)
        self._eviction_age.pop(replica, None)

    def _surviving(self, replica: ReplicaName, keys: Sequence[BlockKey], blocks: int, now: float) -> int:
        lifetime = self._eviction_age.get(replica)
        touched = self._touched.get(replica)
        if lifetime is None or not touched or blocks <= 0:
            return blocks
        wait = 0.0
        if self.load is not None:
            wait = self.load.snapshot(replica).pending_prefill_tokens / self.config.prefill_tokens_per_s
        limit = now - (self.config.margin * lifetime - wait)
        # A block never seen touched (events from before this overlay started) counts as fresh.
        if touched.get(keys[blocks - 1], now) >= limit:
            return blocks
        low, high = 0, blocks - 1  # keys[:low] survive; keys[high] does not
        while low < high:
            middle = (low + high) // 2
            if touched.get(keys[middle], now) >= limit:
                low = middle + 1
            else:
                high = middle
        return low
