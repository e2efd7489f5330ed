"""Self-correcting lookup: repair of stale entries and per-replica trust, on the real `PrefixIndex`; in replay."""

from __future__ import annotations

import pytest

from kvrouter.index import PrefixIndex
from kvrouter.routing.feedback import FeedbackConfig, FeedbackLookup
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName
from tests.shared_data import MOONCAKE_CONVERSATION, shared

A, B = ReplicaName("a"), ReplicaName("b")
KEYS = [BlockKey(100 + n) for n in range(8)]
BLOCK = 16


def indexed(*replicas: ReplicaName) -> PrefixIndex:
    index = PrefixIndex()
    for replica in replicas:
        index.store_keys(replica, [EngineBlockHash(k) for k in KEYS], KEYS)
    return index


def test_no_feedback_no_change() -> None:
    lookup = FeedbackLookup(indexed(A, B))
    assert {r: m.blocks for r, m in lookup.longest_prefixes(KEYS, 0.0).items()} == {A: 8, B: 8}


def test_a_short_hit_marks_the_first_missing_block_suspect_until_stored_again() -> None:
    lookup = FeedbackLookup(indexed(A, B), FeedbackConfig(trust=False))
    lookup.observe(A, KEYS, predicted_tokens=8 * BLOCK, actual_tokens=3 * BLOCK + 5, block_size=BLOCK, now=1.0)
    assert lookup.suspects(A) == 1 and lookup.repairs == 1
    found = lookup.longest_prefixes(KEYS, 2.0)
    assert found[A].blocks == 3 and found[B].blocks == 8  # only the replica that missed is repaired
    lookup.on_stored(A, KEYS[3:5], 0.0)
    assert lookup.longest_prefixes(KEYS, 3.0)[A].blocks == 8


def test_suspects_expire() -> None:
    lookup = FeedbackLookup(indexed(A), FeedbackConfig(trust=False, suspect_ttl_s=10.0))
    lookup.observe(A, KEYS, 8 * BLOCK, 0, BLOCK, now=0.0)
    assert A not in lookup.longest_prefixes(KEYS, 5.0)  # no block left to credit
    assert lookup.longest_prefixes(KEYS, 10.0)[A].blocks == 8
    assert lookup.suspects(A) == 0


def test_trust_falls_with_overstated_hits_and_recovers() -> None:
    lookup = FeedbackLookup(indexed(A, B), FeedbackConfig(repair=False, trust_alpha=0.5, min_trust=0.25))
    for _ in range(10):
        lookup.observe(A, KEYS, 8 * BLOCK, 0, BLOCK, now=0.0)
    assert lookup.trust(A) == 0.25 and lookup.trust(B) == 1.0
    assert lookup.longest_prefixes(KEYS, 0.0)[A].blocks == 2  # 8 blocks x 0.25
    for _ in range(10):
        lookup.observe(A, KEYS, 8 * BLOCK, 8 * BLOCK, BLOCK, now=1.0)
    assert lookup.trust(A) > 0.99
    lookup.forget(A)
    assert lookup.trust(A) == 1.0


def test_requests_without_a_prediction_teach_nothing() -> None:
    lookup = FeedbackLookup(indexed(A))
    lookup.observe(A, KEYS, 0, 5 * BLOCK, BLOCK, now=0.0)
    assert lookup.trust(A) == 1.0 and lookup.suspects(A) == 0


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        FeedbackConfig(trust_alpha=0.0)


def test_replay_with_lost_removals_feedback_keeps_the_prediction_honest() -> None:
    from kvrouter.config import Settings
    from kvrouter.policies.kv_aware import KvAwarePolicy
    from kvrouter.replay.driver import ReplayOptions, VirtualClock, replay_policy
    from kvrouter.replay.prompts import PromptCatalog
    from kvrouter.replay.report import summarize
    from kvrouter.replay.trace import load_trace
    from kvrouter.sim.mocker import DynamoMockerEngine

    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=3.0, limit=1200)
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]

    def run(feedback: bool) -> dict[str, float]:
        clock = VirtualClock()
        result = replay_policy(
            requests=trace.requests,
            prompts=prompts,
            catalog=catalog,
            policy=KvAwarePolicy.from_settings(Settings(), clock=clock),
            engine_factory=DynamoMockerEngine,
            options=ReplayOptions(lost_removals=1.0, feedback=feedback),
            clock=clock,
        )
        summary = summarize(result)
        return {"gap": summary["predicted_hit_rate"] - summary["hit_rate"], "hit": summary["hit_rate"]}

    plain, corrected = run(False), run(True)
    assert plain["gap"] > 0.005  # engine-0's index keeps evicted blocks: the router over-predicts
    assert abs(corrected["gap"]) < plain["gap"] * 0.8


def test_suspects_are_bounded_per_replica() -> None:
    """A suspect no lookup meets again would stay forever: past max_suspects the expired, then the oldest, go."""

    lookup = FeedbackLookup(PrefixIndex(), FeedbackConfig(max_suspects=100, suspect_ttl_s=10.0))
    replica = ReplicaName("r")
    for n in range(1000):
        keys = [BlockKey(10_000 + 2 * n), BlockKey(10_001 + 2 * n)]
        lookup.observe(replica, keys, predicted_tokens=32, actual_tokens=0, block_size=16, now=float(n) / 100)
    assert lookup.suspects(replica) == 100
    assert lookup.repairs == 1000
    # The newest are kept: the last misprediction's first block is still suspect.
    assert BlockKey(10_000 + 2 * 999) in lookup._suspects[replica]
