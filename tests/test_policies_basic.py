"""round_robin and least_loaded as pure scorers, and the policy factory."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest

from kvrouter.config import ConfigError, Settings
from kvrouter.policies import build_policy
from kvrouter.policies.base import Candidate, ReplicaLoad, RouteRequest
from kvrouter.policies.least_loaded import LeastLoadedPolicy
from kvrouter.policies.round_robin import RoundRobinPolicy
from kvrouter.typedefs import ReplicaName

REQUEST = RouteRequest(prompt_tokens=None)


def candidate(name: str, in_flight: int = 0, weight: float = 1.0, waiting: int | None = None) -> Candidate:
    return Candidate(ReplicaName(name), 0, ReplicaLoad(in_flight=in_flight, engine_waiting=waiting), weight)


def route_many(policy: RoundRobinPolicy | LeastLoadedPolicy, candidates: list[Candidate], count: int) -> list[str]:
    chosen = []
    for _ in range(count):
        decision = policy.select(REQUEST, candidates)
        policy.record(decision)
        chosen.append(decision.chosen)
    return chosen


def test_round_robin_alternates_and_select_is_a_dry_run() -> None:
    policy = RoundRobinPolicy()
    candidates = [candidate("a"), candidate("b"), candidate("c")]
    assert [policy.select(REQUEST, candidates).chosen for _ in range(3)] == ["a", "a", "a"]
    assert route_many(policy, candidates, 7) == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_follows_weights_evenly_interleaved() -> None:
    policy = RoundRobinPolicy()
    chosen = route_many(policy, [candidate("a", weight=2.0), candidate("b"), candidate("c")], 8)
    assert Counter(chosen) == {"a": 4, "b": 2, "c": 2}
    assert "a" in chosen[:2] and "a" in chosen[2:4]


def test_round_robin_keeps_turns_when_a_replica_drops_out() -> None:
    policy = RoundRobinPolicy()
    everyone = [candidate("a"), candidate("b"), candidate("c")]
    assert route_many(policy, everyone, 2) == ["a", "b"]
    without_c = everyone[:2]
    assert Counter(route_many(policy, without_c, 4)) == {"a": 2, "b": 2}
    assert Counter(route_many(policy, everyone, 3)) == {"a": 1, "b": 1, "c": 1}


def test_round_robin_breakdown() -> None:
    decision = RoundRobinPolicy().select(REQUEST, [candidate("a", in_flight=3), candidate("b")])
    score = decision.score_of(ReplicaName("a"))
    assert score is not None and score.breakdown["in_flight"] == 3 and score.breakdown["weight"] == 1.0


def test_least_loaded_picks_fewest_in_flight() -> None:
    policy = LeastLoadedPolicy()
    decision = policy.select(REQUEST, [candidate("a", 4), candidate("b", 1), candidate("c", 2)])
    assert decision.chosen == "b"
    assert [c.score for c in decision.candidates] == [4.0, 1.0, 2.0]


def test_least_loaded_divides_by_weight() -> None:
    policy = LeastLoadedPolicy()
    assert policy.select(REQUEST, [candidate("a", 3, weight=4.0), candidate("b", 1)]).chosen == "a"


def test_least_loaded_rotates_ties_and_uses_engine_waiting() -> None:
    policy = LeastLoadedPolicy()
    idle = [candidate("a"), candidate("b"), candidate("c")]
    assert policy.select(REQUEST, idle).chosen == policy.select(REQUEST, idle).chosen  # dry run
    assert sorted(route_many(policy, idle, 3)) == ["a", "b", "c"]
    busy_engine = [candidate("a", waiting=5), candidate("b", waiting=0), candidate("c", waiting=2)]
    assert set(route_many(policy, busy_engine, 3)) == {"b"}


def test_build_policy() -> None:
    settings = Settings()
    assert build_policy("round_robin", settings).name == "round_robin"
    assert build_policy("least_loaded", settings).name == "least_loaded"
    with pytest.raises(ConfigError):
        build_policy("random", settings)


def test_build_kv_aware_when_present() -> None:
    if importlib.util.find_spec("kvrouter.policies.kv_aware") is None:
        with pytest.raises(ConfigError, match="kv_aware"):
            build_policy("kv_aware", Settings())
    else:
        assert build_policy("kv_aware", Settings()).name == "kv_aware"
