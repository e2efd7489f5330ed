"""vLLM's priority scheduling policy in both engine models: the waiting order and the preemption victim
(kvrouter.sim.waiting), against fcfs on the same requests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvrouter.sim.engine import SchedulerConfig, VllmEngine
from kvrouter.sim.hashing import label_hashes
from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from kvrouter.sim.model import EngineModel, EngineRequest, SchedulingPolicy
from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.sim.waiting import FcfsWaiting, OrderKey, PriorityWaiting, order_key, priority_victim, waiting_queue


class FixedTiming:
    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, attention: float) -> float:
        return 0.01 + 0.001 * prefill_tokens


def request(
    rid: str, prompt_len: int, max_tokens: int, *, priority: int = 0, arrival: float = 0.0, block_size: int = 16
) -> EngineRequest:
    base = sum(ord(c) << (8 * i) for i, c in enumerate(rid)) * 1000
    hashes = label_hashes([base + i for i in range(prompt_len // block_size)])
    return EngineRequest(rid, prompt_len, hashes, max_tokens, arrival, priority=priority)


def vllm(policy: SchedulingPolicy, *, num_blocks: int = 64, max_seqs: int = 256) -> VllmEngine:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=max_seqs, policy=policy)
    return VllmEngine(config, FixedTiming())


def mocker(policy: SchedulingPolicy, *, num_blocks: int = 64, max_seqs: int = 256) -> DynamoMockerEngine:
    return DynamoMockerEngine(MockerConfig(num_blocks=num_blocks, block_size=16, max_seqs=max_seqs, policy=policy))


def drain(engine: EngineModel) -> tuple[list[str], dict[str, int]]:
    """First tokens in order, and how often each request was preempted."""
    firsts: list[str] = []
    preempted: dict[str, int] = {}
    now = 0.0
    for _ in range(10_000):
        if not engine.has_work():
            return firsts, preempted
        result = engine.step(now)
        now += result.duration
        firsts.extend(result.first_tokens)
        for rid in result.preempted:
            preempted[rid] = preempted.get(rid, 0) + 1
    raise AssertionError("engine did not drain")


# -- the queues ----------------------------------------------------------------------------------------------


def received_order(items: list[EngineRequest]) -> Callable[[EngineRequest], OrderKey]:
    """The key of a queue whose items were received in the order of `items`."""
    numbers = {item.request_id: number for number, item in enumerate(items)}
    return lambda item: order_key(item, numbers[item.request_id])


def test_priority_queue_orders_by_priority_then_arrival_then_the_order_received() -> None:
    items = [
        request("late-normal", 16, 1, arrival=2.0),
        request("low", 16, 1, priority=1, arrival=0.0),
        request("b-high", 16, 1, priority=-1, arrival=3.0),
        request("a-high", 16, 1, priority=-1, arrival=3.0),
        request("early-normal", 16, 1, arrival=1.0),
    ]
    queue: PriorityWaiting[EngineRequest] = PriorityWaiting(received_order(items))
    for item in items:
        queue.add(item)
    assert queue.head().request_id == "b-high"
    order = [queue.take().request_id for _ in range(len(queue))]
    # Equal priority and arrival: the one received first (not the smaller id), as vLLM's float clock would order them.
    assert order == ["b-high", "a-high", "early-normal", "late-normal", "low"]
    assert not queue


def test_a_preempted_request_goes_back_by_its_order_under_priority_and_to_the_head_under_fcfs() -> None:
    old_low = request("old-low", 16, 1, priority=1, arrival=0.0)
    new_high = request("new-high", 16, 1, priority=-1, arrival=5.0)
    prio: PriorityWaiting[EngineRequest] = PriorityWaiting(received_order([new_high, old_low]))
    prio.add(new_high)
    prio.put_back(old_low)
    assert prio.head() is new_high  # not the head: an urgent request stays in front of it
    fcfs: FcfsWaiting[EngineRequest] = FcfsWaiting()
    fcfs.add(new_high)
    fcfs.put_back(old_low)
    assert fcfs.head() is old_low
    prio.remove(new_high)
    assert prio.head() is old_low and len(prio) == 1
    with pytest.raises(ValueError):
        prio.remove(new_high)


def test_the_victim_is_the_least_urgent_then_newest() -> None:
    running = [
        request("high", 16, 1, priority=-1, arrival=9.0),
        request("low-old", 16, 1, priority=1, arrival=1.0),
        request("low-new", 16, 1, priority=1, arrival=2.0),
        request("low-new-twin", 16, 1, priority=1, arrival=2.0),
        request("normal", 16, 1, arrival=8.0),
    ]
    assert priority_victim(running, received_order(running)).request_id == "low-new-twin"  # received later


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        waiting_queue("lifo", received_order([]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scheduling policy"):
        build_engine(get_profile("cpu-tiny"), scheduling_policy="lifo")  # type: ignore[arg-type]


# -- the engines ---------------------------------------------------------------------------------------------

Build = Callable[..., EngineModel]
ENGINES = [pytest.param(vllm, id="vllm"), pytest.param(mocker, id="dynamo-mocker")]


@pytest.mark.parametrize("build", ENGINES)
def test_the_waiting_queue_admits_urgent_requests_first(build: Build) -> None:
    # One sequence at a time: the order of first tokens is the order of admission.
    requests = [
        request("first", 32, 2, arrival=0.0),
        request("low", 32, 2, priority=1, arrival=0.1),
        request("normal", 32, 2, arrival=0.2),
        request("high", 32, 2, priority=-1, arrival=0.3),
        request("high-late", 32, 2, priority=-1, arrival=0.4),
    ]
    orders = {}
    for policy in ("fcfs", "priority"):
        eng = build(policy, max_seqs=1)
        for item in requests:
            eng.add(item)
        orders[policy] = drain(eng)[0]
    assert orders["fcfs"] == ["first", "low", "normal", "high", "high-late"]
    # "first" was admitted before the others arrived in the queue's view: every request is added before the first
    # pass, so the heap picks the most urgent of all five at once.
    assert orders["priority"] == ["high", "high-late", "first", "normal", "low"]


def _crowded(engine: EngineModel) -> None:
    """A low-priority request admitted first, an urgent one after it: both decode until blocks run out."""
    engine.add(request("low", 64, 200, priority=1, arrival=0.0))
    engine.step(0.0)
    engine.add(request("high", 64, 200, priority=-1, arrival=1.0))


@pytest.mark.parametrize("build", ENGINES)
def test_out_of_blocks_fcfs_preempts_the_newest_and_priority_the_least_urgent(build: Build) -> None:
    # 20 blocks of 16: the two requests (4 prompt blocks + up to 13 output blocks each) cannot both finish.
    preempted = {}
    for policy in ("fcfs", "priority"):
        eng = build(policy, num_blocks=20)
        _crowded(eng)
        preempted[policy] = drain(eng)[1]
    assert preempted["fcfs"].get("high", 0) > 0 and "low" not in preempted["fcfs"]
    assert preempted["priority"].get("low", 0) > 0 and "high" not in preempted["priority"]


def test_a_victim_scheduled_earlier_in_the_pass_gives_its_tokens_back() -> None:
    # vLLM engine, priority: "low" runs first in the batch and is scheduled before "high" needs a block; the
    # preemption takes it out of this pass and its token goes back to the budget (the pass stays consistent).
    eng = vllm("priority", num_blocks=9)
    eng.add(request("low", 64, 40, priority=1, arrival=0.0))
    eng.step(0.0)
    eng.add(request("high", 64, 40, priority=-1, arrival=1.0))
    now = 0.0
    seen_preemption = False
    for _ in range(500):
        if not eng.has_work():
            break
        result = eng.step(now)
        now += result.duration
        if result.preempted:
            seen_preemption = True
            assert result.preempted == ["low"]
            assert "low" not in result.tokens  # preempted before its token: it computed nothing this pass
    assert seen_preemption and not eng.has_work()


@pytest.mark.parametrize("build", ENGINES)
def test_equal_priorities_still_finish_everything(build: Build) -> None:
    eng = build("priority", num_blocks=30)
    for number in range(12):
        eng.add(request(f"r{number}", 48 + 16 * (number % 3), 60, arrival=number * 0.01))
    firsts, _ = drain(eng)
    assert sorted(firsts) == sorted(f"r{number}" for number in range(12))


def test_profiles_carry_the_policy_into_both_engines() -> None:
    vllm_engine = build_engine(get_profile("cpu-tiny"), scheduling_policy="priority")
    mocker_engine = build_engine(get_profile("dynamo-mocker"), scheduling_policy="priority")
    assert isinstance(vllm_engine, VllmEngine) and vllm_engine.config.policy == "priority"
    assert isinstance(mocker_engine, DynamoMockerEngine) and mocker_engine.config.policy == "priority"
    assert isinstance(build_engine(get_profile("cpu-tiny")), VllmEngine)
    default = build_engine(get_profile("dynamo-mocker"))
    assert isinstance(default, DynamoMockerEngine) and default.config.policy == "fcfs"
