"""The routing core: candidates follow the engine's cached-token rule; decide is a dry run; commit acts."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvrouter.blocks import chain_keys
from kvrouter.policies.base import Candidate, CandidateScore, Decision, RouteRequest
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import PrefixMatch, Route, Router, RoutingFacts
from kvrouter.typedefs import BlockKey, ReplicaName

A, B = ReplicaName("a"), ReplicaName("b")


@dataclass
class DictIndex:
    """Plain reference: replica -> set of keys; provisional adds go to the same set."""

    held: dict[ReplicaName, set[BlockKey]] = field(default_factory=dict)

    def longest_prefixes(self, keys: Sequence[BlockKey], now: float) -> Mapping[ReplicaName, PrefixMatch]:
        result = {}
        for replica, held in self.held.items():
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            if n:
                result[replica] = PrefixMatch(n, n)
        return result

    def add_provisional(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        self.held.setdefault(replica, set()).update(keys)


class MostCached:
    name = "most_cached"

    def __init__(self) -> None:
        self.recorded: list[Decision] = []

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        best = max(candidates, key=lambda c: c.cached_tokens)
        scores = tuple(CandidateScore(c.replica, c.cached_tokens, -c.cached_tokens) for c in candidates)
        return Decision(best.replica, scores)

    def record(self, decision: Decision) -> None:
        self.recorded.append(decision)

    def first_token(self, decision: Decision, ttft_s: float, prompt_tokens: int) -> None:
        pass


def make_router(index: DictIndex, policy: MostCached) -> Router:
    return Router(policy=policy, load=LoadBook(), index=index, clock=lambda: 0.0)


def test_cached_tokens_follow_engine_rule_last_token_always_computed() -> None:
    prompt = list(range(64))  # exactly 4 blocks of 16: the 4th block cannot count, the last token is computed
    index = DictIndex({A: set(chain_keys(prompt, 16))})
    router = make_router(index, MostCached())
    facts = RoutingFacts([prompt])
    by_name = {c.replica: c for c in router.candidates(facts, [Route(A, 16), Route(B, 16)])}
    assert by_name[A].cached_tokens == 48
    assert by_name[B].cached_tokens == 0


def test_decide_is_a_dry_run_and_commit_acts() -> None:
    prompt = list(range(100))
    index = DictIndex()
    policy = MostCached()
    router = make_router(index, policy)
    routes = [Route(A, 16), Route(B, 16)]
    facts = RoutingFacts([prompt])
    decision = router.decide(facts, routes)
    assert index.held == {} and policy.recorded == [] and router.load.in_flight_total() == 0
    routed = router.commit(decision, facts, routes[0])
    assert policy.recorded == [decision]
    assert index.held[A] == set(chain_keys(prompt, 16))
    assert router.load.snapshot(A).pending_prefill_tokens == 100
    routed.finish(0.0)
    # the provisional blocks now draw the sibling to the same replica
    again = router.decide(RoutingFacts([prompt]), routes)
    assert again.chosen == A and again.score_of(A) is not None


def test_salt_and_adapter_isolate_keys() -> None:
    prompt = list(range(48))
    plain = RoutingFacts([prompt]).keys(16, 0)
    salted = RoutingFacts([prompt], cache_salt="tenant-1").keys(16, 0)
    adapter = RoutingFacts([prompt], lora="sql").keys(16, 0)
    assert len({plain[0], salted[0], adapter[0]}) == 3
    assert set(plain).isdisjoint(salted)


def test_no_tokenizer_routes_on_load_only() -> None:
    router = make_router(DictIndex({A: {BlockKey(1)}}), MostCached())
    facts = RoutingFacts(None)
    assert all(c.cached_tokens == 0 for c in router.candidates(facts, [Route(A, 16), Route(B, 16)]))
