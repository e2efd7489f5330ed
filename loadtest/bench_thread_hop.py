"""The hop from the event loop to a worker thread and back, alone: `run_in_executor` against `WorkerThreads`.

Each call hands a function that returns its argument to two worker threads and awaits the result, one call at a
time (as a request awaits its tokenization). The figure is the process's CPU time per call (the loop's thread,
the workers and the kernel's wake-ups: what the hop costs the router's process, whatever else runs), the median
of `--repeats` rounds of `--calls`, on uvloop when it is installed. Run from the repository root:
`python loadtest/bench_thread_hop.py` (a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from kvrouter.worker_threads import WorkerThreads


def same(value: int) -> int:
    return value


async def rounds(hop: Callable[[int], Awaitable[int]], calls: int, repeats: int) -> float:
    figures = []
    for _ in range(repeats):
        started = time.process_time()
        for n in range(calls):
            await hop(n)
        figures.append((time.process_time() - started) / calls * 1e6)
    return statistics.median(figures)


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=2)
    workers = WorkerThreads(2, "bench")
    try:
        for _ in range(args.pairs):
            executor = await rounds(lambda n: loop.run_in_executor(pool, same, n), args.calls, args.repeats)
            threads = await rounds(lambda n: workers.run(same, n), args.calls, args.repeats)
            print(f"run_in_executor {executor:5.1f} µs CPU per call   WorkerThreads {threads:5.1f} µs")
    finally:
        pool.shutdown()
        workers.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3)
    arguments = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(arguments))
    else:
        uvloop.run(main(arguments))
