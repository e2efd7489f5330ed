"""The engine models' waiting queues and preemption victims, by vLLM's `--scheduling-policy` (pure).

vLLM v1 (vllm/v1/core/sched/request_queue.py, scheduler.py) has two policies the engine models reproduce:

* `fcfs` (vLLM's default): waiting requests in arrival order; a preempted request goes back to the head of the
  queue; when a running request cannot get its KV blocks, the most recently admitted running request is
  preempted (the end of the running list), until it can or it was the request itself.
* `priority`: the waiting queue is a heap ordered by the request's `priority` (lower first, 0 the default), then
  its arrival time at the engine (vLLM's `Request.__lt__`); a preempted request is pushed back by the same order,
  not to the head. The victim when blocks run out is the running request with the largest (priority, arrival
  time) — the least urgent, newest first among equals — which may be the request that needs the blocks (then it
  preempts itself and the pass stops scheduling running requests). A preempted request that was already
  scheduled in this pass gives its tokens back to the pass's budget.

  Ties: vLLM breaks equal (priority, arrival time) by request id, but its arrival times come from a float clock,
  so two requests practically never tie and the one the engine received first is ahead. Driven by a virtual
  clock, many requests arrive at the same instant (a trace's burst); they are ordered by the order the engine
  received them (`received`, kept by the engine), as vLLM's clock would order them — not by the drivers' request
  ids, which would favour some ids over others.

  As in vLLM, a waiting request never preempts a running one: an urgent request at the head of the waiting queue
  waits for free blocks (or a free `max_num_seqs` slot) like any other; what the policy changes is who is
  admitted first and whose blocks go when running requests need more.

`FcfsWaiting` is a deque (the engines' behaviour before the policy existed, unchanged); `PriorityWaiting` has the
same methods over a heap. `key` tells the queue how to read an item's order (`order_key` of its `EngineRequest`
and its `received` number), since each engine keeps its own per-request state.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from kvrouter.sim.model import EngineRequest, SchedulingPolicy

T = TypeVar("T")

OrderKey = tuple[int, float, int]
"""(priority, arrival at the engine, order received by the engine): smaller is served first."""


class WaitingQueue(Protocol[T]):
    def add(self, item: T) -> None:
        """A new request arrives."""
        ...

    def put_back(self, item: T) -> None:
        """A preempted request returns (fcfs: to the head; priority: by its order)."""
        ...

    def head(self) -> T:
        """The next request to admit (the queue is not empty)."""
        ...

    def take(self) -> T:
        """Remove and return `head()`."""
        ...

    def remove(self, item: T) -> None: ...

    def __len__(self) -> int: ...


class FcfsWaiting(deque[T]):
    """First come first served; a preempted request goes back to the head (vLLM's FCFSRequestQueue)."""

    add = deque.append
    put_back = deque.appendleft
    take = deque.popleft

    def head(self) -> T:
        return self[0]


def order_key(request: EngineRequest, received: int) -> OrderKey:
    """vLLM's priority order: lower `priority` first, then earlier arrival, then the earlier received."""
    return (request.priority, request.arrival, received)


class PriorityWaiting(Generic[T]):
    """A heap by `key` (vLLM's PriorityRequestQueue): preempted requests re-enter by their order."""

    __slots__ = ("_heap", "_key")

    def __init__(self, key: Callable[[T], OrderKey]) -> None:
        self._key = key
        self._heap: list[tuple[int, float, int, T]] = []

    def add(self, item: T) -> None:
        priority, arrival, received = self._key(item)
        heapq.heappush(self._heap, (priority, arrival, received, item))

    put_back = add

    def head(self) -> T:
        return self._heap[0][3]

    def take(self) -> T:
        return heapq.heappop(self._heap)[3]

    def remove(self, item: T) -> None:
        heap = self._heap
        for position, entry in enumerate(heap):
            if entry[3] is item:
                heap[position] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                return
        raise ValueError("request is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


def waiting_queue(policy: SchedulingPolicy, key: Callable[[T], OrderKey]) -> WaitingQueue[T]:
    if policy == "fcfs":
        return FcfsWaiting()
    if policy == "priority":
        return PriorityWaiting(key)
    raise ValueError(f"unknown scheduling policy {policy!r}; expected fcfs or priority")


def priority_victim(running: Iterable[T], key: Callable[[T], OrderKey]) -> T:
    """The running request `priority` preempts: the largest order key, the least urgent and newest (vLLM's
    `max(self.running, key=lambda r: (r.priority, r.arrival_time))`, ties as in the module docstring)."""
    return max(running, key=key)


__all__ = ["FcfsWaiting", "PriorityWaiting", "WaitingQueue", "order_key", "priority_victim", "waiting_queue"]
