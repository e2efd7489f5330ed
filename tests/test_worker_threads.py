"""WorkerThreads: the tokenizer's hop off the event loop keeps the executor's semantics at a lower cost."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvrouter.worker_threads import WorkerThreads


async def test_results_exceptions_and_thread_names() -> None:
    workers = WorkerThreads(2, "hop")
    try:
        assert await workers.run(lambda x: x * 2, 21) == 42
        assert (await workers.run(lambda _: threading.current_thread().name, None)).startswith("hop_")

        def boom(_: None) -> None:
            raise ValueError("bad input")

        with pytest.raises(ValueError, match="bad input"):
            await workers.run(boom, None)
        results = await asyncio.gather(*(workers.run(lambda n: n + 1, n) for n in range(200)))
        assert results == list(range(1, 201))
    finally:
        workers.close()


async def test_work_whose_caller_left_before_its_turn_is_skipped() -> None:
    workers = WorkerThreads(1, "hop")
    release = threading.Event()
    ran: list[int] = []

    def blocked(_: None) -> None:
        release.wait(5)

    def note(n: int) -> int:
        ran.append(n)
        return n

    try:
        first = asyncio.ensure_future(workers.run(blocked, None))
        await asyncio.sleep(0.05)  # the one thread is busy
        left = asyncio.ensure_future(workers.run(note, 1))
        await asyncio.sleep(0)
        left.cancel()
        stays = asyncio.ensure_future(workers.run(note, 2))
        await asyncio.sleep(0)
        release.set()
        await first
        assert await stays == 2
        with pytest.raises(asyncio.CancelledError):
            await left
        assert ran == [2]
    finally:
        workers.close()


async def test_close_cancels_what_has_not_started_and_refuses_more() -> None:
    workers = WorkerThreads(1, "hop")
    release = threading.Event()
    running = asyncio.ensure_future(workers.run(lambda _: release.wait(5), None))
    await asyncio.sleep(0.05)
    waiting = asyncio.ensure_future(workers.run(lambda n: n, 7))
    await asyncio.sleep(0)
    workers.close()
    release.set()
    assert await running is True  # what was running finishes
    with pytest.raises(asyncio.CancelledError):
        await waiting
    with pytest.raises(RuntimeError):
        await workers.run(lambda n: n, 1)
    for thread in workers._threads:
        thread.join(5)
        assert not thread.is_alive()


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError):
        WorkerThreads(0, "hop")
