"""KV room for the more urgent bands: a less urgent request does not take the KV cache an urgent prompt needs.

Over capacity on a trace with long answers, the fleet runs out of KV cache before it runs out of prefill passes:
running requests hold 90-100% of every replica's blocks, and a large prompt of the first band, dispatched at once,
waits at the head of its engine's waiting queue until finishing requests free the blocks its whole prompt needs
(vLLM admits a request only when its prompt fits; a waiting request never preempts a running one). On the Mooncake
conversation trace at x4.0 that wait was most of the high band's tail (docs/benchmarks.md, "Priorities").

So each replica keeps free, from requests of a band, the KV the more urgent bands' largest recent prompt needs:

- the **reserve** of band b is the largest prompt (tokens) that arrived in a more urgent band in the last
  `WINDOW_S` seconds (0 when none did: a fleet whose requests are all in one band is unchanged);
- a replica's **free KV** is estimated as (1 - its engine's scraped `kv_usage`) x `capacity_tokens`, less its
  pending prefill (uncached prompt tokens of requests routed there without a first token: what was sent since
  the scrape, or is waiting or prefilling there; the last of these are counted twice, erring towards room kept);
  unknown (no scrape yet, or no capacity configured) counts as keeping the reserve;
- a request of band b is dispatched only while some replica both has room (`kvrouter.flow.saturation`) and keeps
  the reserve, and is routed among the replicas keeping it (all of them when none does).

The first band is never held by it. What the less urgent bands lose is at most one large prompt's worth of KV per
replica, and only while the more urgent bands are sending.

Pure and synchronous; `now` is the caller's clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvrouter.flow.classes import FlowClass
from kvrouter.policies.base import ReplicaLoad

WINDOW_S = 60.0
"""How long an urgent band's prompt counts towards the reserve: about a minute of its arrivals (at 20% of the
conversation trace's x4.0 arrivals, ~160 prompts, so the reserve is close to the band's largest). Set before any
measurement and not tuned (docs/benchmarks.md, "Priorities")."""


class KvReserve:
    def __init__(self, bands: int, capacity_tokens: int, window_s: float = WINDOW_S) -> None:
        self.capacity_tokens = capacity_tokens
        self.window_s = window_s
        self._largest: list[deque[tuple[float, int]]] = [deque() for _ in range(bands)]
        """Per band: (arrival, prompt tokens) of its recent arrivals, prompt tokens decreasing (a sliding max)."""

    def arrived(self, flow: FlowClass, prompt_tokens: int, now: float) -> None:
        window = self._largest[flow.band]
        while window and window[-1][1] <= prompt_tokens:
            window.pop()
        window.append((now, prompt_tokens))

    def reserve(self, band: int, now: float) -> int:
        """Prompt tokens of the largest recent arrival of the bands more urgent than `band` (0: none)."""
        largest = 0
        for window in self._largest[:band]:
            while window and window[0][0] < now - self.window_s:
                window.popleft()
            if window:
                largest = max(largest, window[0][1])
        return largest

    def free_tokens(self, load: ReplicaLoad) -> float | None:
        """A replica's free KV (tokens) as the router can estimate it; None: unknown."""
        if load.kv_usage is None:
            return None
        return (1.0 - load.kv_usage) * self.capacity_tokens - load.pending_prefill_tokens

    def keeps(self, load: ReplicaLoad, reserve: int) -> bool:
        """Whether a replica keeps `reserve` tokens of KV free (unknown counts as keeping it)."""
        if reserve <= 0:
            return True
        free = self.free_tokens(load)
        return free is None or free >= reserve

    def open_bands(self, loads: Iterable[tuple[ReplicaLoad, bool]], now: float) -> list[bool]:
        """Per band: whether some replica with room (`loads`: each replica's load and whether it has room)
        keeps the band's reserve."""
        loads = list(loads)
        opened: list[bool] = []
        for band in range(len(self._largest)):
            reserve = self.reserve(band, now)
            opened.append(reserve <= 0 or any(room and self.keeps(load, reserve) for load, room in loads))
        return opened


__all__ = ["WINDOW_S", "KvReserve"]
