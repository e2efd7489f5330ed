"""A simulated engine that remembers every request added to it, for tests of who received which leg."""

from __future__ import annotations

from typing import Protocol

from kvrouter.sim.model import EngineGaugesSnapshot, EngineRequest, StepResult


class Engine(Protocol):
    block_size: int
    max_num_seqs: int

    def add(self, request: EngineRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self, now: float) -> StepResult: ...
    def reset_prefix_cache(self) -> bool: ...
    def gauges(self) -> EngineGaugesSnapshot: ...


class RecordingEngine:
    """`inner` (a vLLM-like engine or the Dynamo mocker), recording what was added to it in `added`."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.max_num_seqs = inner.max_num_seqs
        self.added: list[EngineRequest] = []

    def add(self, request: EngineRequest) -> None:
        self.added.append(request)
        self.inner.add(request)

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def has_work(self) -> bool:
        return self.inner.has_work()

    def step(self, now: float) -> StepResult:
        return self.inner.step(now)

    def reset_prefix_cache(self) -> bool:
        return self.inner.reset_prefix_cache()

    def gauges(self) -> EngineGaugesSnapshot:
        return self.inner.gauges()
