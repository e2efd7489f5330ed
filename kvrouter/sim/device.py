"""One GPU shared by several engines (vLLM replicas on one device): processor sharing of its time (pure core).

A pass's duration alone, `d` (the profile's step time), is a fixed part `c` (the profile's `step_overhead_s`:
scheduling, sampling, kernel launches — in eager mode mostly the CPU's, the GPU idles between small kernels) and
work `w = d - c` that keeps the GPU busy. Alone, the pass holds the GPU for the fraction

    u = (overhead_share * c + w) / d

of its duration (`overhead_share`: how much of the fixed part holds the GPU). Passes of co-located engines that
are in flight together all progress at the rate `min(1, 1 / sum(u))` of passes in flight: while their demands fit
in one GPU nothing slows (engines decoding side by side barely interfere: each is launch-bound), beyond that the
GPU's time is divided in proportion to demand (generalised processor sharing, which is what time-slicing between
CUDA contexts without MPS approximates): a decode pass beside three 8k-token chunked prefills takes ~3x as long,
and the prefills share the GPU's prefill throughput. One pass alone always takes exactly `d` (u <= 1), so an
engine alone on its device keeps the timing it has without this module.

Knobs: `overhead_s` (the fixed part, in the caller's time unit), `overhead_share` (0..1). Time is whatever unit the
caller uses (the live driver: wall seconds; the replay: virtual seconds), as long as it is the same for all.
`SharedDevice` is pure and clock-free; `LiveDevice` is its thin async shell for the live simulator (engines of one
`kvrouter sim` process on one event loop).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class DeviceSharing:
    """How a profile's replicas share GPUs: `replicas_per_device` engines per device (1: none shared)."""

    replicas_per_device: int = 1
    overhead_s: float = 0.0
    overhead_share: float = 1.0

    def __post_init__(self) -> None:
        if self.replicas_per_device < 1:
            raise ValueError("replicas_per_device must be >= 1")
        if not 0.0 <= self.overhead_share <= 1.0:
            raise ValueError("overhead_share must be within [0, 1]")

    @property
    def shared(self) -> bool:
        return self.replicas_per_device > 1

    def device_of(self, replica: int) -> int:
        return replica // self.replicas_per_device

    def build(self, time_scale: float = 1.0) -> SharedDevice:
        """A device in wall seconds when `time_scale` engine seconds pass per wall second."""
        return SharedDevice(overhead_s=self.overhead_s / time_scale, overhead_share=self.overhead_share)

    def build_all(self, replicas: int, time_scale: float = 1.0) -> list[SharedDevice]:
        """One device per group of `replicas_per_device` replicas; replica i's is `[device_of(i)]`."""
        return [self.build(time_scale) for _ in range(-(-replicas // self.replicas_per_device))]


@dataclass(slots=True)
class _Pass:
    remaining: float
    """Seconds of the pass's alone-duration still to run."""
    demand: float


class SharedDevice:
    """Passes in flight on one GPU; see the module docstring. Keys name passes (one per engine in flight)."""

    def __init__(self, *, overhead_s: float, overhead_share: float = 1.0) -> None:
        if overhead_s < 0 or not 0.0 <= overhead_share <= 1.0:
            raise ValueError("overhead_s must be >= 0 and overhead_share within [0, 1]")
        self.overhead_s = overhead_s
        self.overhead_share = overhead_share
        self.now = 0.0
        self._passes: dict[Hashable, _Pass] = {}
        self._demand = 0.0

    def demand(self, duration: float) -> float:
        """The GPU fraction a pass of this alone-duration holds."""
        if duration <= 0:
            return 0.0
        fixed = min(self.overhead_s, duration)
        return (self.overhead_share * fixed + duration - fixed) / duration

    def rate(self) -> float:
        """Alone-seconds each pass in flight progresses per second."""
        return 1.0 if self._demand <= 1.0 else 1.0 / self._demand

    def in_flight(self) -> int:
        return len(self._passes)

    def begin(self, key: Hashable, duration: float, now: float) -> list[tuple[float, Hashable]]:
        """Start a pass of `duration` alone at `now` (no earlier than the device's time); the passes that ended by
        `now`, as `advance` gives them."""
        if key in self._passes:
            raise ValueError(f"pass {key!r} is already in flight")
        ended = self.advance(now)
        demand = self.demand(duration)
        self._passes[key] = _Pass(max(duration, 0.0), demand)
        self._demand += demand
        return ended

    def cancel(self, key: Hashable) -> None:
        item = self._passes.pop(key, None)
        if item is not None:
            self._demand = sum(p.demand for p in self._passes.values())

    def next_end(self) -> float | None:
        """When the earliest pass in flight ends if nothing else starts; None when idle."""
        if not self._passes:
            return None
        shortest = min(item.remaining for item in self._passes.values())
        return self.now + shortest / self.rate()

    def advance(self, now: float) -> list[tuple[float, Hashable]]:
        """Move time to `now` (never backwards); (end time, key) of every pass that ended, in order."""
        ended: list[tuple[float, Hashable]] = []
        while self._passes:
            shortest = min(item.remaining for item in self._passes.values())
            end = self.now + shortest / self.rate()
            if end > now + _EPS:
                break
            # The passes with the shortest remainder end at `end` by definition. Decided before progressing, not
            # after: on a large clock (time.monotonic on a host up for days) `end - now` loses the low bits, the
            # remainder left after `_progress` can stay above any fixed epsilon and `end` stop moving; deciding
            # after would spin forever.
            done = [key for key, item in self._passes.items() if item.remaining <= shortest + _EPS]
            self._progress(end)
            for key in done:
                del self._passes[key]
                ended.append((end, key))
            self._demand = sum(item.demand for item in self._passes.values())
        if now > self.now:
            self._progress(now)
        return ended

    def _progress(self, until: float) -> None:
        step = (until - self.now) * self.rate()
        if step > 0:
            for item in self._passes.values():
                item.remaining -= step
        self.now = max(self.now, until)


class LiveDevice:
    """`SharedDevice` on the event loop: `run_pass` returns (awaits) a pass's end on the `clock`'s time line."""

    def __init__(self, device: SharedDevice, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.device = device
        self._clock = clock
        self._futures: dict[Hashable, asyncio.Future[float]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._ids = itertools.count()
        device.now = clock()

    async def run_pass(self, duration: float, start: float) -> float:
        """Run a pass of `duration` seconds alone from `start` (or the device's time if later); when it ended."""
        loop = asyncio.get_running_loop()
        key = next(self._ids)
        future: asyncio.Future[float] = loop.create_future()
        self._futures[key] = future
        self._settle(self.device.begin(key, duration, min(max(start, self.device.now), self._clock())))
        self._arm(loop)
        try:
            return await future
        finally:
            if self._futures.pop(key, None) is not None:  # cancelled: the pass leaves the device
                self.device.cancel(key)
                self._arm(loop)

    def _settle(self, ended: list[tuple[float, Hashable]]) -> None:
        for end, key in ended:
            future = self._futures.pop(key, None)
            if future is not None and not future.done():
                future.set_result(end)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        end = self.device.next_end()
        if end is not None:
            self._timer = loop.call_later(max(0.0, end - self._clock()), self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._settle(self.device.advance(self._clock()))
        self._arm(loop)
