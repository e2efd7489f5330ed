"""A request whose prompt KV was transferred (a disaggregated decode leg), in both engine models, and the profiles'
KV-transfer cost. Virtual time, no event loop."""

from __future__ import annotations

import pytest

from kvrouter.sim.engine import SchedulerConfig, VllmEngine
from kvrouter.sim.hashing import label_hashes
from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from kvrouter.sim.model import EngineModel, EngineRequest, StepResult, StoredBlocks
from kvrouter.sim.profiles import PROFILES, KvTransfer, get_profile


class FixedTiming:
    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, attention: float) -> float:
        return 0.01 + 0.001 * prefill_tokens


def vllm(num_blocks: int = 64, block_size: int = 16) -> VllmEngine:
    return VllmEngine(SchedulerConfig(num_blocks=num_blocks, block_size=block_size), FixedTiming())


def mocker(num_blocks: int = 64, block_size: int = 16) -> DynamoMockerEngine:
    return DynamoMockerEngine(MockerConfig(num_blocks=num_blocks, block_size=block_size))


def leg(rid: str, prompt: int, max_tokens: int, *, transferred: bool, first_label: int = 0) -> EngineRequest:
    hashes = label_hashes([first_label + i for i in range(prompt // 16)])
    return EngineRequest(rid, prompt, hashes, max_tokens, 0.0, kv_transferred=transferred)


def stored(result: StepResult) -> list[int]:
    return [h for event in result.events if isinstance(event, StoredBlocks) for h in event.block_hashes]


@pytest.mark.parametrize("build", [vllm, mocker], ids=["vllm", "dynamo-mocker"])
def test_a_transferred_prompt_gives_its_first_token_in_its_first_pass(build: type[EngineModel]) -> None:
    engine = build()
    engine.add(leg("t", 400, 3, transferred=True))
    first = engine.step(0.0)
    assert first.first_tokens == ["t"] and first.tokens == ["t"]
    # Every full prompt block is stored in that first pass, as vLLM caches the blocks it pulled.
    assert stored(first) == list(label_hashes(list(range(25))))
    assert first.cached_tokens == {"t": 0}  # local prefix hits only: nothing was cached here before
    finished: list[str] = []
    tokens = 1
    while engine.has_work():
        result = engine.step(0.0)
        finished += result.finished
        tokens += result.tokens.count("t")
    assert finished == ["t"] and tokens == 3


def test_vllm_engine_charges_one_prefill_token_for_a_transferred_prompt() -> None:
    engine = vllm()
    engine.add(leg("t", 400, 2, transferred=True))
    assert engine.step(0.0).duration == pytest.approx(0.01 + 0.001 * 1)
    plain = vllm()
    plain.add(leg("p", 400, 2, transferred=False))
    assert plain.step(0.0).duration == pytest.approx(0.01 + 0.001 * 400)


def test_mocker_charges_one_prefill_token_for_a_transferred_prompt() -> None:
    config = MockerConfig(num_blocks=64, block_size=16)
    engine = DynamoMockerEngine(config)
    engine.add(leg("t", 400, 2, transferred=True))
    one = config.prefill_quadratic + config.prefill_linear + config.prefill_constant
    assert engine.step(0.0).duration == pytest.approx(one / 1000)


@pytest.mark.parametrize("build", [vllm, mocker], ids=["vllm", "dynamo-mocker"])
def test_local_prefix_hits_still_count_and_are_reported(build: type[EngineModel]) -> None:
    engine = build()
    engine.add(leg("warm", 160, 1, transferred=False))
    while engine.has_work():
        engine.step(0.0)
    engine.add(leg("t", 400, 2, transferred=True))
    result = engine.step(0.0)
    assert result.cached_tokens == {"t": 160} and result.first_tokens == ["t"]
    assert stored(result) == list(label_hashes(list(range(25))))[10:]  # the ten warm blocks were there already
    gauges = engine.gauges()
    assert gauges.prefix_queries == 160 + 400 and gauges.prefix_hits == 160


@pytest.mark.parametrize("build", [vllm, mocker], ids=["vllm", "dynamo-mocker"])
def test_a_transferred_prompt_still_needs_blocks_for_all_of_it(build: type[EngineModel]) -> None:
    engine = build(num_blocks=30)  # type: ignore[call-arg]
    engine.add(leg("big", 320, 50, transferred=False, first_label=1000))  # holds 20 of the 30 blocks
    engine.step(0.0)
    engine.add(leg("t", 400, 2, transferred=True))  # needs 25 blocks: waits
    result = engine.step(0.0)
    assert "t" not in result.first_tokens and engine.gauges().num_waiting == 1


def test_a_preempted_transferred_request_recomputes_its_prompt() -> None:
    engine = vllm(num_blocks=30)
    engine.add(leg("x", 16, 150, transferred=False, first_label=5000))
    engine.step(0.0)
    engine.add(leg("t", 400, 60, transferred=True))  # the newest: the one preempted when blocks run out
    first = engine.step(0.0)
    assert first.first_tokens == ["t"] and first.duration == pytest.approx(0.01 + 0.001 * 1)
    preempted: list[str] = []
    durations: list[float] = []
    while engine.has_work():
        result = engine.step(0.0)
        preempted += result.preempted
        durations.append(result.duration)
    assert "t" in preempted
    # Back in, it computes what its evicted blocks held (its transfer is gone), not a single token.
    assert max(durations) > 0.01 + 0.001 * 16


def test_profiles_derive_the_transfer_from_the_model_shape() -> None:
    b200 = get_profile("b200x4-moe-1t")
    assert b200.kv_transfer.bytes_per_token == 576 * 2 * 61  # the MLA latent, bf16, 61 layers
    assert get_profile("dynamo-mocker").kv_transfer == b200.kv_transfer
    assert get_profile("h100x4-70b").kv_transfer.bytes_per_token == 80 * 2 * 8 * 128 * 2 // 4
    link = KvTransfer(bytes_per_token=1000, link_bytes_per_s=1e9, latency_s=0.002)
    assert link.seconds(0) == 0.002 and link.seconds(8000) == pytest.approx(0.002 + 0.008)
    for profile in PROFILES.values():
        # An 8k prompt moves in far less time than the profile takes to prefill it.
        assert profile.kv_transfer.seconds(8192) < 8192 * profile.per_token_s
