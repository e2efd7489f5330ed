"""The prefix index under hostile event sequences: hash reuse, unknown removals, clears in mid-chain, bad ranks.

A reproduction of the orphaned-bit finding through the real ingest, the relay's state with the same semantics,
and a state machine that drives the index on the compiled and the pure tables (with and without a budget) with
adversarial sequences against a plain dict-of-sets reference model, comparing every replica's prefix lengths
after every step.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvrouter.blocks import chain_keys
from kvrouter.blocktable import pure_backend
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import AllBlocksCleared, BlockStored, EventBatch
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.state import ReplicaState
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

BLOCK = 4
A, B = ReplicaName("a"), ReplicaName("b")


def batch(replica: ReplicaName, *events: object, rank: int = 0) -> EventBatch:
    return EventBatch(replica, rank, 0, 0.0, list(events))  # type: ignore[arg-type]


def test_a_reused_engine_hash_leaves_no_orphaned_bit() -> None:
    """Finding: a BlockStored reusing an engine hash with other tokens left the old key's bit set; after the
    replica's clear the prompt's lookups raised KeyError (HTTP 500), and once the bit was reused the credit went
    to a replica that never held the prefix."""
    for backend in (None, pure_backend()):
        index = PrefixIndex(backend=backend)
        ingest = IndexIngest(index, block_sizes={A: BLOCK, B: BLOCK})
        prompt, other = [1, 2, 3, 4], [5, 6, 7, 8]
        ingest.apply(batch(A, BlockStored([EngineBlockHash(77)], None, prompt, BLOCK)))
        ingest.apply(batch(A, BlockStored([EngineBlockHash(77)], None, other, BLOCK)))
        keys = chain_keys(prompt, BLOCK, seed=0)
        assert index.longest_prefixes(keys, 0.0) == {}  # the old block under hash 77 is gone
        assert index.hash_reuses == 1
        ingest.apply(batch(A, AllBlocksCleared()))
        assert index.longest_prefixes(keys, 0.0) == {}  # no KeyError
        ingest.apply(batch(B, BlockStored([EngineBlockHash(5)], None, [9, 9, 9, 9], BLOCK)))  # reuses the bit
        assert index.longest_prefixes(keys, 0.0) == {}  # no credit moved to b
        assert index.orphaned_bits == 0
        assert ingest.counts[(A, "BlockStored", "ok")] == 2


def test_a_negative_rank_never_reaches_the_provisional_slot() -> None:
    index = PrefixIndex()
    keys = chain_keys([1, 2, 3, 4], BLOCK, seed=0)
    index.add_provisional(A, keys, 0.0)
    assert index.remove_blocks(A, [EngineBlockHash(1)], dp_rank=-1) == 1
    assert index.key_of(A, EngineBlockHash(1), dp_rank=-1) is None
    index.clear(A, dp_rank=-1)
    assert index.longest_prefixes(keys, 0.0)[A].blocks == 1  # the mark survived
    try:
        index.store_keys(A, [EngineBlockHash(1)], keys, dp_rank=-1)
    except ValueError:
        pass
    else:
        raise AssertionError("a negative rank must be refused")


def test_relay_state_forgets_a_reused_hash_in_every_tier() -> None:
    state = ReplicaState(A)
    h = EngineBlockHash(7)
    state.store_keys(A, [h], [BlockKey(100)], Tier.GPU)
    state.store_keys(A, [h], [BlockKey(100)], Tier.CPU)  # the same block offloaded: kept in both
    assert len(state) == 2
    state.store_keys(A, [h], [BlockKey(200)], Tier.CPU)  # another block under the hash: the old one is gone
    assert state.blocks() == {(0, int(Tier.CPU)): {h: 200}}
    assert state.key_of(A, h) == 200
    replayed = ReplicaState(A)
    replayed.load(state.take_pending())
    assert replayed.blocks() == state.blocks()


# ---- the state machine --------------------------------------------------------------------------------------

HASHES = st.integers(0, 11).map(EngineBlockHash)
KEYS = st.integers(0, 9).map(lambda k: BlockKey(k * 0x9E3779B97F4A7C15 % 2**64))
REPLICAS = [A, B]
TTL = 5.0


class Reference:
    """Plain dicts of sets, with the documented semantics: per (replica, rank), engine hash -> key and, per tier,
    the keys held; a store names each hash once (the last wins), a hash stored under another key first takes the
    old key's credit away in every tier; a removal drops the key from its tier and forgets the hash once no tier
    holds the key; a clear drops the source."""

    def __init__(self) -> None:
        self.maps: dict[tuple[ReplicaName, int], dict[int, int]] = {}
        self.held: dict[tuple[ReplicaName, int], dict[Tier, set[int]]] = {}
        self.marks: dict[ReplicaName, dict[int, float]] = {}

    def store(self, source: tuple[ReplicaName, int], hashes: list[int], keys: list[int], tier: Tier) -> None:
        last = dict(zip(hashes, keys, strict=True))
        emap = self.maps.setdefault(source, {})
        tiers = self.held.setdefault(source, {})
        for h, k in last.items():
            old = emap.get(h)
            if old is not None and old != k:
                for held in tiers.values():
                    held.discard(old)
        for h, k in last.items():
            emap[h] = k
            tiers.setdefault(tier, set()).add(k)

    def remove(self, source: tuple[ReplicaName, int], hashes: list[int], tier: Tier) -> int:
        emap = self.maps.get(source, {})
        tiers = self.held.get(source, {})
        unknown = 0
        for h in hashes:
            k = emap.get(h)
            if k is None:
                unknown += 1
                continue
            tiers.get(tier, set()).discard(k)
            if not any(k in held for held in tiers.values()):
                del emap[h]
        return unknown

    def lengths(self, keys: list[int], now: float) -> dict[ReplicaName, tuple[int, int]]:
        def leading(held: set[int]) -> int:
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            return n

        result: dict[ReplicaName, tuple[int, int]] = {}

        def merge(replica: ReplicaName, blocks: int, gpu: int) -> None:
            if blocks:
                old = result.get(replica, (0, 0))
                result[replica] = (max(old[0], blocks), max(old[1], gpu))

        for (replica, _rank), tiers in self.held.items():
            merge(replica, leading(set().union(*tiers.values())), leading(tiers.get(Tier.GPU, set())))
        for replica, marks in self.marks.items():
            live = leading({k for k, until in marks.items() if until > now})
            merge(replica, live, live)
        return result


class HostileSequences(RuleBasedStateMachine):
    """Hash reuse, removals of unknown blocks and of a chain's middle, clears in mid-chain, re-stores after clears,
    provisional marks in between: the index must answer exactly what the reference model answers."""

    budget: int | None = None
    pure = False

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(
            provisional_ttl_s=TTL, max_blocks=self.budget, backend=pure_backend() if self.pure else None
        )
        self.ref = Reference()
        self.now = 0.0

    @rule(
        replica=st.sampled_from(REPLICAS),
        rank=st.integers(0, 2),
        tier=st.sampled_from(list(Tier)),
        pairs=st.lists(st.tuples(HASHES, KEYS), max_size=6),
    )
    def store(self, replica: ReplicaName, rank: int, tier: Tier, pairs: list[tuple[int, int]]) -> None:
        hashes = [EngineBlockHash(h) for h, _ in pairs]
        keys = [BlockKey(k) for _, k in pairs]
        self.index.store_keys(replica, hashes, keys, tier, dp_rank=rank)
        self.ref.store((replica, rank), hashes, keys, tier)

    @rule(
        replica=st.sampled_from(REPLICAS),
        rank=st.integers(0, 2),
        tier=st.sampled_from(list(Tier)),
        hashes=st.lists(HASHES, max_size=5),
    )
    def remove(self, replica: ReplicaName, rank: int, tier: Tier, hashes: list[int]) -> None:
        engine = [EngineBlockHash(h) for h in hashes]
        unknown = self.index.remove_blocks(replica, engine, tier, dp_rank=rank)
        expected = self.ref.remove((replica, rank), hashes, tier)
        if self.budget is None:
            assert unknown == expected

    @rule(replica=st.sampled_from(REPLICAS), rank=st.one_of(st.none(), st.integers(-1, 3)))
    def clear(self, replica: ReplicaName, rank: int | None) -> None:
        self.index.clear(replica, dp_rank=rank)
        if rank is not None and rank < 0:
            return  # not a rank: nothing happens
        for source in [s for s in self.ref.held if s[0] == replica and (rank is None or s[1] == rank)]:
            del self.ref.held[source]
            self.ref.maps.pop(source, None)
        if rank is None:
            self.ref.marks.pop(replica, None)

    @rule(replica=st.sampled_from(REPLICAS), keys=st.lists(KEYS, max_size=5))
    def provisional(self, replica: ReplicaName, keys: list[int]) -> None:
        self.index.add_provisional(replica, [BlockKey(k) for k in keys], self.now)
        marks = self.ref.marks.setdefault(replica, {})
        for key in keys:
            marks[key] = self.now + TTL

    @rule(seconds=st.sampled_from([1.0, 5.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @rule(keys=st.lists(KEYS, min_size=1, max_size=10))
    def lookup(self, keys: list[int]) -> None:
        self.check(keys)

    def check(self, keys: list[int]) -> None:
        got = {r: (m.blocks, m.gpu_blocks) for r, m in self.index.longest_prefixes(keys, self.now).items()}  # type: ignore[arg-type]
        expected = self.ref.lengths(keys, self.now)
        if self.budget is None:
            assert got == expected
        else:  # a budget evicts: an evicted block is under-predicted, never over-predicted
            for replica, (blocks, gpu) in got.items():
                ref_blocks, ref_gpu = expected.get(replica, (0, 0))
                assert blocks <= ref_blocks and gpu <= ref_gpu

    @invariant()
    def no_orphans(self) -> None:
        assert self.index.orphaned_bits == 0
        if self.budget is None:
            held = {r: 0 for r in REPLICAS}  # engine hashes tracked (two hashes of one key count twice)
            for (replica, _rank), emap in self.ref.maps.items():
                held[replica] += len(emap)
            assert {r: n for r, n in self.index.held_counts().items() if n} == {r: n for r, n in held.items() if n}
        else:
            assert len(self.index) <= self.budget

    @invariant()
    def every_key_answers(self) -> None:
        self.check([BlockKey(k * 0x9E3779B97F4A7C15 % 2**64) for k in range(10)])


class PureHostileSequences(HostileSequences):
    pure = True


class BudgetedHostileSequences(HostileSequences):
    budget = 6


STEPS = settings(max_examples=120, stateful_step_count=40, deadline=None)
HostileSequences.TestCase.settings = STEPS
TestHostileSequences = HostileSequences.TestCase
PureHostileSequences.TestCase.settings = settings(STEPS, max_examples=50)
TestPureHostileSequences = PureHostileSequences.TestCase
BudgetedHostileSequences.TestCase.settings = settings(STEPS, max_examples=50)
TestBudgetedHostileSequences = BudgetedHostileSequences.TestCase


def test_hash_reuses_are_exported_as_index_anomalies() -> None:
    """The repair is visible to operators: kvrouter_index_anomalies_total{kind="hash_reuse"} counts it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvrouter.events.metrics import EventMetrics

    registry = CollectorRegistry(auto_describe=True)
    metrics = EventMetrics(registry)
    index = PrefixIndex()
    metrics.read_index_anomalies(lambda: {"hash_reuse": index.hash_reuses, "orphaned_bit": index.orphaned_bits})
    ingest = IndexIngest(index, block_sizes={A: BLOCK})
    ingest.apply(batch(A, BlockStored([EngineBlockHash(77)], None, [1, 2, 3, 4], BLOCK)))
    ingest.apply(batch(A, BlockStored([EngineBlockHash(77)], None, [5, 6, 7, 8], BLOCK)))
    text = generate_latest(registry).decode()
    assert 'kvrouter_index_anomalies_total{kind="hash_reuse"} 1.0' in text
    assert 'kvrouter_index_anomalies_total{kind="orphaned_bit"} 0.0' in text
