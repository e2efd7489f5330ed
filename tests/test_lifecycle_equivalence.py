"""The live router and the replay make the same decisions for the same inputs (issue 19's acceptance).

One scripted sequence — arrivals, each request's time to first token and decode time, and what each engine
reports serving from its cache — drives both: the live router (real sockets, scripted replicas that are real
aiohttp servers gated by the test, the router on an injected clock that the test moves to each scripted instant)
and the replay driver (virtual clock, engines that follow the same script). kv_aware with `kv_tune` and
`kv_feedback` on. Engine-0 reports no cache hit ever (its cache is gone while the router's provisional entries
say otherwise), so the feedback overlay learns and changes later decisions; the others serve the prefix they
really hold. Every decision (chosen replica and the whole per-candidate breakdown), the feedback overlay's trust
and suspects and the tuner's arms must match exactly. Times are multiples of 1/64 s, so both clocks are exact.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.policies.base import Decision
from kvrouter.policies.kv_aware import KvAwarePolicy
from kvrouter.replay.driver import Replay, ReplayOptions, VirtualClock
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.trace import TraceRequest
from kvrouter.routing.feedback import FeedbackLookup
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.router import Router
from kvrouter.server.app import PROXY, ROUTER, create_app
from kvrouter.sim.model import EngineGaugesSnapshot, EngineRequest, StepResult
from kvrouter.typedefs import BlockKey, ReplicaName
from tests.conftest import eventually, router_settings
from tests.fake_replica import FakeReplica
from tests.test_prefix_integration import tokenizer_dir

__all__ = ["tokenizer_dir"]

TICK = 1 / 64
BLOCK = 16
REPLICAS = [ReplicaName(f"engine-{n}") for n in range(3)]
FORGETFUL = REPLICAS[0]
SETTINGS: dict[str, Any] = {
    "policy": "kv_aware",
    "kv_tune": True,
    "kv_feedback": True,
    "provisional_ttl_s": 1.0,
}


@dataclass(frozen=True)
class Step:
    arrival: int
    ttft: int
    decode: int
    """In ticks."""


@dataclass
class Script:
    requests: list[TraceRequest]
    steps: list[Step]
    keys: list[list[BlockKey]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)


def make_script(count: int = 36, seed: int = 7) -> Script:
    """Four multi-turn conversations over a shared system prompt: each turn extends its conversation's chain."""
    rng = random.Random(seed)
    chains: dict[int, list[int]] = {}
    next_id = 100
    requests: list[TraceRequest] = []
    steps: list[Step] = []
    arrival = 2
    for index in range(count):
        group = rng.randrange(4)
        chain = chains.get(group)
        if chain is None or len(chain) >= 14:
            chain = [1, 2]  # the shared system prompt, 2 trace blocks
        chain = [*chain, next_id]
        next_id += 1
        chains[group] = chain
        length = len(chain) * 64 - rng.randrange(0, 40)
        requests.append(TraceRequest(index, arrival * TICK, length, 8, tuple(chain)))
        steps.append(Step(arrival, rng.randrange(1, 9), rng.randrange(4, 24)))
        arrival += rng.randrange(1, 6)
    return Script(requests, steps)


class EngineCaches:
    """What each engine really holds: every prompt it ran, except the forgetful one, which serves nothing."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.held: dict[ReplicaName, set[BlockKey]] = {name: set() for name in REPLICAS}

    def serve(self, replica: ReplicaName, index: int) -> int:
        keys = self.script.keys[index]
        held = self.held[replica]
        blocks = 0
        if replica != FORGETFUL:
            while blocks < len(keys) and keys[blocks] in held:
                blocks += 1
        held.update(keys)
        prompt = self.script.requests[index].input_length
        return min(blocks * BLOCK, (prompt - 1) // BLOCK * BLOCK)


class Recorder:
    """A request listener that keeps every commit's decision (for both sides alike)."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def on_commit(self, routed: Routed) -> None:
        self.decisions.append(routed.decision)

    def on_first_token(self, routed: Routed, now: float) -> None:
        pass

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        pass

    def on_finish(self, routed: Routed, now: float) -> None:
        pass


def listen(router: Router) -> Recorder:
    recorder = Recorder()
    router.listeners = (*router.listeners, recorder)
    return recorder


def state_of(router: Router) -> dict[str, Any]:
    feedback = router.index
    assert isinstance(feedback, FeedbackLookup)
    policy = router.policy
    assert isinstance(policy, KvAwarePolicy) and policy.tuner is not None
    arms = {name: (arm.count, arm.total) for name, arm in policy.tuner._arms.items()}
    return {
        "trust": {name: feedback.trust(name) for name in REPLICAS},
        "suspects": {name: feedback.suspects(name) for name in REPLICAS},
        "repairs": feedback.repairs,
        "arms": arms,
        "weight": policy.tuner.weight,
        "costs": {name: policy.costs(name) for name in REPLICAS},
        "reuse": policy.reuse,
    }


def policy_start(router: Router) -> object:
    policy = router.policy
    assert isinstance(policy, KvAwarePolicy)
    return policy.start_costs


# ---- the replay side ----------------------------------------------------------------------------------------


class ScriptedEngine:
    """An `EngineModel` that runs one-tick passes and emits each request's first token and finish on schedule."""

    block_size = BLOCK
    max_num_seqs = 256

    def __init__(self, name: ReplicaName, script: Script, caches: EngineCaches) -> None:
        self.name = name
        self.script = script
        self.caches = caches
        self.pending: dict[str, tuple[int, int, int]] = {}

    def add(self, request: EngineRequest) -> None:
        index = int(request.request_id)
        step = self.script.steps[index]
        cached = self.caches.serve(self.name, index)
        self.pending[request.request_id] = (step.arrival + step.ttft, step.arrival + step.ttft + step.decode, cached)

    def abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self, now: float) -> StepResult:
        end = round(now / TICK) + 1
        result = StepResult(TICK)
        for request_id, (first, finish, cached) in list(self.pending.items()):
            if first == end:
                result.first_tokens.append(request_id)
                result.tokens.append(request_id)
                result.cached_tokens[request_id] = cached
            if finish == end:
                result.finished.append(request_id)
                del self.pending[request_id]
        return result

    def reset_prefix_cache(self) -> bool:
        return True

    def gauges(self) -> EngineGaugesSnapshot:
        return EngineGaugesSnapshot(0, 0, 0.0, 0, 0)


def run_replay(script: Script, catalog: PromptCatalog, *, feedback: bool = True) -> tuple[list[Decision], Router]:
    caches = EngineCaches(script)
    names = iter(REPLICAS)
    clock = VirtualClock()
    settings = router_settings(**SETTINGS)
    replay = Replay(
        requests=script.requests,
        prompts=[catalog.prepare(request) for request in script.requests],
        catalog=catalog,
        policy=KvAwarePolicy.from_settings(settings, clock=clock),
        engine_factory=lambda: ScriptedEngine(next(names), script, caches),
        options=ReplayOptions(
            replicas=len(REPLICAS), scrape_interval_s=0, provisional_ttl_s=settings.provisional_ttl_s, feedback=feedback
        ),
        clock=clock,
    )
    recorder = listen(replay.router)
    result = replay.run()
    assert all(record.finish is not None for record in result.records)
    return recorder.decisions, replay.router


# ---- the live side ------------------------------------------------------------------------------------------


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ScriptedReplica(FakeReplica):
    """Streams a completion in two steps, each released by the test: the first token, then the rest + usage."""

    caches: EngineCaches | None = None
    received: dict[int, asyncio.Event] = field(default_factory=dict)
    first_gate: dict[int, asyncio.Event] = field(default_factory=dict)
    end_gate: dict[int, asyncio.Event] = field(default_factory=dict)

    def gates(self, index: int) -> tuple[asyncio.Event, asyncio.Event, asyncio.Event]:
        return (
            self.received.setdefault(index, asyncio.Event()),
            self.first_gate.setdefault(index, asyncio.Event()),
            self.end_gate.setdefault(index, asyncio.Event()),
        )

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        assert self.caches is not None
        await request.read()
        index = int(request.headers["x-request-id"].removeprefix("req-"))
        received, first, end = self.gates(index)
        cached = self.caches.serve(ReplicaName(self.name), index)
        received.set()
        await first.wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": f"cmpl-{index}", "object": "text_completion", "created": 0, "model": self.model}
        chunk = {"index": 0, "text": "x", "logprobs": None, "finish_reason": None}
        await response.write(b"data: " + json.dumps({**base, "choices": [chunk]}).encode() + b"\n\n")
        await end.wait()
        prompt = len(self.caches.script.tokens[index])
        usage = {"prompt_tokens": prompt, "completion_tokens": 8, "total_tokens": prompt + 8}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
        await response.write(b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def run_live(
    script: Script, tokenizer: Path, aiohttp_client: Any
) -> tuple[list[Decision], Router, list[ScriptedReplica]]:
    caches = EngineCaches(script)
    replicas = [await ScriptedReplica(name).start() for name in REPLICAS]
    for replica in replicas:
        replica.caches = caches
    by_name = {replica.name: replica for replica in replicas}
    fleet = parse_fleet(
        {
            "tokenizer": str(tokenizer),
            "block_size": BLOCK,
            "replicas": [{"name": r.name, "url": r.url} for r in replicas],
        },
        Path("replicas.yaml"),
    )
    clock = ManualClock()
    app = create_app(router_settings(**SETTINGS), fleet, registry=CollectorRegistry(), clock=clock)
    client = await aiohttp_client(app)
    router, proxy = app[ROUTER], app[PROXY]
    recorder = listen(router)
    seen_first: dict[int, asyncio.Event] = {}
    tasks: dict[int, asyncio.Task[None]] = {}

    async def send(index: int) -> None:
        body = {"model": "m", "prompt": script.tokens[index], "max_tokens": 8, "stream": True}
        headers = {"X-Request-Id": f"req-{index}"}
        async with client.post("/v1/completions", json=body, headers=headers) as response:
            assert response.status == 200
            data = b""
            while b"data:" not in data:
                data += await response.content.readany()
            seen_first[index].set()
            await response.read()

    # The timeline, ordered as the replay's event heap orders it: at one instant, first tokens and finishes
    # come before arrivals.
    timeline: list[tuple[int, int, int, int]] = []
    for index, step in enumerate(script.steps):
        timeline.append((step.arrival, 2, index, 0))
        timeline.append((step.arrival + step.ttft, 0, index, 1))
        timeline.append((step.arrival + step.ttft + step.decode, 1, index, 2))
    timeline.sort()
    chosen: dict[int, ScriptedReplica] = {}
    live = 0
    for tick, _order, index, kind in timeline:
        clock.now = tick * TICK
        if kind == 0:
            seen_first[index] = asyncio.Event()
            tasks[index] = asyncio.create_task(send(index))
            routed = index + 1
            await eventually(lambda: len(recorder.decisions) == routed, what=f"request {index} routed")  # noqa: B023
            target = by_name[recorder.decisions[index].chosen]
            await asyncio.wait_for(target.gates(index)[0].wait(), 10.0)
            chosen[index] = target
            live += 1
        elif kind == 1:
            chosen[index].gates(index)[1].set()
            await asyncio.wait_for(seen_first[index].wait(), 10.0)
        else:
            chosen[index].gates(index)[2].set()
            await asyncio.wait_for(tasks.pop(index), 10.0)
            live -= 1
            await eventually(lambda: proxy.active == live, what=f"request {index} finished")  # noqa: B023
    return recorder.decisions, router, replicas


async def test_live_router_and_replay_decide_alike(tokenizer_dir: Path, aiohttp_client: Any) -> None:
    script = make_script()
    catalog = PromptCatalog(trace_block_tokens=64, block_size=BLOCK, vocab=8192)  # the tiny tokenizer's
    for request in script.requests:
        script.keys.append(catalog.prepare(request).keys)
        script.tokens.append(list(catalog.tokens(request, 0, request.input_length)))

    replayed, replay_router = run_replay(script, catalog)
    live, live_router, replicas = await run_live(script, tokenizer_dir, aiohttp_client)
    try:
        assert [d.chosen for d in live] == [d.chosen for d in replayed]
        assert live == replayed  # every candidate's score and breakdown, not only the choice
        assert state_of(live_router) == state_of(replay_router)
        assert live_router.load.in_flight_total() == replay_router.load.in_flight_total() == 0
    finally:
        for replica in replicas:
            await replica.stop()

    # The sequence exercises what it claims to: feedback learnt (and so changed decisions), the tuner heard
    # every first token, the calibration fitted costs from them (the fleet's pooled fit at least), and more than
    # one replica was used (once calibrated, the scripted engines' TTFTs make one of the three the costliest).
    state = state_of(live_router)
    assert state["trust"][FORGETFUL] < 1.0 and state["repairs"] > 0
    assert sum(count for count, _ in state["arms"].values()) == len(script.steps)
    assert all(costs != policy_start(live_router) for costs in state["costs"].values())
    assert len({d.chosen for d in live}) >= 2
    without_feedback, _ = run_replay(script, catalog, feedback=False)
    assert [d.chosen for d in without_feedback] != [d.chosen for d in replayed]
