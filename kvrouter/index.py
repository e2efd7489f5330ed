"""The prefix index: which replica holds which block, and how much of a prompt each replica holds (pure, sync).

Layout. Every event source — a (replica, data-parallel rank) pair — gets a bit; so does each replica's
provisional slot. One dict per tier maps a `BlockKey` to the bitmask of sources holding it there (provisional
marks are bits in the GPU dict, so a lookup probes one dict however many marks are live), and each source
keeps its own engine-hash -> key dict so a `BlockRemoved` (which names only the engine's hash) maps back. The key
int is shared by both dicts, and masks of up to eight sources are CPython's cached small ints, so a tracked block
costs two dict slots and two 64-bit ints: ~140 bytes, less per replica when replicas share blocks (measured by
loadtest/bench_index.py; see docs/benchmarks.md).

Lookup. `longest_prefixes` probes the request's keys with C-level `map(dict.get)` in growing chunks (64 keys,
then 8x more) and stops at the first chunk where no source is left, so the Python-level work is per drop point
(where some source stops matching), not per block. While every source sits below bit 8 (up to 8 sources: four
replicas with their provisional slots) a chunk is probed straight into a `bytearray`, and each drop point is
found in C with `bytes.translate` (keep the bits of the sources still in) and `lstrip` (skip the run where they
all match). Up to 64 sources, the chunk's masks are AND-accumulated by numpy and visited only where the
accumulated set changes; beyond that, `itertools.accumulate` and a bisection do the same. A replica's prefix is
the longest over its sources (a request lands on one DP rank; a block in any tier of that rank counts,
`gpu_blocks` counts only GPU and provisional blocks).

Provisional entries (`add_provisional`) mark a routed request's keys on its replica for `provisional_ttl_s`, so
a burst of siblings follows the first before the engine's events arrive. The engine's `BlockStored` makes a
block real; the mark itself simply lapses at its TTL (dropping it early would cut a provisional prefix in two
while its tail is still being computed). Expiry is lazy, against the `now` callers pass.

Knobs: `provisional_ttl_s`; `max_blocks` (optional budget of tracked keys, provisional marks' keys included:
beyond it the least recently stored or matched key is evicted from every replica, a chain's tail before its
head — an evicted block is merely under-predicted).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvrouter.routing import PrefixMatch
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

_PROVISIONAL_RANK = -1
_ZEROS = itertools.repeat(0)
_NONES = itertools.repeat(None)
_NEVER = itertools.repeat(float("inf"))
_FIRST_CHUNK = 64
_TIERS = tuple(Tier)
_WORD = 1 << 64
_SHARED_MATCHES = 1 << 16


def _consume(iterator: Iterable[object]) -> None:
    deque(iterator, maxlen=0)


@dataclass(slots=True)
class _Source:
    """One stream of engine state: a replica's DP rank, or the replica's provisional marks (rank -1)."""

    replica: ReplicaName
    rank: int
    bit: int
    blocks: dict[EngineBlockHash, BlockKey] = field(default_factory=dict)
    provisional_until: dict[BlockKey, float] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, *, provisional_ttl_s: float = 5.0, max_blocks: int | None = None) -> None:
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        self.provisional_ttl_s = provisional_ttl_s
        self.max_blocks = max_blocks
        self._tiers: tuple[dict[BlockKey, int], ...] = tuple({} for _ in _TIERS)
        self._gpu = self._tiers[Tier.GPU]
        self._sources: dict[tuple[ReplicaName, int], _Source] = {}
        self._by_bit: dict[int, _Source] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._expiries: deque[tuple[float, _Source, tuple[BlockKey, ...]]] = deque()
        self._stale_mappings = 0
        self._evicted_since_compact = 0
        # PrefixMatch values are immutable: the common all-GPU ones are shared rather than built per lookup.
        self._matches: dict[int, PrefixMatch] = {}

    # ---- sources -------------------------------------------------------------------------------------------

    def _source(self, replica: ReplicaName, rank: int) -> _Source:
        source = self._sources.get((replica, rank))
        if source is None:
            if self._free_bits:
                bit_number = self._free_bits.pop()
            else:
                bit_number = self._next_bit
                self._next_bit += 1
            source = _Source(replica, rank, 1 << bit_number)
            self._sources[(replica, rank)] = source
            self._by_bit[source.bit] = source
        return source

    def _drop_source(self, source: _Source) -> None:
        del self._sources[(source.replica, source.rank)]
        del self._by_bit[source.bit]
        self._free_bits.append(source.bit.bit_length() - 1)

    # ---- events -------------------------------------------------------------------------------------------

    def store_keys(
        self,
        replica: ReplicaName,
        engine_hashes: Sequence[EngineBlockHash],
        keys: Sequence[BlockKey],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> None:
        """Record that `replica` (rank `dp_rank`) now holds `keys` in `tier`, under the engine's `engine_hashes`."""
        if len(engine_hashes) != len(keys):
            raise ValueError("engine_hashes and keys must have the same length")
        source = self._source(replica, dp_rank)
        bit = source.bit
        table = self._tiers[tier]
        budget = self.max_blocks
        if budget is None and table.keys().isdisjoint(keys):
            table.update(zip(keys, itertools.repeat(bit)))  # all new: one C-level update
        else:
            get = table.get
            # Deepest block first: under a budget, dict order is recency, and a chain must lose its tail before
            # its head (a head evicted first would strand every block after it).
            for key in reversed(keys) if budget is not None else keys:
                mask = get(key)
                if mask is None:
                    table[key] = bit
                else:
                    if budget is not None:
                        del table[key]  # re-insert at the end: dict order is the recency order
                    table[key] = mask | bit
        source.blocks.update(zip(engine_hashes, keys, strict=True))
        if budget is not None:
            self._enforce_budget(budget)

    def key_of(self, replica: ReplicaName, engine_hash: EngineBlockHash, *, dp_rank: int = 0) -> BlockKey | None:
        """kvrouter's key for a block the engine named `engine_hash`, if that block was stored and understood."""
        source = self._sources.get((replica, dp_rank))
        return None if source is None else source.blocks.get(engine_hash)

    def remove_blocks(
        self,
        replica: ReplicaName,
        engine_hashes: Iterable[EngineBlockHash],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> int:
        """Forget blocks the engine evicted from `tier`; returns how many hashes were unknown."""
        source = self._sources.get((replica, dp_rank))
        if source is None:
            return sum(1 for _ in engine_hashes)
        unknown = 0
        bit = source.bit
        clear = ~bit
        for engine_hash in engine_hashes:
            key = source.blocks.get(engine_hash)
            if key is None:
                unknown += 1
                continue
            table = self._tiers[tier]
            mask = table.get(key)
            if mask is not None and mask & bit:
                mask &= clear
                if mask:
                    table[key] = mask
                else:
                    del table[key]
            if not any(t.get(key, 0) & bit for t in self._tiers):
                del source.blocks[engine_hash]
        return unknown

    def clear(self, replica: ReplicaName, *, dp_rank: int | None = None) -> None:
        """Drop the replica's blocks (one DP rank, or all ranks and its provisional marks)."""
        for source in [s for s in self._sources.values() if s.replica == replica]:
            if dp_rank is not None and source.rank != dp_rank:
                continue
            self._clear_source(source)

    def remove_replica(self, replica: ReplicaName) -> None:
        self.clear(replica)

    def _clear_source(self, source: _Source) -> None:
        bit = source.bit
        clear = ~bit
        if source.rank == _PROVISIONAL_RANK:
            tables: Iterable[dict[BlockKey, int]] = (self._gpu,)
            keys: Iterable[BlockKey] = source.provisional_until
        else:
            tables = self._tiers
            keys = set(source.blocks.values())
        for table in tables:
            for key in keys:
                mask = table.get(key)
                if mask is not None and mask & bit:
                    mask &= clear
                    if mask:
                        table[key] = mask
                    else:
                        del table[key]
        self._drop_source(source)

    # ---- provisional entries ------------------------------------------------------------------------------

    def add_provisional(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        if not keys or self.provisional_ttl_s <= 0:
            return
        self._expire(now)
        source = self._source(replica, _PROVISIONAL_RANK)
        until = now + self.provisional_ttl_s
        table = self._gpu
        # This runs for every routed request, so it stays in C: no Python-level step per key.
        bits = map(operator.or_, map(table.get, keys, _ZEROS), itertools.repeat(source.bit))
        table.update(zip(keys, bits, strict=True))
        source.provisional_until.update(zip(keys, itertools.repeat(until)))
        self._expiries.append((until, source, tuple(keys)))
        if self.max_blocks is not None:
            self._touch(keys)  # most recent now, the chain's tail before its head
            self._enforce_budget(self.max_blocks)

    def _expire(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, source, keys = expiries.popleft()
            if self._sources.get((source.replica, source.rank)) is not source:
                continue  # the replica was cleared meanwhile
            marks = source.provisional_until
            # Keys marked again since are not due yet; the rest lose the mark and the replica's bit.
            due = list(itertools.compress(keys, map(now.__ge__, map(marks.get, keys, _NEVER))))
            _consume(map(marks.pop, due, _NONES))
            table = self._gpu
            masks = list(map(operator.and_, map(table.get, due, _ZEROS), itertools.repeat(~source.bit)))
            table.update(itertools.compress(zip(due, masks, strict=True), masks))
            _consume(map(table.pop, itertools.compress(due, map(operator.not_, masks)), _NONES))

    # ---- budget -------------------------------------------------------------------------------------------

    def _enforce_budget(self, budget: int) -> None:
        tracked = sum(len(t) for t in self._tiers)
        while tracked > budget:
            table = next(t for t in self._tiers if t)
            del table[next(iter(table))]
            tracked -= 1
            self._stale_mappings += 1
            self._evicted_since_compact += 1
        if self._evicted_since_compact > budget // 64 + 64:
            # `next(iter(table))` walks past every slot freed at the front since the dict last compacted itself,
            # so under a flood each eviction cost O(evictions so far); re-inserting compacts it (same order).
            for table in self._tiers:
                kept = dict(table)
                table.clear()
                table.update(kept)
            self._evicted_since_compact = 0
        if self._stale_mappings > budget // 4 + 64:
            self._drop_stale_mappings()

    def _drop_stale_mappings(self) -> None:
        """Evicted keys leave engine-hash mappings behind; sweep them once enough have piled up."""
        tiers = self._tiers
        for source in self._sources.values():
            bit = source.bit
            source.blocks = {
                h: k for h, k in source.blocks.items() if any(t.get(k, 0) & bit for t in tiers)
            }
        self._stale_mappings = 0

    def _touch(self, keys: Sequence[BlockKey]) -> None:
        for table in self._tiers:
            if not table:
                continue
            for key in reversed(keys):
                mask = table.pop(key, None)
                if mask is not None:
                    table[key] = mask

    # ---- lookup -------------------------------------------------------------------------------------------

    def longest_prefixes(self, keys: Sequence[BlockKey], now: float) -> Mapping[ReplicaName, PrefixMatch]:
        """For every replica holding at least the first key: its longest run of leading keys (all tiers, GPU)."""
        if not keys:
            return {}
        self._expire(now)
        lower = [t for t in self._tiers[1:] if t]
        gpu_tables = [self._gpu]
        gpu_lengths = self._prefix_lengths(keys, gpu_tables)
        any_lengths = self._prefix_lengths(keys, gpu_tables + lower) if lower else gpu_lengths
        result: dict[ReplicaName, PrefixMatch] = {}
        by_bit = self._by_bit
        matches = self._matches
        for bit, blocks in any_lengths.items():
            replica = by_bit[bit].replica
            gpu_blocks = gpu_lengths.get(bit, 0)
            best = result.get(replica)
            if best is not None:
                blocks, gpu_blocks = max(blocks, best.blocks), max(gpu_blocks, best.gpu_blocks)
            match = matches.get(blocks) if blocks == gpu_blocks else None
            if match is None:
                match = PrefixMatch(blocks, gpu_blocks)
                if blocks == gpu_blocks and len(matches) < _SHARED_MATCHES:
                    matches[blocks] = match
            result[replica] = match
        if self.max_blocks is not None and result:
            self._touch(keys[: max(m.blocks for m in result.values())])
        return result

    @staticmethod
    def _prefix_lengths(keys: Sequence[BlockKey], tables: Sequence[dict[BlockKey, int]]) -> dict[int, int]:
        """Source bit -> number of leading `keys` whose mask (OR over `tables`) has that bit."""
        alive = -1
        lengths: dict[int, int] = {}
        start = 0
        size = _FIRST_CHUNK
        total = len(keys)
        first, rest = tables[0], tables[1:]
        while start < total:
            chunk = keys[start : start + size]
            raw: bytes | bytearray | None = None
            if not any(not table.keys().isdisjoint(chunk) for table in rest):
                try:
                    # Probed straight into bytes, in C; a source past bit 7 makes it raise.
                    raw = bytearray(map(first.get, chunk, _ZEROS))
                except ValueError:
                    raw = None
            if raw is None:
                masks = _chunk_masks(chunk, tables)
                if alive >= 256 or max(masks) >= 256:
                    return _prefix_lengths_wide(
                        keys, tables, lengths, start, size, masks, alive if alive >= 0 else masks[0]
                    )
                raw = bytes(masks)
            if alive < 0:
                alive = raw[0]
            alive = _drop_points(raw, alive, start, lengths)
            if not alive:
                return lengths
            start += size
            size *= 8
        _finish(alive, total, lengths)
        return lengths

    # ---- introspection ------------------------------------------------------------------------------------

    def blocks_of(self, replica: ReplicaName) -> int:
        """Blocks tracked for `replica` from its events (all DP ranks, provisional marks excluded)."""
        return sum(
            len(s.blocks) for s in self._sources.values() if s.replica == replica and s.rank != _PROVISIONAL_RANK
        )

    def block_counts(self) -> dict[ReplicaName, int]:
        counts: dict[ReplicaName, int] = {}
        for source in self._sources.values():
            if source.rank != _PROVISIONAL_RANK:
                counts[source.replica] = counts.get(source.replica, 0) + len(source.blocks)
        return counts

    def held_counts(self) -> dict[ReplicaName, int]:
        """Blocks each replica's event sources hold now: unlike `block_counts`, keys evicted under the budget whose
        engine-hash mappings await the sweep are not counted. Without a budget nothing is evicted, so the per-source
        counts are exact and cost nothing; with one, one pass over the (budget-bounded) key tables."""
        if self.max_blocks is None:
            return self.block_counts()
        masks: Iterable[int] = self._gpu.values()
        if any(self._tiers[1:]):
            merged = dict(self._gpu)  # a block in two tiers of a rank is one block
            for table in self._tiers[1:]:
                merged.update((key, merged.get(key, 0) | mask) for key, mask in table.items())
            masks = merged.values()
        counts: dict[ReplicaName, int] = {}
        events = [s for s in self._sources.values() if s.rank != _PROVISIONAL_RANK]
        for mask, held in Counter(masks).items():
            for source in events:
                if mask & source.bit:
                    counts[source.replica] = counts.get(source.replica, 0) + held
        return counts

    def replicas(self) -> set[ReplicaName]:
        return {s.replica for s in self._sources.values()}

    def __len__(self) -> int:
        """Distinct keys tracked (any tier, provisional marks excluded)."""
        marks = 0
        for source in self._sources.values():
            if source.rank == _PROVISIONAL_RANK:
                marks |= source.bit
        if not marks:
            if not any(self._tiers[1:]):
                return len(self._gpu)
            return len(set().union(*self._tiers))
        held = {key for key, mask in self._gpu.items() if mask & ~marks}
        return len(held.union(*self._tiers[1:]))


def _chunk_masks(chunk: Sequence[BlockKey], tables: Sequence[dict[BlockKey, int]]) -> list[int]:
    masks = list(map(tables[0].get, chunk, _ZEROS))
    for table in tables[1:]:
        # Provisional marks and lower tiers are small or absent for most keys: skip the OR when none of the
        # chunk is there (one cheap probe per key instead of a probe, an OR and a new list).
        if not table.keys().isdisjoint(chunk):
            masks = list(map(operator.or_, masks, map(table.get, chunk, _ZEROS)))
    return masks


def _and_table(alive: int) -> bytes:
    """A `bytes.translate` table keeping only `alive`'s bits of a byte."""
    return bytes(value & alive for value in range(256))


_AND_TABLES = tuple(_and_table(alive) for alive in range(256))
_BYTES = tuple(bytes((value,)) for value in range(256))


def _drop_points(raw: bytes | bytearray, alive: int, start: int, lengths: dict[int, int]) -> int:
    """Record where each of `alive`'s sources (all below bit 8) drops out of the chunk `raw` (masks as bytes,
    the chunk's first key at `start`); returns the sources still in at its end.

    The masks restricted to the sources still in (`translate`) must equal the set itself up to the next drop
    point, so `lstrip` finds it in C: the Python-level work is per drop point, not per block.
    """
    position = 0
    while alive:
        view = raw[position:].translate(_AND_TABLES[alive])
        run = len(view) - len(view.lstrip(_BYTES[alive]))
        if run == len(view):
            break
        remaining = view[run]
        _finish(alive & ~remaining, start + position + run, lengths)
        alive = remaining
        position += run
    return alive


def _finish(bits: int, length: int, lengths: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        lengths[low] = length
        bits ^= low


def _drop_points_word(masks: list[int], alive: int, start: int, lengths: dict[int, int]) -> int:
    """`_drop_points` for sources up to bit 63: the chunk's masks AND-accumulated in one numpy call, then
    visited only where the accumulated set changes (bits of sources not in `alive` are masked off)."""
    try:
        words = np.fromiter(masks, dtype=np.uint64, count=len(masks))
    except OverflowError:  # a source past bit 63 holds some block here, but none of them is alive: mask it
        words = np.fromiter([mask & alive for mask in masks], dtype=np.uint64, count=len(masks))
    accumulated = np.bitwise_and.accumulate(words)
    accumulated &= np.uint64(alive)
    changes = np.flatnonzero(accumulated[1:] != accumulated[:-1]) + 1
    if int(accumulated[0]) != alive:
        changes = np.concatenate(([0], changes))
    for position, remaining in zip(changes.tolist(), accumulated[changes].tolist(), strict=True):
        dropped = alive & ~remaining
        length = start + position
        while dropped:
            low = dropped & -dropped
            lengths[low] = length
            dropped ^= low
        alive = remaining
    return alive


def _prefix_lengths_wide(
    keys: Sequence[BlockKey],
    tables: Sequence[dict[BlockKey, int]],
    lengths: dict[int, int],
    start: int,
    size: int,
    masks: list[int],
    alive: int,
) -> dict[int, int]:
    """`_prefix_lengths` once some source sits past bit 7, from the chunk at `start` (its `masks` probed)."""
    total = len(keys)
    neg = operator.neg
    while True:
        if masks.count(alive) == len(masks):
            # The common case — every source still in holds the whole chunk, none comes back — costs one
            # C-level scan instead of an accumulate.
            pass
        elif alive < _WORD:
            alive = _drop_points_word(masks, alive, start, lengths)
        else:
            if start == 0:
                accumulated = list(itertools.accumulate(masks, operator.and_))
            else:
                accumulated = list(itertools.accumulate(masks, operator.and_, initial=alive))[1:]
            # `accumulated` only ever loses bits, so as numbers it never increases: bisect on its negation to
            # jump straight to each point where some source drops out.
            position = 0
            while alive:
                drop = bisect.bisect_right(accumulated, -alive, lo=position, key=neg)
                if drop == len(accumulated):
                    break
                remaining = accumulated[drop]
                _finish(alive & ~remaining, start + drop, lengths)
                alive = remaining
                position = drop
        if not alive:
            return lengths
        start += size
        size *= 8
        if start >= total:
            break
        masks = _chunk_masks(keys[start : start + size], tables)
    _finish(alive, total, lengths)
    return lengths


__all__ = ["PrefixIndex"]
