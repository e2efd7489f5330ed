"""Per-replica cost calibration: the fit recovers known costs from a mis-set start, shrugs off outliers, keeps
replicas apart, and kv_aware learns a mixed fleet's speeds from its own TTFTs in replay."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvrouter.config import Settings
from kvrouter.policies.kv_aware import KvAwarePolicy
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, VirtualClock, replay_policy
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.report import summarize
from kvrouter.replay.trace import load_trace, unshared
from kvrouter.routing.calibration import CalibrationConfig, CostCalibrator, Observation, ReplicaCosts, fit_costs
from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.typedefs import ReplicaName
from tests.shared_data import MOONCAKE_CONVERSATION, shared

BATCH = 8192
TRUE = ReplicaCosts(prefill_tokens_per_s=40_000.0, pass_s=0.03, decode_s_per_request=0.0004)
A, B = ReplicaName("a"), ReplicaName("b")


def observe(costs: ReplicaCosts, rng: random.Random, *, noise: float = 0.0) -> Observation:
    """A request as the policy would see it, its TTFT from the model with `costs` (x a multiplicative noise)."""
    work = rng.choice([rng.uniform(50, 4_000), rng.uniform(4_000, 120_000)])
    decoding = rng.randint(0, 120)
    short = max(0.0, 1.0 - work / BATCH)
    passes = max(1.0, work / BATCH)
    ttft = work / costs.prefill_tokens_per_s + short * costs.pass_s + passes * decoding * costs.decode_s_per_request
    return Observation(work, short, passes, decoding, ttft * (1.0 + rng.uniform(-noise, noise)))


@pytest.mark.parametrize("start_rate", [10_000.0, 160_000.0])
def test_fit_recovers_the_costs_from_a_start_four_times_off(start_rate: float) -> None:
    rng = random.Random(1)
    observations = [observe(TRUE, rng, noise=0.05) for _ in range(256)]
    fitted = fit_costs(observations, ReplicaCosts(start_rate, 0.12, 0.0001))
    assert fitted is not None
    assert fitted.prefill_tokens_per_s == pytest.approx(TRUE.prefill_tokens_per_s, rel=0.05)
    assert fitted.pass_s == pytest.approx(TRUE.pass_s, rel=0.2)
    assert fitted.decode_s_per_request == pytest.approx(TRUE.decode_s_per_request, rel=0.15)


def test_outliers_do_not_move_the_fit() -> None:
    rng = random.Random(2)
    observations = [observe(TRUE, rng, noise=0.05) for _ in range(256)]
    # A tenth of the requests were preempted or hit a cold engine: ten times their normal TTFT.
    spoiled = [replace(o, ttft_s=o.ttft_s * 10) if i % 10 == 0 else o for i, o in enumerate(observations)]
    fitted = fit_costs(spoiled, ReplicaCosts(10_000.0, 0.01, 0.0005))
    assert fitted is not None
    assert fitted.prefill_tokens_per_s == pytest.approx(TRUE.prefill_tokens_per_s, rel=0.08)
    assert fitted.decode_s_per_request == pytest.approx(TRUE.decode_s_per_request, rel=0.2)


def test_each_replica_converges_to_its_own_costs() -> None:
    start = ReplicaCosts(10_000.0, 0.01, 0.0005)
    calibrator = CostCalibrator(start)
    # Before any observation: the start, the prefill rate scaled by the replica's weight.
    assert calibrator.costs(A) == start
    assert calibrator.costs(B, weight=2.0).prefill_tokens_per_s == 20_000.0
    slow = replace(TRUE, prefill_tokens_per_s=20_000.0, pass_s=0.06, decode_s_per_request=0.0008)
    rng = random.Random(3)
    for _ in range(CalibrationConfig().window):
        calibrator.observe(A, observe(TRUE, rng, noise=0.1))
        calibrator.observe(B, observe(slow, rng, noise=0.1))
    fast_rate = calibrator.costs(A).prefill_tokens_per_s
    slow_rate = calibrator.costs(B).prefill_tokens_per_s
    assert fast_rate == pytest.approx(40_000.0, rel=0.1)
    assert slow_rate == pytest.approx(20_000.0, rel=0.1)
    assert calibrator.costs(A).samples >= CalibrationConfig().window - CalibrationConfig().refit_every
    # A replica that comes back on other hardware is re-learnt within one window.
    for _ in range(CalibrationConfig().window):
        calibrator.observe(A, observe(slow, rng, noise=0.1))
    assert calibrator.costs(A).prefill_tokens_per_s == pytest.approx(20_000.0, rel=0.1)
    calibrator.forget(A)
    # A replica without observations of its own is priced like its calibrated peers (here: B alone).
    assert calibrator.costs(A).prefill_tokens_per_s == pytest.approx(slow_rate)
    assert calibrator.costs(A, weight=2.0).prefill_tokens_per_s == pytest.approx(2 * slow_rate)
    assert calibrator.costs(A).samples == 0
    calibrator.forget(B)
    # With no replica left, the fleet's first pooled fit prices it (the start is gone for good).
    assert calibrator.costs(A).samples == 0 and calibrator.costs(A) != start


def test_bad_observations_are_skipped() -> None:
    calibrator = CostCalibrator(ReplicaCosts(10_000.0, 0.01, 0.0005))
    for ttft in (float("nan"), float("inf"), -1.0):
        calibrator.observe(A, Observation(1_000.0, 0.9, 1.0, 0.0, ttft))
    assert calibrator.replicas() == []
    # Identical observations leave the model undetermined: the ridge keeps it at the start, nothing breaks.
    for _ in range(64):
        calibrator.observe(A, Observation(1_000.0, 0.9, 1.0, 0.0, 0.05))
    assert calibrator.costs(A).prefill_tokens_per_s > 0


def mixed_fleet_replay(start_rate: float) -> tuple[KvAwarePolicy, dict[str, float]]:
    """The first 1,500 conversation requests, no prefix shared, on 2 engines: engine-1 at half speed."""
    trace = unshared(load_trace(shared(MOONCAKE_CONVERSATION), speedup=1.0, limit=1_500))
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    policy = replay_policy_object("kv_aware", Settings(kv_prefill_tokens_per_s=start_rate), clock)
    assert isinstance(policy, KvAwarePolicy)
    result = replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=policy,
        engine_factory=[DynamoMockerEngine, lambda: DynamoMockerEngine(MockerConfig(speedup=0.5))],
        options=ReplayOptions(replicas=2),
        clock=clock,
    )
    shares = {name: value["prefill_share"] for name, value in summarize(result)["replicas"].items()}
    return policy, shares


@pytest.mark.parametrize("start_rate", [2_500.0, 40_000.0])
def test_kv_aware_learns_a_mixed_fleet_in_replay(start_rate: float) -> None:
    policy, shares = mixed_fleet_replay(start_rate)
    fast = policy.costs(ReplicaName("engine-0"))
    slow = policy.costs(ReplicaName("engine-1"))
    assert fast.samples > 100 and slow.samples > 50
    assert slow.prefill_tokens_per_s / fast.prefill_tokens_per_s == pytest.approx(0.5, abs=0.15)
    # The half-speed engine computes about a third of the fleet's prefill tokens, whatever the start (by count it
    # takes nearly half the requests: the short ones, which its speed does not delay much).
    assert shares["engine-1"] == pytest.approx(1 / 3, abs=0.05)


def test_profile_speed_divides_pass_time() -> None:
    profile = get_profile("cpu-tiny")
    assert replace(profile, speed=0.5).step_time(100, 2, 1_000, 0.0) == pytest.approx(
        2 * profile.step_time(100, 2, 1_000, 0.0)
    )
    mocker = build_engine(get_profile("dynamo-mocker"), speed=0.5)
    assert isinstance(mocker, DynamoMockerEngine) and mocker.config.speedup == 0.5
    with pytest.raises(ValueError):
        replace(profile, speed=0.0)


def test_the_fleet_pooled_fit_comes_first() -> None:
    start = ReplicaCosts(10_000.0, 0.01, 0.0005)
    calibrator = CostCalibrator(start, CalibrationConfig(min_samples=24))
    rng = random.Random(4)
    replicas = [ReplicaName(f"r{n}") for n in range(4)]
    # Six requests each: no replica has its own fit, but the fleet's 24 pooled ones give the first estimate.
    for _ in range(6):
        for replica in replicas:
            calibrator.observe(replica, observe(TRUE, rng, noise=0.05), weight=2.0 if replica == "r3" else 1.0)
    plain = calibrator.costs(replicas[0])
    assert plain.samples == 0 and plain.prefill_tokens_per_s != start.prefill_tokens_per_s
    # The pool counts work per unit of weight: a replica of weight 2 borrows twice the rate.
    assert calibrator.costs(replicas[3], weight=2.0).prefill_tokens_per_s == pytest.approx(
        2 * plain.prefill_tokens_per_s
    )


def test_a_peers_observations_fit_as_its_own_and_leave_with_it() -> None:
    """Instances of one fleet fit each other's observations (kvrouter/routing/sharing.py); a peer that goes away
    takes its observations out of every fit it was part of."""
    rng = random.Random(7)
    mine = [observe(TRUE, rng, noise=0.05) for _ in range(40)]
    slow = replace(TRUE, prefill_tokens_per_s=TRUE.prefill_tokens_per_s / 4)
    lies = [observe(slow, rng, noise=0.05) for _ in range(200)]  # a peer that saw it 4x slower (or lies)
    shared_fit = CostCalibrator(ReplicaCosts(10_000.0, 0.01, 0.0005))
    alone = CostCalibrator(ReplicaCosts(10_000.0, 0.01, 0.0005))
    for observation in mine:
        shared_fit.observe(A, observation)
        alone.observe(A, observation)
    for observation in lies:
        shared_fit.observe(A, observation, source="peer-x")
    skewed = shared_fit.costs(A)
    assert skewed.samples > 200 and skewed.prefill_tokens_per_s < 0.5 * TRUE.prefill_tokens_per_s
    shared_fit.forget_source("peer-x")
    back = shared_fit.costs(A)
    assert back.source == "fit" and back.samples == 40
    assert back.prefill_tokens_per_s == pytest.approx(TRUE.prefill_tokens_per_s, rel=0.1)
    # What is left is the instance's own history: the fit it would have had without the peer.
    assert back.prefill_tokens_per_s == pytest.approx(alone.costs(A).prefill_tokens_per_s, rel=0.02)
    # Under min_samples after the peer left: the replica borrows again (here: the start), until it has its own.
    few = CostCalibrator(ReplicaCosts(10_000.0, 0.01, 0.0005))
    for observation in lies[:30]:
        few.observe(B, observation, source="peer-x")
    few.observe(B, mine[0])
    assert few.costs(B).source == "fit"
    few.forget_source("peer-x")
    assert few.costs(B).source in ("start", "fleet") and few.costs(B).samples == 0
    few.forget_source("nobody")  # nothing of it: a no-op
