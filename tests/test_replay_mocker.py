"""The Dynamo 1.6.1 mocker reproduction: pass timing, admission, prefix hits, eviction order, preemption."""

from __future__ import annotations

import pytest

from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from kvrouter.sim.model import EngineRequest, RemovedBlocks, StepResult, StoredBlocks
from kvrouter.sim.profiles import build_engine, get_profile


def prefill_ms(tokens: int) -> float:
    return 4.209989e-7 * tokens * tokens + 1.518344e-2 * tokens + 16.50142


def decode_ms(length_sum: int, blocks: int = 16_384, size: int = 64) -> float:
    u = min(1.0, length_sum / (blocks * size))
    return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


def request(rid: str, prompt: int, hashes: list[int], max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(rid, prompt, hashes, max_tokens, 0.0)


def chain(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def run_until_idle(engine: DynamoMockerEngine) -> list[StepResult]:
    results = []
    while engine.has_work():
        results.append(engine.step(0.0))
        assert len(results) < 10_000
    return results


def test_profile_builds_the_mocker() -> None:
    engine = build_engine(get_profile("dynamo-mocker"))
    assert isinstance(engine, DynamoMockerEngine)
    assert engine.block_size == 64


def test_first_pass_of_a_full_budget_matches_dynamo() -> None:
    # Dynamo's first pass of the conversation trace: 8,192 prompt tokens, nobody decoding -> 169.137 ms.
    engine = DynamoMockerEngine()
    engine.add(request("a", 6758, chain(0, 105)))
    engine.add(request("b", 7322, chain(1000, 114)))
    result = engine.step(0.0)
    assert result.duration * 1000 == pytest.approx(169.137, abs=1e-3)
    assert result.first_tokens == ["a"]  # b is chunked: 8192 - 6758 tokens computed so far
    second = engine.step(result.duration)
    assert "b" in second.first_tokens
    # b's remaining 5,888 tokens and a's first decode token (a's length 6,759 counts in u).
    assert second.duration * 1000 == pytest.approx(prefill_ms(7322 - (8192 - 6758)) + decode_ms(6759), rel=1e-6)


def test_integer_means_over_prefilling_requests() -> None:
    engine = DynamoMockerEngine()
    for rid, size in (("a", 100), ("b", 101), ("c", 103)):
        engine.add(request(rid, size, []))
    result = engine.step(0.0)
    # T = n * (floor(sum prompt / n) - floor(sum cached / n)) = 3 * 101
    assert result.duration * 1000 == pytest.approx(prefill_ms(303))


def test_decoding_until_max_tokens() -> None:
    engine = DynamoMockerEngine()
    engine.add(request("a", 640, chain(0, 10), max_tokens=3))
    results = run_until_idle(engine)
    assert [r.first_tokens for r in results] == [["a"], [], []]
    assert [len(r.tokens) for r in results] == [1, 1, 1]
    assert results[-1].finished == ["a"]
    assert results[1].duration * 1000 == pytest.approx(decode_ms(641))
    assert results[2].duration * 1000 == pytest.approx(decode_ms(642))


def test_prefix_hits_are_capped_and_reported() -> None:
    engine = DynamoMockerEngine()
    engine.add(request("a", 640, chain(0, 10), max_tokens=1))
    run_until_idle(engine)
    # Same 10 blocks, prompt exactly 640 tokens: at most (640 - 1) // 64 = 9 blocks count as a hit.
    engine.add(request("b", 640, chain(0, 10), max_tokens=1))
    assert engine.step(0.0).cached_tokens == {"b": 576}
    # A longer prompt over the same prefix hits all 10.
    engine.add(request("c", 700, chain(0, 10), max_tokens=1))
    result = engine.step(0.0)
    assert result.cached_tokens == {"c": 640}
    assert result.duration * 1000 == pytest.approx(prefill_ms(60))
    gauges = engine.gauges()
    assert (gauges.prefix_queries, gauges.prefix_hits) == (640 * 2 + 700, 576 + 640)


def test_blocks_computed_in_a_pass_are_hit_later_in_the_same_pass() -> None:
    engine = DynamoMockerEngine()
    engine.add(request("a", 1280, chain(0, 20), max_tokens=1))
    engine.add(request("b", 1300, chain(0, 20), max_tokens=1))
    result = engine.step(0.0)
    assert result.cached_tokens == {"a": 0, "b": 1280}
    stored = [e for e in result.events if isinstance(e, StoredBlocks)]
    assert [h for e in stored for h in e.block_hashes] == chain(0, 20)


def test_chunked_prefill_blocks_become_hittable_as_they_are_computed() -> None:
    engine = DynamoMockerEngine()
    engine.add(request("a", 20_000, chain(0, 312), max_tokens=1))
    engine.step(0.0)  # 8,192 tokens = 128 blocks computed
    engine.add(request("b", 20_000, chain(0, 312), max_tokens=1))
    engine.step(0.0)  # a continues (blocks 128..255); b waits: no budget left
    result = engine.step(0.0)  # a finishes (3,616 tokens), b is admitted and hits everything a registered
    assert result.cached_tokens == {"b": (20_000 - 1) // 64 * 64}


def test_admission_needs_the_whole_prompt_and_is_strictly_fcfs() -> None:
    engine = DynamoMockerEngine(MockerConfig(num_blocks=20))
    engine.add(request("a", 64 * 12, chain(0, 12), max_tokens=50))
    engine.step(0.0)
    engine.add(request("big", 64 * 10, chain(100, 10), max_tokens=1))
    engine.add(request("small", 64, chain(200, 1), max_tokens=1))
    result = engine.step(0.0)
    # 20 - 13 (a's 12 blocks + its decode block) = 7 free: big (10) waits and small may not jump the queue.
    assert result.cached_tokens == {}
    assert engine.gauges().num_waiting == 2


def test_eviction_uses_free_space_first_then_lru_last_block_first() -> None:
    engine = DynamoMockerEngine(MockerConfig(num_blocks=8))
    engine.add(request("a", 64 * 4, chain(0, 4), max_tokens=1))
    run_until_idle(engine)
    engine.add(request("b", 64 * 2, chain(10, 2), max_tokens=1))
    result = engine.step(0.0)
    # b's 2 blocks fit in the 4 never-used ones: nothing is evicted while free space remains.
    assert not [e for e in result.events if isinstance(e, RemovedBlocks)]
    engine.add(request("c", 64 * 4, chain(20, 4), max_tokens=1))
    result = engine.step(0.0)
    removed = [h for e in result.events if isinstance(e, RemovedBlocks) for h in e.block_hashes]
    # 2 free slots left, 2 more come from the LRU: a's blocks, its last block first.
    assert removed == [3, 2]


def test_preemption_of_the_newest_running_request() -> None:
    engine = DynamoMockerEngine(MockerConfig(num_blocks=6))
    engine.add(request("old", 64 * 2, chain(0, 2), max_tokens=200))
    engine.add(request("new", 64 * 2, chain(10, 2), max_tokens=200))
    first = engine.step(0.0)
    assert first.first_tokens == ["old", "new"]
    preempted: list[str] = []
    for _ in range(300):
        result = engine.step(0.0)
        preempted += result.preempted
        if preempted:
            break
    assert preempted == ["new"]
    results = run_until_idle(engine)
    finished = [rid for r in results for rid in r.finished]
    assert sorted(finished) == ["new", "old"]


def test_speedup_divides_pass_time() -> None:
    engine = DynamoMockerEngine(MockerConfig(speedup=4.0))
    engine.add(request("a", 8192, chain(0, 128), max_tokens=1))
    assert engine.step(0.0).duration * 1000 == pytest.approx(prefill_ms(8192) / 4)


def test_abort_frees_blocks() -> None:
    engine = DynamoMockerEngine(MockerConfig(num_blocks=10))
    engine.add(request("a", 64 * 5 + 3, chain(0, 5), max_tokens=100))
    engine.step(0.0)
    assert engine.gauges().kv_usage == pytest.approx(6 / 10)
    engine.abort("a")
    assert not engine.has_work()
    assert engine.gauges().kv_usage == 0
    assert engine.reset_prefix_cache()
