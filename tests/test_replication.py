"""Warm-up planners: hot-prefix replication after a saturated decision, prefix heat for drains; both in replay."""

from __future__ import annotations

import pytest

from kvrouter.policies.base import CandidateScore, Decision
from kvrouter.routing.replication import HotPrefixReplicator, PrefixHeat, ReplicationConfig, WarmUp
from kvrouter.typedefs import BlockKey, ReplicaName
from tests.shared_data import MOONCAKE_CONVERSATION, shared

A, B, C = ReplicaName("a"), ReplicaName("b"), ReplicaName("c")
KEYS = [BlockKey(n) for n in range(200)]


def decision(chosen_ttft: float, others: dict[ReplicaName, tuple[int, float]]) -> Decision:
    scores = [CandidateScore(A, 8192, 0.0, {"ttft_estimate_s": chosen_ttft})]
    scores += [CandidateScore(r, cached, 1.0, {"ttft_estimate_s": ttft}) for r, (cached, ttft) in others.items()]
    return Decision(A, tuple(scores))


def test_a_saturated_holder_gets_its_prefix_copied_to_the_idlest_spare() -> None:
    replicator = HotPrefixReplicator(ReplicationConfig(saturated_s=1.0, gain_s=0.5, cooldown_s=30.0))
    warm = replicator.consider(decision(2.0, {B: (0, 0.9), C: (0, 0.3)}), KEYS, 64, now=0.0)
    assert warm == WarmUp(C, 128)
    # Same prefix again within the cool-down: nothing; after it: again.
    assert replicator.consider(decision(2.0, {B: (0, 0.9), C: (0, 0.3)}), KEYS, 64, now=10.0) is None
    assert replicator.consider(decision(2.0, {B: (0, 0.9), C: (0, 0.3)}), KEYS, 64, now=31.0) == WarmUp(C, 128)
    assert replicator.warmups == 2


@pytest.mark.parametrize(
    "chosen_ttft, others",
    [
        (0.5, {B: (0, 0.0)}),  # the holder is not saturated
        (2.0, {B: (0, 1.8)}),  # no spare replica is enough faster
        (2.0, {B: (8192, 0.0)}),  # the other replica already holds the prefix
    ],
)
def test_no_warm_up_when_it_would_not_help(chosen_ttft: float, others: dict[ReplicaName, tuple[int, float]]) -> None:
    assert HotPrefixReplicator().consider(decision(chosen_ttft, others), KEYS, 64, now=0.0) is None


def test_short_prefixes_are_not_copied() -> None:
    small = Decision(A, (CandidateScore(A, 1024, 0.0, {"ttft_estimate_s": 5.0}), CandidateScore(B, 0, 0.0, {})))
    assert HotPrefixReplicator().consider(small, KEYS, 64, now=0.0) is None


def test_heat_ranks_prefixes_by_decayed_count() -> None:
    heat = PrefixHeat(half_life_s=10.0, min_blocks=2, capacity=2)
    for _ in range(3):
        heat.record(A, KEYS, 10, now=0.0)
    heat.record(A, KEYS, 20, now=0.0)
    heat.record(A, KEYS, 1, now=0.0)  # below min_blocks: ignored
    assert heat.hottest(A, 5, now=0.0) == [tuple(KEYS[:10]), tuple(KEYS[:20])]
    heat.record(A, KEYS, 30, now=40.0)  # the 3 hits on the 10-block prefix have decayed to 3/16: it is evicted
    assert heat.hottest(A, 1, now=40.0) == [tuple(KEYS[:30])]
    assert len(heat.hottest(A, 5, now=40.0)) == 2
    assert heat.hottest(B, 5, now=40.0) == []


def test_replay_drain_with_warm_up_and_replication() -> None:
    from kvrouter.config import Settings
    from kvrouter.policies.kv_aware import KvAwarePolicy
    from kvrouter.replay.driver import Replay, ReplayOptions, ReplayResult, VirtualClock
    from kvrouter.replay.hotspot import hot_spot
    from kvrouter.replay.prompts import PromptCatalog
    from kvrouter.replay.trace import load_trace
    from kvrouter.sim.mocker import DynamoMockerEngine

    trace = hot_spot(load_trace(shared(MOONCAKE_CONVERSATION), speedup=3.0, limit=800), share=0.5)
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]

    # The replicator acts on kv_aware's TTFT estimates: pinned costs (no calibration) keep this a test of its
    # mechanics, not of what the calibration learns in the first seconds.
    pinned = Settings(kv_calibrate=False, kv_prefill_tokens_per_s=48_000, kv_cache_weight=4.0)

    def run(options: ReplayOptions) -> tuple[Replay, ReplayResult]:
        clock = VirtualClock()
        replay = Replay(
            requests=trace.requests,
            prompts=prompts,
            catalog=catalog,
            policy=KvAwarePolicy.from_settings(pinned, clock=clock),
            engine_factory=DynamoMockerEngine,
            options=options,
            clock=clock,
        )
        result = replay.run()
        assert all(record.finish is not None for record in result.records)
        return replay, result

    drain_at = trace.requests[400].arrival
    drained, result = run(ReplayOptions(drain_at_s=drain_at, drain_warm=8))
    after = [r for r in result.records if r.arrival > drain_at]
    assert after and all(r.replica != "engine-3" for r in after)
    assert 0 < len(drained.warmups) <= 8
    assert all(time == drain_at and replica != "engine-3" for time, replica, _ in drained.warmups)
    assert result.warmups == len(drained.warmups)
    replicated, _ = run(ReplayOptions(replicate=True))
    assert replicated.warmups and len({replica for _, replica, _ in replicated.warmups}) >= 1
