"""Worker threads for blocking work the event loop hands off, with a cheaper hop than `run_in_executor`.

The tokenizer hands every request to its threads. `loop.run_in_executor` over a `ThreadPoolExecutor` costs ~27 µs
of CPU per call on this project's 2-core machine (a concurrent Future with its Condition, a work item, the wrap
into an asyncio Future and its chained callbacks, `loadtest/bench_thread_hop.py`); this is the part the router
uses, at ~12 µs: a fixed set of daemon threads started up front, one `SimpleQueue` of (function, argument, loop,
future), and the outcome set on the caller's asyncio future through `call_soon_threadsafe`.

Semantics kept from the executor: work runs in submission order on the first free thread; the function's
exception (any `BaseException`) reaches the awaiting caller; a caller cancelled before its work started has it
skipped (one cancelled while it runs gets no result: the outcome is dropped); `close()` cancels work not started
and lets the threads end; `run` after `close` raises `RuntimeError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

A = TypeVar("A")
R = TypeVar("R")

_Item = tuple[Callable[[Any], Any], Any, asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class WorkerThreads:
    """`threads` daemon threads named `{name}_{n}` running `await run(function, argument)` calls in order."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{n}", daemon=True) for n in range(threads)]
        for thread in self._threads:
            thread.start()

    async def run(self, function: Callable[[A], R], argument: A) -> R:
        if self._closed:
            raise RuntimeError("cannot run work after close()")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.put((function, argument, loop, future))
        return await future

    def close(self) -> None:
        """Cancel the work not started yet and let the threads end (they finish what they are running)."""
        self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _post(item[2], _cancel, item[3], None)
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            function, argument, loop, future = item
            if future.cancelled():  # the caller left before its turn: skip (a stale read only costs the work)
                continue
            try:
                result = function(argument)
            except BaseException as error:  # as the executor: whatever it raised reaches the caller
                _post(loop, _fail, future, error)
            else:
                _post(loop, _deliver, future, result)
                del result
            # An error's traceback holds this frame: nothing of this call may stay reachable from it while idle.
            del item, function, argument, loop, future


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], future: Any, value: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        loop.call_soon_threadsafe(callback, future, value)


def _deliver(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _cancel(future: asyncio.Future[Any], _: None) -> None:
    future.cancel()


__all__ = ["WorkerThreads"]
