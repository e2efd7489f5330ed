"""Online cache-weight tuner: probe arms on a fixed share of decisions, moves toward the faster arm, bounded."""

from __future__ import annotations

import pytest

from kvrouter.policies.base import Candidate, ReplicaLoad, RouteRequest
from kvrouter.policies.kv_aware import KvAwareConfig, KvAwarePolicy
from kvrouter.routing.tuning import TunerConfig, WeightTuner
from kvrouter.typedefs import ReplicaName


def test_probe_share_and_arms() -> None:
    tuner = WeightTuner(4.0, TunerConfig(period=20, step=0.25))
    weights = [tuner.weight_for(turn) for turn in range(40)]
    assert weights.count(5.0) == 2 and weights.count(3.0) == 2 and weights.count(4.0) == 36


def feed(tuner: WeightTuner, costs: dict[str, float], rounds: int) -> None:
    for _ in range(rounds):
        arms = {"up": tuner.weight_for(0), "down": tuner.weight_for(tuner.config.period // 2), "base": tuner.weight}
        for arm, weight in arms.items():
            tuner.observe(weight, costs[arm], 1000)


def test_moves_toward_the_faster_arm_and_stays_in_bounds() -> None:
    tuner = WeightTuner(4.0, TunerConfig(window=5, step=0.5, high=8.0))
    feed(tuner, {"up": 1.0, "down": 3.0, "base": 2.0}, 5)
    assert tuner.weight == 6.0 and tuner.moves == [6.0]
    feed(tuner, {"up": 1.0, "down": 3.0, "base": 2.0}, 50)
    assert tuner.weight == 8.0


def test_holds_within_the_threshold() -> None:
    tuner = WeightTuner(4.0, TunerConfig(window=5, threshold=0.1))
    feed(tuner, {"up": 1.95, "down": 1.95, "base": 2.0}, 20)
    assert tuner.weight == 4.0 and tuner.moves == []


def test_observations_from_before_a_move_are_ignored() -> None:
    tuner = WeightTuner(4.0, TunerConfig(window=1, step=0.5))
    feed(tuner, {"up": 1.0, "down": 3.0, "base": 2.0}, 1)
    assert tuner.weight == 6.0
    tuner.observe(2.0, 0.0, 1000)  # routed with the old "down" weight
    assert sum(arm.count for arm in tuner._arms.values()) == 0


def test_kv_aware_uses_the_probe_weight_and_reports_it() -> None:
    policy = KvAwarePolicy(KvAwareConfig(tune=True, cache_weight=4.0), clock=lambda: 0.0)
    request = RouteRequest(prompt_tokens=4096)
    candidates = [Candidate(ReplicaName("a"), 2048, ReplicaLoad()), Candidate(ReplicaName("b"), 0, ReplicaLoad())]
    used = []
    for _ in range(20):
        decision = policy.select(request, candidates)
        used.append(decision.candidates[0].breakdown["cache_weight"])
        policy.record(decision)
    assert used[0] == 5.0 and used[10] == 3.0 and used.count(4.0) == 18
    policy.observe_ttft(5.0, 0.5, 4096)
    assert policy.tuner is not None and policy.tuner._arms["up"].count == 1


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        TunerConfig(step=1.5)
