"""The thin async shell that runs an engine model on the real clock (one per simulated replica).

The driver loops: run one engine pass, sleep until the pass would have ended (its duration divided by
`time_scale`), then deliver what the pass produced — tokens to the waiting HTTP handlers, KV events to the
publisher, latencies to the metrics. Requests arriving during a pass join the next one, as in vLLM. When the loop
falls behind (timer slack, a busy CPU), later passes make up to `catch_up_s` of the lag by sleeping less; beyond
that, lateness only delays. Simulated time is wall time
multiplied by `time_scale`; the latency metrics report wall seconds, what anyone timing this replica measures (a
router's TTFTs, its engine-rate source: kvrouter/routing/engine_rates.py), as a real engine that slow (or that
fast) would report them. With `device` (replicas sharing one GPU,
`kvrouter.sim.device`) a pass ends when the shared device says so, not after its own duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrouter.sim.device import LiveDevice
from kvrouter.sim.metrics import ReplicaMetrics
from kvrouter.sim.model import EngineModel, EngineRequest, StepResult
from kvrouter.sim.publisher import KvEventPublisher

log = logging.getLogger(__name__)

TOKEN = "token"
DONE = "done"


@dataclass(slots=True)
class Tracked:
    """One engine request as its HTTP handler follows it."""

    request: EngineRequest
    index: int
    sink: asyncio.Queue[tuple[int, str]]
    arrived: float
    scheduled: float | None = None
    """Start of the pass that admitted it (its cached tokens were reported then): the end of its queue time."""
    first_token: float | None = None
    emitted: int = 0
    cached_tokens: int = 0
    finished: bool = False
    extra: dict[str, object] = field(default_factory=dict)


class EngineDriver:
    def __init__(
        self,
        engine: EngineModel,
        *,
        time_scale: float = 1.0,
        publisher: KvEventPublisher | None = None,
        metrics: ReplicaMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        catch_up_s: float = 0.05,
        device: LiveDevice | None = None,
    ) -> None:
        """`device`: the GPU this engine shares with others of the process (None: a device of its own)."""
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.engine = engine
        self.time_scale = time_scale
        self.publisher = publisher
        self.metrics = metrics
        self.catch_up_s = catch_up_s
        self.device = device
        self._clock = clock
        self._tracked: dict[str, Tracked] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._origin = clock()

    def sim_time(self) -> float:
        return (self._clock() - self._origin) * self.time_scale

    def submit(self, tracked: Tracked) -> None:
        """Hand a request to the engine; raises ValueError when the engine refuses it."""
        self.engine.add(tracked.request)
        self._tracked[tracked.request.request_id] = tracked
        self._wake.set()

    def abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        deadline = self._clock()
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = self._clock()
            # Oversleeping (timer slack, a busy machine) is made up on later passes, up to `catch_up_s` of lag:
            # otherwise every late wake-up would slow simulated time down for good.
            deadline = max(deadline, self._clock() - self.catch_up_s)
            started = self._clock()
            result = self.engine.step(self.sim_time())
            if self.device is None:
                deadline += result.duration / self.time_scale
                delay = deadline - self._clock()
                await asyncio.sleep(delay if delay > 0 else 0)
            else:
                deadline = await self.device.run_pass(result.duration / self.time_scale, deadline)
            try:
                self._deliver(result, started)
            except Exception:  # a delivery bug must not stop the replica
                log.exception("delivering an engine pass failed")

    def _deliver(self, result: StepResult, started: float | None = None) -> None:
        """What the pass that began at `started` (real clock; None: now) produced."""
        now = self._clock()
        tracked = self._tracked
        if self.publisher is not None and result.events:
            self.publisher.publish(result.events)
        for rid, cached in result.cached_tokens.items():
            item = tracked.get(rid)
            if item is not None:
                item.cached_tokens = cached
                if item.scheduled is None:
                    item.scheduled = now if started is None else started
        metrics = self.metrics
        if metrics is not None and result.preempted:
            metrics.preemptions.inc(len(result.preempted))
        for rid in result.tokens:
            item = tracked.get(rid)
            if item is None:
                continue
            if item.first_token is None:
                item.first_token = now
                if metrics is not None:
                    metrics.ttft.observe(now - item.arrived)
                    metrics.prompt_tokens.inc(item.request.prompt_len)
            item.emitted += 1
            item.sink.put_nowait((item.index, TOKEN))
        if metrics is not None and result.tokens:
            metrics.generation_tokens.inc(len(result.tokens))
        for rid in result.finished:
            item = tracked.pop(rid, None)
            if item is None:
                continue
            item.finished = True
            if metrics is not None:
                metrics.e2e.observe(now - item.arrived)
                # Like vLLM, at the end: queue (arrival to first scheduling), prefill (to the first token).
                scheduled = item.arrived if item.scheduled is None else item.scheduled
                first = now if item.first_token is None else item.first_token
                metrics.queue_time.observe(max(0.0, scheduled - item.arrived))
                metrics.prefill_time.observe(max(0.0, first - scheduled))
                metrics.prefill_computed_tokens.observe(max(0, item.request.prompt_len - item.cached_tokens))
            item.sink.put_nowait((item.index, DONE))
