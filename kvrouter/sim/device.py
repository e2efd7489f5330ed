"""One GPU shared by several engines (vLLM replicas on one device): processor sharing or time slicing (pure core).

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

Time slicing (`switch_share` set, the `h200-llama8b` profile): several processes on one GPU without MPS are
time-sliced, each context with work queued gets its slice. A pass's GPU work is `busy = w / d` of its alone-duration,
the rest launch-bound; pass i beside others progresses at

    1 / (1 + sum_j busy_j + switch_share * busy_i * sum_j (1 - busy_j))

so launch-bound passes interleave in each other's idle gaps (four eager decodes side by side: ~1.4x), while a pass
with GPU work queued loses a slice to every neighbour with work (`switch_share` 1: an equal slice per context; a
prefill beside three decoding engines: ~3.7x). Alone a pass still takes exactly `d`.

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
    switch_share: float | None = None
    """None: processor sharing by demand; a number: time slicing (`SharedDevice`)."""

    def __post_init__(self) -> None:
        if self.replicas_per_device < 1:
            raise ValueError("replicas_per_device must be >= 1")
        if not 0.0 <= self.overhead_share <= 1.0:
            raise ValueError("overhead_share must be within [0, 1]")
        if self.switch_share is not None and not 0.0 <= self.switch_share <= 1.0:
            raise ValueError("switch_share must be within [0, 1]")

    @property
    def shared(self) -> bool:
        return self.replicas_per_device > 1

    def device_of(self, replica: int) -> int:
        return replica // self.replicas_per_device

    def build(self, time_scale: float = 1.0) -> SharedDevice:
        """A device in wall seconds when `time_scale` engine seconds pass per wall second."""
        return SharedDevice(
            overhead_s=self.overhead_s / time_scale, overhead_share=self.overhead_share, switch_share=self.switch_share
        )

    def build_all(self, replicas: int, time_scale: float = 1.0) -> list[SharedDevice]:
        """One device per group of `replicas_per_device` replicas; replica i's is `[device_of(i)]`."""
        return [self.build(time_scale) for _ in range(-(-replicas // self.replicas_per_device))]


@dataclass(slots=True)
class _Pass:
    remaining: float
    """Seconds of the pass's alone-duration still to run."""
    demand: float
    busy: float
    """The fraction of its alone-duration the pass keeps the GPU busy: its work `w / d` (time slicing)."""
    rate: float = 1.0
    """Alone-seconds it progresses per second, given the passes beside it."""


class SharedDevice:
    """Passes in flight on one GPU; see the module docstring. Keys name passes (one per engine in flight).

    `switch_share` None: processor sharing by demand (`overhead_share`). A number in [0, 1]: time slicing between
    the engines' contexts (the module docstring's second model), where `overhead_share` plays no part."""

    def __init__(self, *, overhead_s: float, overhead_share: float = 1.0, switch_share: float | None = None) -> None:
        if overhead_s < 0 or not 0.0 <= overhead_share <= 1.0:
            raise ValueError("overhead_s must be >= 0 and overhead_share within [0, 1]")
        if switch_share is not None and not 0.0 <= switch_share <= 1.0:
            raise ValueError("switch_share must be within [0, 1]")
        self.overhead_s = overhead_s
        self.overhead_share = overhead_share
        self.switch_share = switch_share
        self.now = 0.0
        self._passes: dict[Hashable, _Pass] = {}

    def demand(self, duration: float) -> float:
        """The GPU fraction a pass of this alone-duration holds (processor sharing)."""
        if duration <= 0:
            return 0.0
        fixed = min(self.overhead_s, duration)
        return (self.overhead_share * fixed + duration - fixed) / duration

    def busy(self, duration: float) -> float:
        """The fraction of a pass's alone-duration its GPU work takes: `w / d` (time slicing)."""
        if duration <= 0:
            return 0.0
        return (duration - min(self.overhead_s, duration)) / duration

    def rate(self, key: Hashable | None = None) -> float:
        """Alone-seconds the pass `key` (any one under processor sharing, where all move alike) progresses per
        second; 1.0 with nothing in flight."""
        if not self._passes:
            return 1.0
        item = self._passes[key] if key is not None else next(iter(self._passes.values()))
        return item.rate

    def in_flight(self) -> int:
        return len(self._passes)

    def begin(self, key: Hashable, duration: float, now: float) -> list[tuple[float, Hashable]]:
        """Start a pass of `duration` alone at `now` (no earlier than the device's time); the passes that ended by
        `now`, as `advance` gives them."""
        if key in self._passes:
            raise ValueError(f"pass {key!r} is already in flight")
        ended = self.advance(now)
        self._passes[key] = _Pass(max(duration, 0.0), self.demand(duration), self.busy(duration))
        self._rerate()
        return ended

    def cancel(self, key: Hashable) -> None:
        if self._passes.pop(key, None) is not None:
            self._rerate()

    def next_end(self) -> float | None:
        """When the earliest pass in flight ends if nothing else starts; None when idle."""
        if not self._passes:
            return None
        return self.now + min(item.remaining / item.rate for item in self._passes.values())

    def advance(self, now: float) -> list[tuple[float, Hashable]]:
        """Move time to `now` (never backwards); (end time, key) of every pass that ended, in order."""
        ended: list[tuple[float, Hashable]] = []
        while self._passes:
            step = min(item.remaining / item.rate for item in self._passes.values())
            end = self.now + step
            if end > now + _EPS:
                break
            # The passes with the shortest time left end at `end` by definition. Decided before progressing, not
            # after: on a large clock (time.monotonic on a host up for days) `end - now` loses the low bits, the
            # remainder left after progressing can stay above any fixed epsilon and `end` stop moving; deciding
            # after would spin forever.
            done = [key for key, item in self._passes.items() if item.remaining / item.rate <= step + _EPS]
            self._progress(step)
            self.now = max(self.now, end)
            for key in done:
                del self._passes[key]
                ended.append((end, key))
            self._rerate()
        if now > self.now:
            self._progress(now - self.now)
            self.now = now
        return ended

    def _progress(self, seconds: float) -> None:
        if seconds > 0:
            for item in self._passes.values():
                item.remaining -= seconds * item.rate

    def _rerate(self) -> None:
        passes = self._passes.values()
        kappa = self.switch_share
        if kappa is None:
            total = sum(item.demand for item in passes)
            shared = 1.0 if total <= 1.0 else 1.0 / total
            for item in passes:
                item.rate = shared
            return
        # Time slicing: a pass beside another loses that one's GPU work, plus, for the share `kappa` of the
        # other's idle (launch-bound) time, the slices the other's context takes while this one has work queued.
        busy_total = sum(item.busy for item in passes)
        idle_total = sum(1.0 - item.busy for item in passes)
        for item in passes:
            others_busy = busy_total - item.busy
            others_idle = idle_total - (1.0 - item.busy)
            item.rate = 1.0 / (1.0 + others_busy + kappa * others_idle * item.busy)


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
