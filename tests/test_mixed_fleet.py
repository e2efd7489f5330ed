"""A mixed fleet where neither prefixes nor prompt sizes decide: kv_aware gives each engine a share of the work
proportional to its speed, learned from its own TTFTs (the engines' speeds are never configured in the router)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrouter.config import Settings
from kvrouter.policies.kv_aware import KvAwarePolicy
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, VirtualClock, replay_policy
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.report import summarize
from kvrouter.replay.trace import Trace, load_trace, unshared
from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from tests.shared_data import MOONCAKE_CONVERSATION, shared

SPEEDS = (1.0, 1.0, 0.5, 0.5)


def uniform(trace: Trace, input_length: int, output_length: int) -> Trace:
    """The trace's arrivals with every prompt and answer the same size."""
    requests = tuple(replace(r, input_length=input_length, output_length=output_length) for r in trace.requests)
    return replace(trace, requests=requests)


def replay_shares(policy_name: str, start_rate: float) -> dict[str, float]:
    # The conversation trace's arrivals at x1.8 (its mean prompt and answer, 12,035 / 342 tokens), every prefix
    # unique: about 80% of what two full-speed and two half-speed engines can serve.
    trace = unshared(uniform(load_trace(shared(MOONCAKE_CONVERSATION), speedup=1.8, limit=1_500), 12_035, 342))
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    policy = replay_policy_object(policy_name, Settings(kv_prefill_tokens_per_s=start_rate), clock)
    result = replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=policy,
        engine_factory=[lambda s=speed: DynamoMockerEngine(MockerConfig(speedup=s)) for speed in SPEEDS],
        options=ReplayOptions(replicas=len(SPEEDS)),
        clock=clock,
    )
    if isinstance(policy, KvAwarePolicy):
        assert all(policy.costs(name).samples > 50 for name in result.replicas)
    return {name: value["prefill_share"] for name, value in summarize(result)["replicas"].items()}


@pytest.mark.parametrize("start_rate", [2_500.0, 160_000.0])
def test_kv_aware_shares_work_in_proportion_to_speed(start_rate: float) -> None:
    shares = replay_shares("kv_aware", start_rate)
    fast = shares["engine-0"] + shares["engine-1"]
    # Speeds 2 : 1 per pair: two thirds of the work on the full-speed pair, within two points, from either start.
    assert fast == pytest.approx(2 / 3, abs=0.02)
    assert shares["engine-0"] == pytest.approx(shares["engine-1"], abs=0.03)
    assert shares["engine-2"] == pytest.approx(shares["engine-3"], abs=0.03)


def test_round_robin_does_not() -> None:
    shares = replay_shares("round_robin", 40_000.0)
    assert shares["engine-0"] + shares["engine-1"] == pytest.approx(0.5, abs=0.01)
