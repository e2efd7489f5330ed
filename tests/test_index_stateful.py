"""The prefix index held against a plain reference model (dicts of sets) under random operation sequences."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvrouter.blocktable import pure_backend
from kvrouter.index import PrefixIndex
from kvrouter.routing.router import PrefixMatch
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

REPLICAS = [ReplicaName(n) for n in ("a", "b", "c")]
KEYS = st.integers(min_value=0, max_value=9).map(lambda k: BlockKey(k * 0x9E3779B97F4A7C15 % 2**64))
TTL = 5.0


def engine_hash(key: BlockKey) -> EngineBlockHash:
    return EngineBlockHash(key ^ 0xABCDEF)


class IndexVersusReference(RuleBasedStateMachine):
    def make_index(self) -> PrefixIndex:
        return PrefixIndex(provisional_ttl_s=TTL)

    def __init__(self) -> None:
        super().__init__()
        self.index = self.make_index()
        self.now = 0.0
        # (replica, rank) -> tier -> keys
        self.held: dict[tuple[ReplicaName, int], dict[Tier, set[BlockKey]]] = {}
        # replica -> key -> provisional expiry
        self.provisional: dict[ReplicaName, dict[BlockKey, float]] = {}

    @rule(
        replica=st.sampled_from(REPLICAS),
        rank=st.integers(0, 1),
        tier=st.sampled_from(list(Tier)),
        keys=st.lists(KEYS, max_size=6),
    )
    def store(self, replica: ReplicaName, rank: int, tier: Tier, keys: list[BlockKey]) -> None:
        self.index.store_keys(replica, [engine_hash(k) for k in keys], keys, tier, dp_rank=rank)
        self.held.setdefault((replica, rank), {}).setdefault(tier, set()).update(keys)

    @rule(
        replica=st.sampled_from(REPLICAS),
        rank=st.integers(0, 1),
        tier=st.sampled_from(list(Tier)),
        keys=st.lists(KEYS, max_size=4),
    )
    def remove(self, replica: ReplicaName, rank: int, tier: Tier, keys: list[BlockKey]) -> None:
        tiers = self.held.get((replica, rank), {})
        expected_unknown = 0
        for key in keys:
            if not any(key in held for held in tiers.values()):
                expected_unknown += 1
                continue
            tiers.get(tier, set()).discard(key)
        unknown = self.index.remove_blocks(replica, [engine_hash(k) for k in keys], tier, dp_rank=rank)
        assert unknown == expected_unknown

    @rule(replica=st.sampled_from(REPLICAS), rank=st.one_of(st.none(), st.integers(0, 1)))
    def clear(self, replica: ReplicaName, rank: int | None) -> None:
        self.index.clear(replica, dp_rank=rank)
        for source in list(self.held):
            if source[0] == replica and (rank is None or source[1] == rank):
                del self.held[source]
        if rank is None:
            self.provisional.pop(replica, None)

    @rule(replica=st.sampled_from(REPLICAS), keys=st.lists(KEYS, max_size=6))
    def provisional_marks(self, replica: ReplicaName, keys: list[BlockKey]) -> None:
        self.index.add_provisional(replica, keys, self.now)
        marks = self.provisional.setdefault(replica, {})
        for key in keys:
            marks[key] = self.now + TTL

    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 7.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    def expected(self, keys: list[BlockKey]) -> dict[ReplicaName, PrefixMatch]:
        def leading(held: set[BlockKey]) -> int:
            count = 0
            for key in keys:
                if key not in held:
                    break
                count += 1
            return count

        result: dict[ReplicaName, PrefixMatch] = {}

        def merge(replica: ReplicaName, blocks: int, gpu_blocks: int, host_blocks: int) -> None:
            if blocks == 0:
                return
            best = result.get(replica, PrefixMatch(0, 0, 0))
            host = max(host_blocks, best.blocks if best.host_blocks is None else best.host_blocks)
            result[replica] = PrefixMatch(max(blocks, best.blocks), max(gpu_blocks, best.gpu_blocks), host)

        for (replica, _rank), tiers in self.held.items():
            anywhere = set().union(*tiers.values()) if tiers else set()
            gpu = tiers.get(Tier.GPU, set())
            host = gpu | tiers.get(Tier.CPU, set())
            merge(replica, leading(anywhere), leading(gpu), leading(host))
        for replica, marks in self.provisional.items():
            live = {k for k, until in marks.items() if until > self.now}
            blocks = leading(live)
            merge(replica, blocks, blocks, blocks)
        # `host_blocks` is None where no block of the match is only in storage.
        return {
            replica: match
            if match.host_blocks is None or match.host_blocks < match.blocks
            else PrefixMatch(match.blocks, match.gpu_blocks)
            for replica, match in result.items()
        }

    @rule(keys=st.lists(KEYS, min_size=1, max_size=12))
    def lookup(self, keys: list[BlockKey]) -> None:
        assert dict(self.index.longest_prefixes(keys, self.now)) == self.expected(keys)

    @invariant()
    def counts(self) -> None:
        expected: dict[ReplicaName, int] = {}
        for (replica, _rank), tiers in self.held.items():
            expected[replica] = expected.get(replica, 0) + len(set().union(*tiers.values()) if tiers else set())
        actual = {r: n for r, n in self.index.block_counts().items() if n}
        assert actual == {r: n for r, n in expected.items() if n}


class PureIndexVersusReference(IndexVersusReference):
    """The same index on the pure-Python tables (what runs when the extension was not built)."""

    def make_index(self) -> PrefixIndex:
        return PrefixIndex(provisional_ttl_s=TTL, backend=pure_backend())


class BudgetedIndexVersusReference(IndexVersusReference):
    """A budget the test never reaches: the ordered tables (recency lists) must not change a single answer."""

    def make_index(self) -> PrefixIndex:
        return PrefixIndex(provisional_ttl_s=TTL, max_blocks=10_000)


STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None)
IndexVersusReference.TestCase.settings = STATEFUL
TestIndexVersusReference = IndexVersusReference.TestCase
PureIndexVersusReference.TestCase.settings = settings(STATEFUL, max_examples=60)
TestPureIndexVersusReference = PureIndexVersusReference.TestCase
BudgetedIndexVersusReference.TestCase.settings = settings(STATEFUL, max_examples=60)
TestBudgetedIndexVersusReference = BudgetedIndexVersusReference.TestCase
