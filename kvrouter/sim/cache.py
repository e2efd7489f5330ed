"""A paged KV cache with vLLM v1's prefix-caching semantics, kept at block granularity (pure, no clock).

What it reproduces, and why each matters to a router judged against it:

* Only full blocks are cached, under chained hashes supplied by the caller (`sim.hashing`).
* Blocks are reference-counted; a block whose count drops to zero stays cached in the free queue and is only
  evicted when the allocator reaches it. The queue is vLLM's: blocks leave from the front, a finished request's
  blocks join in reverse order so its tail block is evicted first, and a block holding no hash (a partly filled
  tail) goes to the front because it caches nothing. Real vLLM 0.32 evicts in exactly this order
  (fixtures run s2_evict_reset_bs128_ipc).
* A hit on a free block takes it out of the queue (vLLM's `touch`).
* Identical blocks computed twice (two requests prefilling the same prefix at once) are both cached and
  announced, and each copy's eviction is announced, as vLLM does.
* `reset` refuses while any block is in use, like vLLM's `reset_prefix_cache`.

Only hashed blocks have identities here; unhashed blocks are interchangeable, so they are counted, not stored.
Evictions are appended to `events` as they happen; the engine appends its stores to the same list, keeping
vLLM's order within a scheduler pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvrouter.sim.model import CacheCleared, KvEvent, RemovedBlocks


class PrefixCache:
    """`num_blocks` usable blocks (vLLM's `num_gpu_blocks` minus its null block) of `block_size` tokens."""

    __slots__ = (
        "_by_hash",
        "_free_hashed",
        "_free_unhashed",
        "_hash_of",
        "_next_id",
        "_ref",
        "block_size",
        "events",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events: list[KvEvent] = []
        self._free_unhashed = num_blocks
        self._free_hashed: OrderedDict[int, None] = OrderedDict()
        """Free blocks still holding a hash, front = next to evict."""
        self._hash_of: dict[int, int] = {}
        self._ref: dict[int, int] = {}
        self._by_hash: dict[int, list[int]] = {}
        self._next_id = 0

    # -- queries -------------------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self._free_unhashed + len(self._free_hashed)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a hash, in use or free."""
        return len(self._hash_of)

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the fraction of blocks not free (cached-but-free blocks count as free)."""
        return 1.0 - self.free_blocks / self.num_blocks

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Ids of the cached blocks matching the leading `hashes` (at most `max_blocks`), stopping at a miss."""
        hits: list[int] = []
        by_hash = self._by_hash
        for index in range(min(max_blocks, len(hashes))):
            holders = by_hash.get(hashes[index])
            if holders is None:
                break
            hits.append(holders[0])
        return hits

    def evictable(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` sit in the free queue (taking them costs free blocks)."""
        ref = self._ref
        return sum(1 for block in block_ids if ref[block] == 0)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def hash_of(self, block_id: int) -> int:
        return self._hash_of[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def free_queue(self) -> list[int | None]:
        """The free queue front to back: None for an unhashed block, else the block's hash (for tests)."""
        unhashed: list[int | None] = [None] * self._free_unhashed
        return unhashed + [self._hash_of[block] for block in self._free_hashed]

    # -- changes -------------------------------------------------------------------------------------------

    def touch(self, block_ids: Iterable[int]) -> None:
        """A request now uses these cached blocks (prefix hit)."""
        ref = self._ref
        free = self._free_hashed
        for block in block_ids:
            if ref[block] == 0:
                del free[block]
            ref[block] += 1

    def allocate(self, count: int) -> None:
        """Take `count` blocks for new tokens, evicting cached ones from the queue front; caller checked room.

        The blocks evicted by one allocation are reported as one RemovedBlocks in eviction order (the publisher
        puts each on the wire as its own event, as vLLM does).
        """
        if count > self.free_blocks:
            raise ValueError(f"cannot allocate {count} blocks, {self.free_blocks} free")
        from_unhashed = min(count, self._free_unhashed)
        self._free_unhashed -= from_unhashed
        evict = count - from_unhashed
        if evict == 0:
            return
        popitem = self._free_hashed.popitem
        hash_of = self._hash_of
        ref = self._ref
        by_hash = self._by_hash
        evicted: list[int] = []
        for _ in range(evict):
            block = popitem(last=False)[0]
            block_hash = hash_of.pop(block)
            del ref[block]
            holders = by_hash[block_hash]
            if len(holders) == 1:
                del by_hash[block_hash]
            else:
                holders.remove(block)
            evicted.append(block_hash)
        self.events.append(RemovedBlocks(tuple(evicted)))

    def commit(self, block_hash: int) -> int:
        """An allocated block of the caller just became full: cache it under `block_hash` (ref 1); its id."""
        block = self._next_id
        self._next_id += 1
        self._hash_of[block] = block_hash
        self._ref[block] = 1
        holders = self._by_hash.get(block_hash)
        if holders is None:
            self._by_hash[block_hash] = [block]
        else:
            holders.append(block)
        return block

    def commit_many(self, block_hashes: Sequence[int]) -> list[int]:
        """`commit` for several blocks that just became full, in order; their ids."""
        first = self._next_id
        self._next_id = first + len(block_hashes)
        ids = list(range(first, self._next_id))
        hash_of = self._hash_of
        ref = self._ref
        by_hash = self._by_hash
        for block, block_hash in zip(ids, block_hashes, strict=True):
            hash_of[block] = block_hash
            ref[block] = 1
            holders = by_hash.get(block_hash)
            if holders is None:
                by_hash[block_hash] = [block]
            else:
                holders.append(block)
        return ids

    def free(self, hashed_blocks: Sequence[int], unhashed: int) -> None:
        """Release a request's block table: its hashed blocks in table order, then `unhashed` tail blocks.

        The table is released in reverse, so the tail evicts first; unhashed blocks go to the queue front.
        """
        self._free_unhashed += unhashed
        ref = self._ref
        free = self._free_hashed
        for block in reversed(hashed_blocks):
            count = ref[block] - 1
            ref[block] = count
            if count == 0:
                free[block] = None

    def reset(self) -> bool:
        """Forget every cached block; False (and nothing changes) while any block is in use."""
        if self.free_blocks != self.num_blocks:
            return False
        self._free_unhashed = self.num_blocks
        self._free_hashed.clear()
        self._hash_of.clear()
        self._ref.clear()
        self._by_hash.clear()
        self.events.append(CacheCleared())
        return True
