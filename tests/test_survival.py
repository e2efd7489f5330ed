"""Survival-aware lookup: eviction age learnt from removals, matches cut where blocks will not outlive the wait."""

from __future__ import annotations

import pytest

from kvrouter.index import PrefixIndex
from kvrouter.routing.load import LoadBook
from kvrouter.routing.survival import SurvivalConfig, SurvivalLookup
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName

A, B = ReplicaName("a"), ReplicaName("b")
KEYS = [BlockKey(100 + n) for n in range(8)]


def store(index: PrefixIndex, lookup: SurvivalLookup, replica: ReplicaName, keys: list[BlockKey], now: float) -> None:
    index.store_keys(replica, [EngineBlockHash(k) for k in keys], keys)
    lookup.on_stored(replica, keys, now)


def test_without_evictions_every_block_counts() -> None:
    index = PrefixIndex()
    lookup = SurvivalLookup(index)
    store(index, lookup, A, KEYS, 0.0)
    assert lookup.longest_prefixes(KEYS, 1000.0)[A].blocks == 8
    assert lookup.eviction_age(A) is None


def test_old_tail_blocks_are_cut_at_the_learnt_eviction_age() -> None:
    index = PrefixIndex()
    lookup = SurvivalLookup(index, config=SurvivalConfig(age_alpha=1.0))
    victim = [BlockKey(1), BlockKey(2)]
    store(index, lookup, A, victim, 0.0)
    lookup.on_removed(A, victim, 10.0)  # blocks untouched for 10 s were evicted
    assert lookup.eviction_age(A) == pytest.approx(10.0)
    store(index, lookup, A, KEYS, 0.0)
    lookup.on_stored(A, KEYS[:5], 8.0)  # a shorter request touched the head again at t=8
    store(index, lookup, B, KEYS, 0.0)  # B has never evicted: no cut there
    found = lookup.longest_prefixes(KEYS, 12.0)
    assert found[A].blocks == 5 and found[B].blocks == 8
    assert lookup.trimmed == 1
    assert A not in lookup.longest_prefixes(KEYS, 30.0)  # all of it outlived the eviction age


def test_the_queue_ahead_shortens_what_survives() -> None:
    index = PrefixIndex()
    load = LoadBook()
    lookup = SurvivalLookup(index, load, SurvivalConfig(prefill_tokens_per_s=1000.0, age_alpha=1.0))
    store(index, lookup, A, [BlockKey(1)], 0.0)
    lookup.on_removed(A, [BlockKey(1)], 10.0)
    store(index, lookup, A, KEYS, 5.0)
    assert lookup.longest_prefixes(KEYS, 9.0)[A].blocks == 8  # age 4 < 10
    load.begin(A, 8000)  # 8 s of prefill queued there: 4 + 8 > 10
    assert A not in lookup.longest_prefixes(KEYS, 9.0)


def test_routing_touches_the_chosen_replica() -> None:
    index = PrefixIndex()
    lookup = SurvivalLookup(index, config=SurvivalConfig(age_alpha=1.0))
    store(index, lookup, A, [BlockKey(1)], 0.0)
    lookup.on_removed(A, [BlockKey(1)], 10.0)
    store(index, lookup, A, KEYS, 0.0)
    lookup.add_provisional(A, KEYS, 20.0)
    assert lookup.longest_prefixes(KEYS, 25.0)[A].blocks == 8
    lookup.forget(A)
    assert lookup.eviction_age(A) is None


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        SurvivalConfig(margin=0.0)


def test_touch_times_are_bounded_per_replica() -> None:
    """Provisional marks the engine never stores are never removed by events: the overlay forgets the oldest."""

    lookup = SurvivalLookup(PrefixIndex(), None, SurvivalConfig(max_tracked=800))
    replica = ReplicaName("r")
    for n in range(100):
        lookup.add_provisional(replica, [BlockKey(50 * n + k) for k in range(50)], float(n))
    assert len(lookup._touched[replica]) <= 800
    assert BlockKey(50 * 99 + 49) in lookup._touched[replica]  # the newest touches stay
