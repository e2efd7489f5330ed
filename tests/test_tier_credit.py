"""Offload tiers: blocks the engine holds in CPU memory or storage are credited by what loading them costs.

The index reports where each replica's prefix lives (GPU, then CPU, then storage), the router turns it into the
candidate's tier split in tokens, and kv_aware credits CPU tokens at `cpu_tier_credit` and storage tokens at
`storage_tier_credit` of a GPU hit: between replicas that hold the same prefix, the faster tier wins; an
offloaded prefix still beats none."""

from __future__ import annotations

import pytest

from kvrouter.blocks import chain_keys
from kvrouter.blocktable import Backend, load_backend, pure_backend
from kvrouter.index import PrefixIndex
from kvrouter.policies.base import Candidate, ReplicaLoad, RouteRequest
from kvrouter.policies.kv_aware import KvAwareConfig, KvAwarePolicy
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import PrefixMatch, Route, Router, RoutingFacts
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

GPU_R, CPU_R, DISK_R, COLD = (ReplicaName(n) for n in ("gpu", "cpu", "disk", "cold"))
BLOCK = 16
PROMPT = list(range(1, 16 * BLOCK + 1))  # 16 blocks; the engine's rule credits 15
KEYS = chain_keys(PROMPT, BLOCK)


def hashes(keys: list[BlockKey], base: int) -> list[EngineBlockHash]:
    return [EngineBlockHash(base + n) for n in range(len(keys))]


def store(index: PrefixIndex, replica: ReplicaName, keys: list[BlockKey], tier: Tier, base: int) -> None:
    index.store_keys(replica, hashes(keys, base), keys, tier)


def policy() -> KvAwarePolicy:
    # Pinned costs and weight, so the scores are plain arithmetic.
    config = KvAwareConfig(prefill_tokens_per_s=1_000.0, decode_pass_s=0.0, cache_weight=1.0, calibrate=False)
    return KvAwarePolicy(config, clock=lambda: 0.0)


def router(index: PrefixIndex, chosen_by: KvAwarePolicy) -> Router:
    return Router(policy=chosen_by, load=LoadBook(), index=index, clock=lambda: 0.0)


def routes(*names: ReplicaName) -> list[Route]:
    return [Route(name, BLOCK) for name in names]


@pytest.mark.parametrize("backend", [load_backend(), pure_backend()], ids=lambda b: b.name)
def test_index_reports_where_each_replica_holds_the_prefix(backend: Backend) -> None:
    index = PrefixIndex(backend=backend)
    store(index, GPU_R, KEYS, Tier.GPU, 0)
    store(index, CPU_R, KEYS[:4], Tier.GPU, 100)
    store(index, CPU_R, KEYS[4:], Tier.CPU, 200)
    store(index, DISK_R, KEYS[:4], Tier.GPU, 300)
    store(index, DISK_R, KEYS[4:8], Tier.CPU, 400)
    store(index, DISK_R, KEYS[8:], Tier.STORAGE, 500)
    found = index.longest_prefixes(KEYS, 0.0)
    assert found[GPU_R] == PrefixMatch(16, 16)
    assert found[CPU_R] == PrefixMatch(16, 4)  # no storage blocks on this replica: host = all of it
    assert found[DISK_R] == PrefixMatch(16, 4, 8)
    assert found[DISK_R].tier_blocks(15) == (4, 4, 7)
    assert found[CPU_R].tier_blocks(15) == (4, 11, 0)
    assert found[GPU_R].tier_blocks(15) == (15, 0, 0)


@pytest.mark.parametrize("backend", [load_backend(), pure_backend()], ids=lambda b: b.name)
def test_a_gpu_block_after_an_offloaded_one_is_loaded_too(backend: Backend) -> None:
    # vLLM takes the GPU prefix hit, then asks its connector for what follows: a later GPU block is not a GPU hit.
    index = PrefixIndex(backend=backend)
    store(index, CPU_R, KEYS[:2], Tier.GPU, 0)
    store(index, CPU_R, KEYS[2:4], Tier.CPU, 100)
    store(index, CPU_R, KEYS[4:], Tier.GPU, 200)
    match = index.longest_prefixes(KEYS, 0.0)[CPU_R]
    assert (match.blocks, match.gpu_blocks) == (16, 2)
    assert match.tier_blocks(15) == (2, 13, 0)


def test_cut_keeps_the_tier_split_inside_the_shorter_match() -> None:
    assert PrefixMatch(16, 4, 8).cut(6) == PrefixMatch(6, 4, 6)
    assert PrefixMatch(16, 4, 8).cut(3) == PrefixMatch(3, 3, 3)
    assert PrefixMatch(16, 16).cut(5) == PrefixMatch(5, 5)


def test_candidates_carry_the_tier_split_in_tokens() -> None:
    index = PrefixIndex()
    store(index, DISK_R, KEYS[:4], Tier.GPU, 0)
    store(index, DISK_R, KEYS[4:8], Tier.CPU, 100)
    store(index, DISK_R, KEYS[8:], Tier.STORAGE, 200)
    (candidate,) = router(index, policy()).candidates(RoutingFacts([PROMPT]), routes(DISK_R))
    assert candidate.cached_tokens == 15 * BLOCK  # what the engine reports cached: every tier counts
    assert (candidate.cpu_tokens, candidate.storage_tokens) == (4 * BLOCK, 7 * BLOCK)


def test_gpu_beats_cpu_beats_storage_beats_nothing() -> None:
    index = PrefixIndex()
    store(index, GPU_R, KEYS, Tier.GPU, 0)
    store(index, CPU_R, KEYS, Tier.CPU, 100)
    store(index, DISK_R, KEYS, Tier.STORAGE, 200)
    kv = policy()
    routing = router(index, kv)
    facts = RoutingFacts([PROMPT])
    everyone = (GPU_R, CPU_R, DISK_R, COLD)
    assert routing.decide(facts, routes(*everyone)).chosen == GPU_R
    assert routing.decide(facts, routes(CPU_R, DISK_R, COLD)).chosen == CPU_R
    assert routing.decide(facts, routes(DISK_R, COLD)).chosen == DISK_R
    scores = {s.replica: s for s in routing.decide(facts, routes(*everyone)).candidates}
    assert scores[GPU_R].score < scores[CPU_R].score < scores[DISK_R].score < scores[COLD].score
    cached = 15 * BLOCK
    cpu = scores[CPU_R].breakdown
    assert (cpu["gpu_cached_tokens"], cpu["cpu_cached_tokens"], cpu["storage_cached_tokens"]) == (0, cached, 0)
    assert cpu["tier_load_tokens"] == pytest.approx(0.25 * cached)
    assert cpu["cache_credit_tokens"] == pytest.approx(0.75 * cached)
    assert cpu["uncached_tokens"] == pytest.approx(len(PROMPT) - 0.75 * cached)
    disk = scores[DISK_R].breakdown
    assert disk["storage_cached_tokens"] == cached
    assert disk["tier_load_tokens"] == pytest.approx(0.75 * cached)
    gpu = scores[GPU_R].breakdown
    assert (gpu["gpu_cached_tokens"], gpu["tier_load_tokens"]) == (cached, 0.0)


def test_a_cheaper_queue_can_outweigh_a_gpu_hit_over_a_cpu_one() -> None:
    # The CPU-tier replica's load cost (0.25 x 1,000 tokens = 0.25 s) is less than the GPU one's queue (0.5 s).
    kv = policy()
    request = RouteRequest(prompt_tokens=1_100)
    gpu = Candidate(GPU_R, 1_000, ReplicaLoad(in_flight=1, pending_prefill_tokens=500))
    cpu = Candidate(CPU_R, 1_000, ReplicaLoad(), cpu_tokens=1_000)
    assert kv.select(request, [gpu, cpu]).chosen == CPU_R
    busier = Candidate(GPU_R, 1_000, ReplicaLoad(in_flight=1, pending_prefill_tokens=200))
    assert kv.select(request, [busier, cpu]).chosen == GPU_R


def test_tier_credits_are_settings() -> None:
    kv = KvAwarePolicy(
        KvAwareConfig(cpu_tier_credit=1.0, storage_tier_credit=1.0, calibrate=False, cache_weight=1.0),
        clock=lambda: 0.0,
    )
    request = RouteRequest(prompt_tokens=1_100)
    (score,) = kv.select(request, [Candidate(CPU_R, 1_000, ReplicaLoad(), cpu_tokens=600)]).candidates
    assert score.breakdown["tier_load_tokens"] == 0.0
    with pytest.raises(ValueError):
        KvAwareConfig(cpu_tier_credit=1.5)
