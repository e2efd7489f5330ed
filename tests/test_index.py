"""Prefix index and event ingest, example by example, with tiny event helpers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvrouter.blocks import chain_keys
from kvrouter.blocktable import Backend, native_backend, pure_backend
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent
from kvrouter.index import PrefixIndex
from kvrouter.routing.router import PrefixMatch
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

A, B = ReplicaName("a"), ReplicaName("b")
BS = 4


@pytest.fixture(params=[native_backend, pure_backend], ids=["native", "pure"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Every index example runs on the compiled tables and on their pure-Python twin."""
    factory: Callable[[], Backend] = request.param
    return factory()


def keys(n: int, start: int = 0) -> list[BlockKey]:
    return [BlockKey(0x1000 + i) for i in range(start, start + n)]


def hashes(n: int, start: int = 0) -> list[EngineBlockHash]:
    return [EngineBlockHash(0x9000 + i) for i in range(start, start + n)]


def stored(first_hash: int, tokens: list[int], parent: int | None = None, **extra: object) -> BlockStored:
    blocks = len(tokens) // BS
    return BlockStored(
        [EngineBlockHash(first_hash + i) for i in range(blocks)],
        None if parent is None else EngineBlockHash(parent),
        tokens,
        BS,
        **extra,  # type: ignore[arg-type]
    )


def batch(replica: str, *events: KvEvent, rank: int = 0) -> EventBatch:
    return EventBatch(replica, rank, 0, 0.0, list(events))


# ---- index --------------------------------------------------------------------------------------------------


def test_longest_prefix_per_replica_stops_where_nobody_matches(backend: Backend) -> None:
    index = PrefixIndex(backend=backend)
    index.store_keys(A, hashes(100), keys(100))
    index.store_keys(B, hashes(3), keys(3))
    query = keys(100) + keys(400, start=1000)
    assert index.longest_prefixes(query, 0.0) == {A: PrefixMatch(100, 100), B: PrefixMatch(3, 3)}
    assert index.longest_prefixes(keys(5, start=500), 0.0) == {}
    assert index.longest_prefixes([], 0.0) == {}


def test_a_hole_ends_the_prefix_even_if_later_blocks_are_held(backend: Backend) -> None:
    index = PrefixIndex(backend=backend)
    index.store_keys(A, hashes(10), keys(10))
    index.remove_blocks(A, [hashes(10)[4]])
    assert index.longest_prefixes(keys(10), 0.0) == {A: PrefixMatch(4, 4)}
    assert index.blocks_of(A) == 9


def test_lower_tiers_count_as_cached_but_not_as_gpu(backend: Backend) -> None:
    index = PrefixIndex(backend=backend)
    index.store_keys(A, hashes(4), keys(4), Tier.GPU)
    index.store_keys(A, hashes(8), keys(8), Tier.CPU)
    assert index.longest_prefixes(keys(8), 0.0) == {A: PrefixMatch(8, 4)}
    index.remove_blocks(A, hashes(4), Tier.GPU)  # the CPU copies remain
    assert index.longest_prefixes(keys(8), 0.0) == {A: PrefixMatch(8, 0)}
    assert index.blocks_of(A) == 8
    index.remove_blocks(A, hashes(8), Tier.CPU)
    assert index.longest_prefixes(keys(8), 0.0) == {} and index.blocks_of(A) == 0


def test_data_parallel_ranks_are_separate_caches_of_one_replica(backend: Backend) -> None:
    index = PrefixIndex(backend=backend)
    index.store_keys(A, hashes(6), keys(6), dp_rank=0)
    index.store_keys(A, hashes(2), keys(2), dp_rank=1)
    assert index.longest_prefixes(keys(6), 0.0) == {A: PrefixMatch(6, 6)}
    index.remove_blocks(A, hashes(6), dp_rank=0)
    assert index.longest_prefixes(keys(6), 0.0) == {A: PrefixMatch(2, 2)}  # rank 1 still holds its copy
    index.clear(A, dp_rank=1)
    assert index.longest_prefixes(keys(6), 0.0) == {}


def test_provisional_marks_expire_and_real_events_replace_them(backend: Backend) -> None:
    index = PrefixIndex(provisional_ttl_s=5.0, backend=backend)
    index.add_provisional(B, keys(8), now=100.0)
    assert index.longest_prefixes(keys(8), 104.9) == {B: PrefixMatch(8, 8)}
    assert index.longest_prefixes(keys(8), 105.0) == {}
    index.add_provisional(B, keys(8), now=200.0)
    index.store_keys(B, hashes(3), keys(3))  # the engine confirms the first three: they outlive the TTL
    assert index.longest_prefixes(keys(8), 201.0) == {B: PrefixMatch(8, 8)}
    assert index.longest_prefixes(keys(8), 300.0) == {B: PrefixMatch(3, 3)}
    assert index.blocks_of(B) == 3


def test_remove_replica_forgets_everything_and_frees_its_bits(backend: Backend) -> None:
    index = PrefixIndex(backend=backend)
    for n in range(70):  # more sources than a machine word
        index.store_keys(ReplicaName(f"r{n}"), hashes(2), keys(2))
    index.add_provisional(A, keys(4), 0.0)
    assert len(index.longest_prefixes(keys(4), 0.0)) == 71
    index.clear(A)
    index.clear(ReplicaName("r3"))
    result = index.longest_prefixes(keys(4), 0.0)
    assert A not in result and ReplicaName("r3") not in result and len(result) == 69
    index.store_keys(ReplicaName("new"), hashes(4), keys(4))
    assert index.longest_prefixes(keys(4), 0.0)[ReplicaName("new")] == PrefixMatch(4, 4)
    assert index.block_counts()[ReplicaName("r5")] == 2


def test_memory_budget_evicts_least_recently_used_keys(backend: Backend) -> None:
    index = PrefixIndex(max_blocks=10, backend=backend)
    index.store_keys(A, hashes(6), keys(6))
    index.store_keys(B, hashes(4, start=100), keys(4, start=100))
    index.longest_prefixes(keys(6), 0.0)  # touch A's prefix: B's keys are now the oldest
    index.store_keys(A, hashes(2, start=200), keys(2, start=200))
    assert len(index) == 10
    assert index.longest_prefixes(keys(6), 0.0) == {A: PrefixMatch(6, 6)}
    # B's chain was the least recent: it lost its tail, so its head still counts.
    assert index.longest_prefixes(keys(4, start=100), 0.0) == {B: PrefixMatch(2, 2)}
    assert index.longest_prefixes(keys(2, start=200), 0.0) == {A: PrefixMatch(2, 2)}


# ---- ingest -------------------------------------------------------------------------------------------------


def ingest_for(index: PrefixIndex, **kwargs: object) -> IndexIngest:
    return IndexIngest(index, block_sizes={A: BS, B: BS}, **kwargs)  # type: ignore[arg-type]


def test_stored_events_chain_from_the_parent_and_match_request_keys() -> None:
    index = PrefixIndex()
    ingest = ingest_for(index)
    tokens = list(range(20))
    ingest.apply(batch(A, stored(500, tokens[:8])))
    ingest.apply(batch(A, stored(600, tokens[8:20], parent=501)))
    request = chain_keys([*tokens, 77, 78], BS)
    assert index.longest_prefixes(request, 0.0) == {A: PrefixMatch(5, 5)}
    assert ingest.counts == {(A, "BlockStored", "ok"): 2}


def test_an_unknown_parent_is_counted_not_guessed() -> None:
    index = PrefixIndex()
    seen: list[tuple[str, str, str]] = []
    ingest = ingest_for(index, on_event=lambda *c: seen.append(c))
    ingest.apply(batch(A, stored(600, list(range(8)), parent=12345)))
    assert seen == [(A, "BlockStored", "unknown_parent")]
    assert index.blocks_of(A) == 0


def test_salt_and_adapter_isolate_like_the_engine() -> None:
    index = PrefixIndex()
    ingest = ingest_for(index)
    tokens = list(range(8))
    ingest.apply(batch(A, stored(1, tokens, extra_keys=[["tenant-a"], None])))
    ingest.apply(batch(B, stored(1, tokens, lora_name="sql", extra_keys=[["sql"], ["sql"]])))
    assert index.longest_prefixes(chain_keys(tokens, BS), 0.0) == {}
    assert index.longest_prefixes(chain_keys(tokens, BS, cache_salt="tenant-a"), 0.0) == {A: PrefixMatch(2, 2)}
    assert index.longest_prefixes(chain_keys(tokens, BS, lora="sql"), 0.0) == {B: PrefixMatch(2, 2)}


def test_unreproducible_extra_keys_wrong_sizes_and_other_groups_are_skipped_and_counted() -> None:
    index = PrefixIndex()
    ingest = ingest_for(index)
    tokens = list(range(8))
    ingest.apply(batch(A, stored(1, tokens, extra_keys=[None, [["mm-hash", 0]]])))
    ingest.apply(batch(A, BlockStored([EngineBlockHash(5)], None, list(range(16)), 16)))
    ingest.apply(batch(A, BlockStored([EngineBlockHash(5), EngineBlockHash(6)], None, list(range(4)), BS)))
    ingest.apply(batch(A, stored(9, tokens, group_idx=1, spec_kind="sliding_window")))
    ingest.apply(batch(A, BlockRemoved([EngineBlockHash(9)], group_idx=1)))
    assert ingest.counts == {
        (A, "BlockStored", "unsupported_extra_keys"): 1,
        (A, "BlockStored", "block_size_mismatch"): 1,
        (A, "BlockStored", "bad_event"): 1,
        (A, "BlockStored", "ignored_group"): 1,
        (A, "BlockRemoved", "ignored_group"): 1,
    }
    assert index.blocks_of(A) == 0


def test_removed_and_cleared_events() -> None:
    index = PrefixIndex()
    ingest = ingest_for(index)
    tokens = list(range(16))
    ingest.apply(batch(A, stored(1, tokens)))
    ingest.apply(batch(A, stored(1, tokens), rank=1))
    ingest.apply(batch(A, BlockRemoved([EngineBlockHash(3), EngineBlockHash(77)])))
    assert ingest.counts[(A, "BlockRemoved", "unknown_block")] == 1
    assert index.blocks_of(A) == 7
    ingest.apply(batch(A, AllBlocksCleared(), rank=1))
    assert index.longest_prefixes(chain_keys(tokens, BS), 0.0) == {A: PrefixMatch(2, 2)}
    ingest.apply(batch(A, AllBlocksCleared(restart=True)))
    assert index.blocks_of(A) == 0
    assert ingest.counts[(A, "AllBlocksCleared", "restart")] == 1
