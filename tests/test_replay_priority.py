"""Engines scheduling by priority in the replay (`--scheduling-policy`): fcfs replays are what they were before the
policy existed, and priority engines serve the urgent band first without losing the others."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from kvrouter.config import Settings
from kvrouter.flow.settings import FlowConfig
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, ReplayResult, VirtualClock, replay_policy
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.tenancy import Assigned, Tenancy, assign
from kvrouter.replay.trace import load_trace
from kvrouter.sim.engine import SchedulerConfig, VllmEngine
from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from kvrouter.sim.model import EngineModel, SchedulingPolicy
from kvrouter.sim.profiles import get_profile
from tests.shared_data import MOONCAKE_CONVERSATION, shared


@pytest.fixture(scope="module")
def assigned() -> Assigned:
    """600 conversation requests at x8 on two small engines (preemptions happen), 20% in the high band."""
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=8.0, limit=600)
    return assign(trace, Tenancy(priority_share=0.2, seed=0))


def engines(kind: str, policy: SchedulingPolicy) -> Callable[[], EngineModel]:
    if kind == "mocker":
        return lambda: DynamoMockerEngine(MockerConfig(num_blocks=3000, policy=policy))
    profile = get_profile("b200x4-moe-1t")
    return lambda: VllmEngine(SchedulerConfig(num_blocks=12_000, block_size=16, policy=policy), profile)


def replay_on(
    assigned: Assigned, block_size: int, engine_factory: Callable[[], EngineModel], flow: FlowConfig | None
) -> ReplayResult:
    """kv_aware on two engines of `engine_factory`, the trace's blocks cut at the engines' `block_size`."""
    catalog = PromptCatalog(trace_block_tokens=assigned.trace.block_tokens, block_size=block_size)
    prompts = [catalog.prepare(request) for request in assigned.trace.requests]
    clock = VirtualClock()
    return replay_policy(
        requests=assigned.trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=replay_policy_object("kv_aware", Settings(), clock),
        engine_factory=engine_factory,
        options=ReplayOptions(replicas=2, flow=flow, urgent=assigned.urgent),
        clock=clock,
    )


def replay(assigned: Assigned, kind: str, policy: SchedulingPolicy, flow: FlowConfig | None) -> ReplayResult:
    return replay_on(assigned, 64 if kind == "mocker" else 16, engines(kind, policy), flow)


def digest(result: ReplayResult) -> str:
    rows = (
        f"{r.index},{r.replica},{r.first_token!r},{r.finish!r},{r.cached_tokens},{r.preemptions},{r.rejected}"
        for r in result.records
    )
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


# Every request's replica, first token, finish, cached tokens, preemptions and refusal, replayed by the code before
# the scheduling policy existed (the same commands at the parent of the commit that added it).
BEFORE = {
    ("mocker", False): "0b90823d499fdd05",
    ("mocker", True): "1961e9ae1a022b14",
    ("vllm", False): "abf05e048f6dbf19",
    ("vllm", True): "254bfff035beddce",
}


@pytest.mark.parametrize(("kind", "queue"), sorted(BEFORE))
def test_fcfs_replays_are_unchanged(assigned: Assigned, kind: str, queue: bool) -> None:
    # The KV reserve (on by default since) changes routing when bands differ; the digests predate it.
    result = replay(assigned, kind, "fcfs", FlowConfig(band_kv_reserve=False) if queue else None)
    assert digest(result) == BEFORE[kind, queue]
    assert sum(r.preemptions for r in result.records) > 0  # the preemption path ran


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def ttfts(result: ReplayResult, band: str) -> list[float]:
    return [r.first_token - r.arrival for r in result.records if r.band == band and r.first_token is not None]


@pytest.mark.parametrize("kind", ["mocker", "vllm"])
def test_priority_engines_serve_the_urgent_band_first_and_finish_everyone(assigned: Assigned, kind: str) -> None:
    # No router queue: the engines' own queues grow (x8 on two engines), so their order decides who waits.
    fcfs = replay(assigned, kind, "fcfs", None)
    prio = replay(assigned, kind, "priority", None)
    for result in (fcfs, prio):
        assert all(r.first_token is not None and r.finish is not None for r in result.records)
    assert p99(ttfts(prio, "high")) < 0.5 * p99(ttfts(fcfs, "high"))
    urgent_preempted = sum(r.preemptions for r in prio.records if r.band == "high")
    assert urgent_preempted <= sum(r.preemptions for r in fcfs.records if r.band == "high")
    assert p99(ttfts(prio, "normal")) >= p99(ttfts(fcfs, "normal")) * 0.9  # the others pay for it, not less


def full_size(assigned: Assigned, flow: FlowConfig) -> ReplayResult:
    """Two engines of the mocker's full size (16,384 blocks): busy on prefill rather than out of KV."""
    return replay_on(assigned, 64, lambda: DynamoMockerEngine(MockerConfig()), flow)


def test_band_headroom_keeps_room_for_the_urgent_band_and_changes_nothing_in_one_band() -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=3.0, limit=600)
    assigned = assign(trace, Tenancy(priority_share=0.2, seed=0))
    held = full_size(assigned, FlowConfig(band_headroom=True, band_kv_reserve=False))
    plain = full_size(assigned, FlowConfig(band_kv_reserve=False))
    # The normal band no longer fills the high band's share of the budget: the high band waits less.
    assert p99(ttfts(held, "high")) < 0.9 * p99(ttfts(plain, "high"))
    high_wait = [sum(r.queued_s for r in result.records if r.band == "high") for result in (held, plain)]
    assert high_wait[0] < high_wait[1]
    for result in (held, plain):  # nothing starves: every request is served
        assert all(r.finish is not None for r in result.records)
    one_band = assign(trace, Tenancy(seed=0))
    on = full_size(one_band, FlowConfig(band_headroom=True, band_kv_reserve=False))
    assert digest(on) == digest(full_size(one_band, FlowConfig(band_kv_reserve=False)))


def test_the_kv_reserve_shortens_the_urgent_bands_wait_for_blocks() -> None:
    # Two full-size engines at x3.0 of 1,200 requests: KV runs out, and the high band's large prompts would wait
    # for blocks at the head of an engine's queue.
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=3.0, limit=1200)
    assigned = assign(trace, Tenancy(priority_share=0.2, seed=0))
    kept = full_size(assigned, FlowConfig())
    plain = full_size(assigned, FlowConfig(band_kv_reserve=False))
    assert p99(ttfts(kept, "high")) < 0.8 * p99(ttfts(plain, "high"))
    for result in (kept, plain):  # nothing starves: every request is served or refused within its TTL
        assert all(r.finish is not None or r.rejected is not None for r in result.records)
        assert all(r.queued_s <= 60.0 + 1e-6 for r in result.records)
    one_band = assign(trace, Tenancy(seed=0))
    on = full_size(one_band, FlowConfig())
    assert digest(on) == digest(full_size(one_band, FlowConfig(band_kv_reserve=False)))
