"""Benchmark of the Redis event plane: catch-up state layout, router ready time, end-to-end event rate.

    python loadtest/bench_redis_plane.py [--quick] [--sizes 100000,1000000] [--events 20000]

Starts its own redis-server (Debian's binary, free 127.0.0.1 port, temp dir, no persistence). Prints medians of
`--repeat` runs, each next to a baseline measured in the same run:
* catch-up state, per block: Redis memory (MEMORY USAGE of the key) and read-back time of (a) the snapshot
  this plane uses — one string of packed u64 arrays — vs. (b) a Redis hash engine-hash -> key+tier kept
  current with every append (the alternative), read back with HSCAN; plus the stream's memory per op;
* router ready time vs index size: a `RedisFollower` from start to "index loaded" into a `PrefixIndex`, split into
  Redis read+decode and index apply; with a fresh snapshot and with the worst-case stream tail (0.5 × size ops,
  the most a snapshot ratio of 0.5 leaves); baseline: building a plain dict of the same blocks;
* events/s end to end: vLLM-format batches on a ZMQ PUB -> `kvrouter relay` (a separate process) -> Redis ->
  a follower's index, vs. the embedded path (the same ZMQ source straight into an index) in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis as redis_sync
import yaml
import zmq
import zmq.asyncio

from kvrouter.config import KvEventsConfig
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.catchup import read_replica
from kvrouter.redisplane.entries import EntryCodec, Stored, unpack_u64
from kvrouter.redisplane.follower import FollowerKnobs, RedisFollower, connect_redis
from kvrouter.redisplane.layout import replica_keys
from kvrouter.redisplane.state import ReplicaState
from kvrouter.redisplane.writer import ReplicaWriter, WriterKnobs
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

REPO = Path(__file__).resolve().parents[1]
R = ReplicaName("bench")


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                directory,
                "--save",
                "",
                "--appendonly",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        client = redis_sync.Redis.from_url(url)
        for _ in range(200):
            with contextlib.suppress(redis_sync.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.02)
        try:
            yield url
        finally:
            process.kill()
            process.wait()


def random_state(size: int, seed: int) -> ReplicaState:
    rng = random.Random(seed)
    state = ReplicaState(R)
    for start in range(0, size, 1000):
        count = min(1000, size - start)
        state.store_keys(
            R,
            [EngineBlockHash(rng.getrandbits(64)) for _ in range(count)],
            [BlockKey(rng.getrandbits(64)) for _ in range(count)],
            Tier.GPU,
        )
    state.take_pending()
    return state


async def until(condition: Callable[[], bool]) -> None:
    while True:
        if condition():
            return
        await asyncio.sleep(0.05)


def memory_usage(url: str, key: str) -> int:
    return int(redis_sync.Redis.from_url(url).memory_usage(key, samples=0) or 0)


def median(values: list[float]) -> float:
    return statistics.median(values)


# ---- catch-up state layouts ---------------------------------------------------------------------------------


async def layout_costs(url: str, size: int, repeat: int) -> dict[str, float]:
    plain = redis_sync.Redis.from_url(url)
    plain.flushall()
    state = random_state(size, seed=size)
    keys = replica_keys(R)
    redis = connect_redis(url, socket_timeout_s=60)
    writer = ReplicaWriter(redis, keys, state, hash_seed=0, clock_ms=lambda: time.time_ns() // 10**6)
    await writer.flush({0: 0})  # a new epoch: the whole state as one snapshot
    blocks = len(state)
    snapshot_bytes = memory_usage(url, keys.snapshot)
    codec = EntryCodec()
    read_times = []
    for _ in range(repeat):
        started = time.perf_counter()
        catchup = await read_replica(redis, keys, codec)
        assert catchup is not None
        for op in catchup.ops:
            if isinstance(op, Stored):
                unpack_u64(op.hashes), unpack_u64(op.keys)
        read_times.append(time.perf_counter() - started)

    # The stream: ops of 64 blocks per entry, as a busy engine's batches come.
    writer.knobs = WriterKnobs(snapshot_ratio=100.0)
    rng = random.Random(1)
    tail = max(size // 10, 1000)
    before = memory_usage(url, keys.stream)
    for start in range(0, tail, 64):
        state.store_keys(
            R,
            [EngineBlockHash(rng.getrandbits(64)) for _ in range(64)],
            [BlockKey(rng.getrandbits(64)) for _ in range(64)],
        )
        if start % 4096 == 0:
            await writer.flush({0: start})
    await writer.flush({0: tail})
    stream_bytes = memory_usage(url, keys.stream) - before

    # The alternative: a hash of engine hash -> key + tier, updated with each append, read back with HSCAN.
    plain.flushall()
    items = dict(list(state.blocks()[(0, int(Tier.GPU))].items())[:blocks])
    pipe = plain.pipeline(transaction=False)
    mapping: dict[bytes, bytes] = {}
    for engine_hash, key in items.items():
        mapping[engine_hash.to_bytes(8, "little")] = key.to_bytes(8, "little") + b"\x00"
        if len(mapping) == 10_000:
            pipe.hset("kvrouter:{bench}:blocks", mapping=mapping)  # type: ignore[arg-type]
            mapping = {}
    if mapping:
        pipe.hset("kvrouter:{bench}:blocks", mapping=mapping)  # type: ignore[arg-type]
    pipe.execute()
    hash_bytes = memory_usage(url, "kvrouter:{bench}:blocks")
    hash_times = []
    for _ in range(repeat):
        started = time.perf_counter()
        cursor: int = 0
        got = 0
        while True:
            cursor, chunk = await redis.hscan("kvrouter:{bench}:blocks", cursor, count=10_000)
            for field, value in chunk.items():
                int.from_bytes(field, "little"), int.from_bytes(value[:8], "little"), value[8]
            got += len(chunk)
            if cursor == 0:
                break
        hash_times.append(time.perf_counter() - started)
    await redis.aclose()
    plain.flushall()
    return {
        "blocks": blocks,
        "snapshot_bytes_per_block": snapshot_bytes / blocks,
        "snapshot_read_s": median(read_times),
        "stream_bytes_per_op": stream_bytes / tail,
        "hash_bytes_per_block": hash_bytes / blocks,
        "hash_read_s": median(hash_times),
    }


# ---- router ready time --------------------------------------------------------------------------------------


async def ready_time(url: str, size: int, tail_ratio: float, repeat: int) -> dict[str, float]:
    redis_sync.Redis.from_url(url).flushall()
    state = random_state(size, seed=size + 7)
    keys = replica_keys(R)
    redis = connect_redis(url, socket_timeout_s=60)
    writer = ReplicaWriter(
        redis,
        keys,
        state,
        hash_seed=0,
        clock_ms=lambda: time.time_ns() // 10**6,
        knobs=WriterKnobs(snapshot_ratio=100.0, entry_max_blocks=4096),
    )
    await writer.flush({0: 0})
    rng = random.Random(2)
    tail = int(size * tail_ratio)
    for start in range(0, tail, 64):
        state.store_keys(
            R,
            [EngineBlockHash(rng.getrandbits(64)) for _ in range(64)],
            [BlockKey(rng.getrandbits(64)) for _ in range(64)],
        )
        if start % 65536 == 0:
            await writer.flush({0: start})
    await writer.flush({0: tail})
    codec = EntryCodec()
    ready, read, apply, baseline = [], [], [], []
    for _ in range(repeat):
        index = PrefixIndex()
        follower = RedisFollower(
            lambda: connect_redis(url, socket_timeout_s=60),
            [R],
            index,
            hash_seed=0,
            clock=time.monotonic,
            knobs=FollowerKnobs(block_ms=1000),
        )
        started = time.perf_counter()
        follower.start()
        await follower.loaded.wait()
        ready.append(time.perf_counter() - started)
        await follower.stop()
        assert index.blocks_of(R) == len(state), (index.blocks_of(R), len(state))
        del index
        started = time.perf_counter()
        catchup = await read_replica(redis, keys, codec)
        read.append(time.perf_counter() - started)
        assert catchup is not None
        index = PrefixIndex()
        started = time.perf_counter()
        for op in catchup.ops:
            if isinstance(op, Stored):
                index.store_keys(R, unpack_u64(op.hashes), unpack_u64(op.keys), Tier(op.tier))  # type: ignore[arg-type]
        apply.append(time.perf_counter() - started)
        del index, catchup
        pairs = state.blocks()[(0, 0)]
        started = time.perf_counter()
        dict(zip(list(pairs), list(pairs.values()), strict=True))
        baseline.append(time.perf_counter() - started)
    await redis.aclose()
    return {
        "blocks": len(state),
        "tail_ops": tail,
        "ready_s": median(ready),
        "read_s": median(read),
        "apply_s": median(apply),
        "dict_baseline_s": median(baseline),
    }


# ---- events/s end to end ------------------------------------------------------------------------------------


def make_payloads(count: int, seed: int) -> tuple[list[bytes], int]:
    """vLLM-format batches: a 4-block chain stored per batch (70% extending a recent block), LRU evictions."""
    import msgspec

    rng = random.Random(seed)
    encoder = msgspec.msgpack.Encoder()
    cached: list[int] = []
    payloads = []
    blocks = 0
    for step in range(count):
        hashes = [rng.getrandbits(64) for _ in range(4)]
        parent = rng.choice(cached[-64:]) if cached and rng.random() < 0.7 else None
        events: list[dict[str, object]] = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": [rng.randrange(30000) for _ in range(64)],
                "block_size": 16,
                "medium": "GPU",
            }
        ]
        cached.extend(hashes)
        blocks += 4
        if len(cached) > 20_000:
            evicted, cached = cached[:4], cached[4:]
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
            blocks += 4
        payloads.append(encoder.encode([1_796_000_000.0 + step, events, 0]))
    return payloads, blocks


async def publish(pub: zmq.asyncio.Socket, payloads: list[bytes]) -> None:
    for seq, payload in enumerate(payloads):
        await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        if seq % 256 == 255:
            await asyncio.sleep(0)


async def embedded_rate(payloads: list[bytes]) -> float:
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex()
    ingest = IndexIngest(index, block_sizes={R: 16})
    done = asyncio.Event()
    count = [0]

    def sink(batch: object) -> None:
        ingest.apply(batch)  # type: ignore[arg-type]
        count[0] += 1
        if count[0] == len(payloads):
            done.set()

    source = ZmqEventSource(R, KvEventsConfig(endpoint=f"tcp://127.0.0.1:{port}"), sink, context=context)
    task = asyncio.create_task(source.run())
    await asyncio.sleep(0.5)
    started = time.perf_counter()
    await publish(pub, payloads)
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - started
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    pub.close(linger=0)
    context.destroy(linger=0)
    return len(payloads) / elapsed


async def relay_rate(url: str, payloads: list[bytes], workdir: Path) -> tuple[float, float]:
    redis_sync.Redis.from_url(url).flushall()
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    replicas_yaml = workdir / "replicas.yaml"
    replicas_yaml.write_text(
        yaml.safe_dump(
            {
                "block_size": 16,
                "replicas": [
                    {"name": R, "url": "http://127.0.0.1:9", "kv_events": {"endpoint": f"tcp://127.0.0.1:{port}"}}
                ],
            }
        )
    )
    relay = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvrouter.cli",
        "relay",
        "--replicas",
        str(replicas_yaml),
        "--redis-url",
        url,
        "--log-level",
        "warning",
        cwd=REPO,
    )
    index = PrefixIndex()
    follower = RedisFollower(
        lambda: connect_redis(url), [R], index, hash_seed=0, clock=time.monotonic, knobs=FollowerKnobs(block_ms=200)
    )
    follower.start()
    try:
        # Wait for the relay to create the replica's epoch and subscribe (a probe batch, then the real ones).
        await until(lambda: follower.replicas[R].vouched)
        await asyncio.sleep(1.0)
        first_entries = follower.replicas[R].entries
        started = time.perf_counter()
        await publish(pub, payloads)
        expected_seq = len(payloads) - 1
        keys = replica_keys(R)
        plain = redis_sync.Redis.from_url(url)
        while True:
            seq_text = plain.hget(keys.meta, "engine_seq") or b""
            if seq_text.endswith(f":{expected_seq}".encode()) and follower.replicas[R].position is not None:
                meta_n = int(plain.hget(keys.meta, "n") or 0)
                if follower.replicas[R].position.n >= meta_n:  # type: ignore[union-attr]
                    break
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
        entries = follower.replicas[R].entries - first_entries
        return len(payloads) / elapsed, len(payloads) / max(entries, 1)
    finally:
        await follower.stop()
        relay.terminate()
        await asyncio.wait_for(relay.wait(), 10)
        pub.close(linger=0)
        context.destroy(linger=0)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--sizes", default="100000,300000,1000000")
    parser.add_argument("--events", type=int, default=20_000, help="batches for the end-to-end rate")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    repeat = args.repeat
    if args.quick:
        sizes, repeat, args.events = [100_000], 1, 5_000
    with redis_server() as url, tempfile.TemporaryDirectory() as workdir:
        print("## catch-up state layout (per block)")
        print("blocks | snapshot B/block | snapshot read s | hash B/block | hash read s (HSCAN) | stream B/op")
        for size in sizes:
            r = await layout_costs(url, size, repeat)
            print(
                f"{r['blocks']:>9,} | {r['snapshot_bytes_per_block']:6.1f} | {r['snapshot_read_s']:.3f} | "
                f"{r['hash_bytes_per_block']:6.1f} | {r['hash_read_s']:.3f} | {r['stream_bytes_per_op']:6.1f}"
            )
        print("\n## router ready time (follower start -> index loaded)")
        print("blocks | tail ops | ready s | read+decode s | index apply s | dict baseline s | ready/baseline")
        for size in sizes:
            for tail_ratio in (0.0, 0.5):
                r = await ready_time(url, size, tail_ratio, repeat)
                print(
                    f"{r['blocks']:>9,} | {r['tail_ops']:>8,} | {r['ready_s']:.3f} | {r['read_s']:.3f} | "
                    f"{r['apply_s']:.3f} | {r['dict_baseline_s']:.3f} | {r['ready_s'] / r['dict_baseline_s']:.1f}x"
                )
        print("\n## events/s end to end (ZMQ PUB -> relay process -> Redis -> follower index)")
        payloads, blocks = make_payloads(args.events, seed=3)
        embedded, relayed, per_entry = [], [], []
        for _ in range(repeat):
            embedded.append(await embedded_rate(payloads))
            rate, batches_per_entry = await relay_rate(url, payloads, Path(workdir))
            relayed.append(rate)
            per_entry.append(batches_per_entry)
        blocks_per_batch = blocks / len(payloads)
        print(f"batches: {len(payloads):,} ({blocks_per_batch:.1f} blocks each)")
        print(
            f"relay path: {median(relayed):,.0f} batches/s ({median(relayed) * blocks_per_batch:,.0f} blocks/s), "
            f"{median(per_entry):.1f} batches per stream entry"
        )
        print(
            f"embedded baseline: {median(embedded):,.0f} batches/s; "
            f"relay/embedded: {median(relayed) / median(embedded):.2f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
