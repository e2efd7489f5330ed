"""The prefix index: which replica holds which block, and how much of a prompt each replica holds (pure, sync).

Layout. Every event source — a (replica, data-parallel rank) pair — gets a bit; so does each replica's
provisional slot. One block table per tier maps a `BlockKey` to the mask of sources holding it there
(provisional marks are bits in the GPU table, so a lookup probes one table however many marks are live), and
each source keeps an engine map, engine hash -> key, so a `BlockRemoved` (which names only the engine's hash)
maps back. The tables are `kvrouter/_blocktable.c`'s open-addressing arrays of 64-bit words: a tracked block
costs a key and a mask word in its tier table and a hash and a key in its source's engine map, ~43-60 bytes at
the tables' load (more words per mask past 64 sources); without the compiled extension the same index runs on
dicts (`kvrouter/blocktable_pure.py`, ~140 bytes per block). loadtest/bench_index.py measures both.

Lookup. `longest_prefixes` walks the request's keys once, in C, AND-ing each key's mask (OR over the tiers) into
the set of sources still matching and noting where each one drops out; it stops at the first key no source
holds. A replica's prefix is the longest over its sources (a request lands on one DP rank; a block in any tier
of that rank counts, `gpu_blocks` counts only GPU and provisional blocks, and while any block is in the storage tier
a second walk over GPU and CPU alone gives `host_blocks`, where the part loaded from storage starts).

Provisional entries (`add_provisional`) mark a routed request's keys on its replica for `provisional_ttl_s`, so
a burst of siblings follows the first before the engine's events arrive. The engine's `BlockStored` makes a
block real; the mark itself simply lapses at its TTL (dropping it early would cut a provisional prefix in two
while its tail is still being computed). Expiry is lazy, against the `now` callers pass. A replica's marks live
in a one-word block table (key -> when the mark ends, as an order-preserving integer), so renewing a request's
~250 marks and expiring them are one C call each (`expire_marks`), not a Python loop per key.

Hostile sequences. Every event sequence leaves the tables consistent (tests/test_index_adversarial.py holds
them against a reference model): a store that names an engine hash already mapped to another key takes the old
key's credit away first (counted in `hash_reuses`), so no bit outlives its source's removals and clears; a
negative DP rank is refused (the ingest's sources drop ranks outside the replica's DP size before they get
here); and a lookup that met a bit no source owns would skip it and count `orphaned_bits` rather than fail.

Knobs: `provisional_ttl_s`; `max_blocks` (optional budget of tracked keys, provisional marks' keys included:
beyond it the least recently stored or matched key is evicted from every replica, a chain's tail before its
head — an evicted block is merely under-predicted; the tables then keep a recency list, 8 bytes more per slot);
`backend` (the tables' implementation, `kvrouter.blocktable.load_backend()` by default).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvrouter.blocktable import Backend, BlockTable, load_backend
from kvrouter.routing.router import PrefixMatch
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

_PROVISIONAL_RANK = -1
_DOUBLE = struct.Struct("<d")
_UNSIGNED = struct.Struct("<Q")
_SIGN = 1 << 63
_ALL = (1 << 64) - 1
_TIERS = tuple(Tier)
_SHARED_MATCHES = 1 << 16


@dataclass(slots=True)
class _Source:
    """One stream of engine state: a replica's DP rank, or the replica's provisional marks (rank -1)."""

    replica: ReplicaName
    rank: int
    bit: int  # the source's bit number in the tier tables' masks
    blocks: BlockTable  # engine hash -> key; for the provisional slot, key -> `_order_code` of its mark's end


class PrefixIndex:
    def __init__(
        self, *, provisional_ttl_s: float = 5.0, max_blocks: int | None = None, backend: Backend | None = None
    ) -> None:
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        self.provisional_ttl_s = provisional_ttl_s
        self.max_blocks = max_blocks
        self.backend = backend or load_backend()
        ordered = max_blocks is not None
        self._tiers: tuple[BlockTable, ...] = tuple(self.backend.table(1, ordered) for _ in _TIERS)
        self._gpu = self._tiers[Tier.GPU]
        self._sources: dict[tuple[ReplicaName, int], _Source] = {}
        self._by_bit: dict[int, _Source] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._expiries: deque[tuple[float, _Source, tuple[BlockKey, ...]]] = deque()
        self._stale_mappings = 0
        self.hash_reuses = 0
        """Blocks whose engine hash was stored again under another key (the old key's bit was cleared)."""
        self.orphaned_bits = 0
        """Lookups that met a bit no source owns and ignored it (expected to stay 0)."""
        # PrefixMatch values are immutable: the common all-GPU ones are shared rather than built per lookup.
        self._matches: dict[int, PrefixMatch] = {}

    # ---- sources -------------------------------------------------------------------------------------------

    def _source(self, replica: ReplicaName, rank: int) -> _Source:
        source = self._sources.get((replica, rank))
        if source is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = self._next_bit
                self._next_bit += 1
                words = bit // 64 + 1
                if words > self._gpu.words:  # past 64 sources: every mask gets another word
                    for table in self._tiers:
                        table.widen(words)
            source = _Source(replica, rank, bit, self.backend.table(1, False))
            self._sources[(replica, rank)] = source
            self._by_bit[bit] = source
        return source

    def _drop_source(self, source: _Source) -> None:
        del self._sources[(source.replica, source.rank)]
        del self._by_bit[source.bit]
        self._free_bits.append(source.bit)

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
        if dp_rank < 0:
            raise ValueError("dp_rank must be >= 0 (the ingest rejects ranks outside the replica's DP size)")
        if len(set(engine_hashes)) != len(engine_hashes):
            engine_hashes, keys = _last_per_hash(engine_hashes, keys)
        source = self._source(replica, dp_rank)
        blocks = source.blocks
        previous = list(map(blocks.get, engine_hashes))
        if previous.count(None) != len(previous):
            self._displace(source, previous, keys)
        # Under a budget the table is ordered: the deepest block goes in first and the chain's head last, so the
        # head is the most recent and a chain loses its tail before its head.
        self._tiers[tier].or_bit(keys, source.bit)
        blocks.set_many(engine_hashes, keys)
        if self.max_blocks is not None:
            self._enforce_budget(self.max_blocks)

    def _displace(self, source: _Source, previous: Sequence[int | None], keys: Sequence[BlockKey]) -> None:
        """An engine hash stored again under another key: the block the engine named so before is gone (vLLM
        re-stores a hash only after evicting it, so a different block under it means the old one left, or a
        publisher that cannot be trusted). The old key loses this source's bit in every tier before the new keys
        are stored; otherwise no engine-map entry would name the old key any more, and its bit would outlive
        every removal and clear of the source (an orphaned bit, later credited to whoever reuses the bit)."""
        old = [o for o, k in zip(previous, keys, strict=True) if o is not None and o != k]
        if old:
            self.hash_reuses += len(old)
            for table in self._tiers:
                table.clear_bit(old, source.bit)

    def key_of(self, replica: ReplicaName, engine_hash: EngineBlockHash, *, dp_rank: int = 0) -> BlockKey | None:
        """kvrouter's key for a block the engine named `engine_hash`, if that block was stored and understood."""
        source = self._sources.get((replica, dp_rank)) if dp_rank >= 0 else None
        if source is None:
            return None
        key = source.blocks.get(engine_hash)
        return None if key is None else BlockKey(key)

    def remove_blocks(
        self,
        replica: ReplicaName,
        engine_hashes: Iterable[EngineBlockHash],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> int:
        """Forget blocks the engine evicted from `tier`; returns how many hashes were unknown."""
        source = self._sources.get((replica, dp_rank)) if dp_rank >= 0 else None
        if source is None:
            return sum(1 for _ in engine_hashes)
        return self.backend.remove_blocks(source.blocks, engine_hashes, self._tiers[tier], self._tiers, source.bit)

    def clear(self, replica: ReplicaName, *, dp_rank: int | None = None) -> None:
        """Drop the replica's blocks (one DP rank, or all ranks and its provisional marks)."""
        if dp_rank is not None and dp_rank < 0:
            return  # not an engine rank: the provisional slot is cleared only with the whole replica
        for source in [s for s in self._sources.values() if s.replica == replica]:
            if dp_rank is not None and source.rank != dp_rank:
                continue
            self._clear_source(source)

    def _clear_source(self, source: _Source) -> None:
        # The cost is the source's own blocks (its engine map, or its live marks), not the whole index.
        if source.rank == _PROVISIONAL_RANK:
            self._gpu.clear_bit([key for key, _ in source.blocks.items()], source.bit)
        else:
            self.backend.clear_source(source.blocks, self._tiers, source.bit)
        self._drop_source(source)

    # ---- provisional entries ------------------------------------------------------------------------------

    def add_provisional(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        if not keys or self.provisional_ttl_s <= 0:
            return
        self._expire(now)
        source = self._source(replica, _PROVISIONAL_RANK)
        until = now + self.provisional_ttl_s
        self._gpu.or_bit(keys, source.bit)  # ordered under a budget: most recent now, tail before head
        source.blocks.set_many(keys, [_order_code(until)] * len(keys))
        self._expiries.append((until, source, tuple(keys)))
        if self.max_blocks is not None:
            for table in self._tiers[1:]:
                if len(table):
                    table.touch(keys)
            self._enforce_budget(self.max_blocks)

    def _expire(self, now: float) -> None:
        expiries = self._expiries
        if not expiries or expiries[0][0] > now:
            return
        code = _order_code(now)
        while expiries and expiries[0][0] <= now:
            _, source, keys = expiries.popleft()
            if self._sources.get((source.replica, source.rank)) is not source:
                continue  # the replica was cleared meanwhile
            # Keys marked again since are not due yet; the rest lose the mark and the replica's bit (in C: the
            # per-key work of a request's ~250 keys is no Python loop).
            self.backend.expire_marks(source.blocks, keys, code, self._gpu, source.bit)

    # ---- budget -------------------------------------------------------------------------------------------

    def _enforce_budget(self, budget: int) -> None:
        excess = sum(map(len, self._tiers)) - budget
        for table in self._tiers:
            if excess <= 0:
                break
            evicted = table.evict_oldest(excess)
            excess -= evicted
            self._stale_mappings += evicted
        if self._stale_mappings > budget // 4 + 64:
            # Evicted keys leave engine-hash mappings behind; sweep them once enough have piled up.
            for source in self._sources.values():
                if source.rank != _PROVISIONAL_RANK and len(source.blocks):
                    source.blocks.retain_held(self._tiers, source.bit)
            self._stale_mappings = 0

    # ---- lookup -------------------------------------------------------------------------------------------

    def longest_prefixes(self, keys: Sequence[BlockKey], now: float) -> Mapping[ReplicaName, PrefixMatch]:
        """For every replica holding at least the first key: its longest run of leading keys (all tiers, GPU)."""
        if not keys:
            return {}
        self._expire(now)
        cpu, storage = self._tiers[Tier.CPU], self._tiers[Tier.STORAGE]
        lower = tuple(t for t in (cpu, storage) if len(t))
        any_lengths, gpu_lengths = self.backend.prefix_lengths(keys, self._gpu, lower)
        host_lengths: dict[int, int] | None = None  # None: no block is only in storage, host = any tier
        if len(storage):
            # Where storage starts matters (it loads slower than CPU): one more walk, over GPU and CPU only.
            host_lengths = self.backend.prefix_lengths(keys, self._gpu, (cpu,))[0] if len(cpu) else gpu_lengths
        result: dict[ReplicaName, PrefixMatch] = {}
        by_bit = self._by_bit
        matches = self._matches
        for bit, blocks in any_lengths.items():
            source = by_bit.get(bit)
            if source is None:
                # A bit no source owns (cannot happen by construction; a lookup must still never fail on it).
                self.orphaned_bits += 1
                continue
            replica = source.replica
            gpu_blocks = gpu_lengths.get(bit, 0)
            host_blocks = None if host_lengths is None else host_lengths.get(bit, 0)
            best = result.get(replica)
            if best is not None:
                blocks, gpu_blocks = max(blocks, best.blocks), max(gpu_blocks, best.gpu_blocks)
                if host_blocks is not None:
                    host_blocks = max(host_blocks, best.blocks if best.host_blocks is None else best.host_blocks)
            if host_blocks is not None and host_blocks >= blocks:
                host_blocks = None
            match = matches.get(blocks) if blocks == gpu_blocks else None
            if match is None:
                match = PrefixMatch(blocks, gpu_blocks, host_blocks)
                if blocks == gpu_blocks and len(matches) < _SHARED_MATCHES:
                    matches[blocks] = match
            result[replica] = match
        if self.max_blocks is not None and result:
            matched = keys[: max(m.blocks for m in result.values())]
            for table in self._tiers:
                if len(table):
                    table.touch(matched)
        return result

    # ---- introspection ------------------------------------------------------------------------------------

    def blocks_of(self, replica: ReplicaName) -> int:
        """Blocks tracked for `replica` from its events (all DP ranks, provisional marks excluded)."""
        return sum(
            len(s.blocks) for s in self._sources.values() if s.replica == replica and s.rank != _PROVISIONAL_RANK
        )

    def provisional_marks(self, replica: ReplicaName) -> int:
        """Keys marked provisional on `replica` by routed requests, not yet expired (a recent-traffic signal)."""
        source = self._sources.get((replica, _PROVISIONAL_RANK))
        return 0 if source is None else len(source.blocks)

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
        per_bit, _ = self.backend.held_counts(self._tiers, ())
        counts: dict[ReplicaName, int] = {}
        for source in self._sources.values():
            if source.rank != _PROVISIONAL_RANK:
                counts[source.replica] = counts.get(source.replica, 0) + per_bit.get(source.bit, 0)
        return counts

    def replicas(self) -> set[ReplicaName]:
        return {s.replica for s in self._sources.values()}

    def table_bytes(self) -> int:
        """Bytes the index's tables hold (tier tables, engine maps and the provisional marks' tables)."""
        return sum(t.nbytes for t in self._tiers) + sum(s.blocks.nbytes for s in self._sources.values())

    def __len__(self) -> int:
        """Distinct keys tracked (any tier, provisional marks excluded)."""
        marks = [s.bit for s in self._sources.values() if s.rank == _PROVISIONAL_RANK]
        if not marks and not any(map(len, self._tiers[1:])):
            return len(self._gpu)
        return self.backend.held_counts(self._tiers, marks)[1]


def _order_code(time: float) -> int:
    """`time` as a 64-bit unsigned int ordered like the float (IEEE-754 bits, sign folded), so a mark's end can
    live in a block table and be compared there."""
    bits: int = _UNSIGNED.unpack(_DOUBLE.pack(time + 0.0))[0]  # + 0.0: -0.0 becomes 0.0, equal as floats
    return bits ^ _ALL if bits & _SIGN else bits | _SIGN


def _last_per_hash(
    engine_hashes: Sequence[EngineBlockHash], keys: Sequence[BlockKey]
) -> tuple[list[EngineBlockHash], list[BlockKey]]:
    """One store naming a hash twice: the later block is the one under it (as if stored one after the other)."""
    last = dict(zip(engine_hashes, keys, strict=True))
    return list(last), list(last.values())


__all__ = ["PrefixIndex"]
