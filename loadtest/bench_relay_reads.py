"""The relay's bookkeeping per chunk read, alone: a deadline per read, and a metric child per request.

Reads `--chunks` chunks from an aiohttp `StreamReader`, each fed just before its read (so what is timed is the
read's own cost, not the network's; the feed is in every variant's figure, and the bare read shows that floor),
each read bounded one way or the other:

* `asyncio.timeout` around each read (the relay before kvrouter/server/chunk_reads.py);
* `ChunkReader.read()` (one loop timer per answer);
* a bare `readany()` (no deadline: the floor).

and, for the metrics, `Counter.labels(...).inc()` against a cached child's `inc()`. Figures are thread CPU time
per operation (what one core spends, whatever else runs on the machine), the median of `--repeats` rounds, on
uvloop when it is installed. Run from the repository root: `python loadtest/bench_relay_reads.py` (a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from aiohttp import StreamReader
from aiohttp.base_protocol import BaseProtocol
from prometheus_client import CollectorRegistry, Counter

from kvrouter.server.chunk_reads import ChunkReader

CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"w "}}]}\n\n'


async def per_read(chunks: int, read_with: Callable[[StreamReader], Callable[[], Awaitable[bytes]]]) -> float:
    loop = asyncio.get_running_loop()
    stream = StreamReader(BaseProtocol(loop), 1 << 30, loop=loop)
    read = read_with(stream)
    started = time.thread_time()
    for _ in range(chunks):
        stream.feed_data(CHUNK)  # the chunk the replica sent, buffered before the read, as a relay often meets it
        await read()
    return (time.thread_time() - started) / chunks * 1e6


def with_timeout(stream: StreamReader) -> Callable[[], Awaitable[bytes]]:
    async def read() -> bytes:
        async with asyncio.timeout(600.0):
            return await stream.readany()

    return read


def with_chunk_reader(stream: StreamReader) -> Callable[[], Awaitable[bytes]]:
    return ChunkReader(stream, 600.0).read


def bare(stream: StreamReader) -> Callable[[], Awaitable[bytes]]:
    return stream.readany


def labels_cost(rounds: int) -> tuple[float, float]:
    requests = Counter("bench_requests", "x", ["replica", "route", "status"], registry=CollectorRegistry())
    started = time.thread_time()
    for _ in range(rounds):
        requests.labels("r0", "/v1/chat/completions", "200").inc()
    looked_up = (time.thread_time() - started) / rounds * 1e6
    cache = {("r0", "/v1/chat/completions", "200"): requests.labels("r0", "/v1/chat/completions", "200")}
    started = time.thread_time()
    for _ in range(rounds):
        cache[("r0", "/v1/chat/completions", "200")].inc()
    return looked_up, (time.thread_time() - started) / rounds * 1e6


async def main(args: argparse.Namespace) -> None:
    print(f"event loop: {type(asyncio.get_running_loop()).__module__}")
    results: dict[str, list[float]] = {"asyncio.timeout per read": [], "ChunkReader.read": [], "bare read": []}
    for _ in range(args.repeats):
        results["asyncio.timeout per read"].append(await per_read(args.chunks, with_timeout))
        results["ChunkReader.read"].append(await per_read(args.chunks, with_chunk_reader))
        results["bare read"].append(await per_read(args.chunks, bare))
    print(f"per chunk read, thread CPU µs, median of {args.repeats} rounds of {args.chunks:,} buffered chunks:")
    for name, values in results.items():
        print(f"  {name:26s} {statistics.median(values):6.2f} (range {min(values):.2f}-{max(values):.2f})")
    looked_up, cached = zip(*(labels_cost(args.chunks) for _ in range(args.repeats)), strict=True)
    print(f"Counter.labels(...).inc() {statistics.median(looked_up):.2f} µs, a cached child's inc() ", end="")
    print(f"{statistics.median(cached):.2f} µs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--chunks", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    arguments = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(arguments))
    else:
        uvloop.run(main(arguments))
