"""Helpers for the Redis event-plane tests: real vLLM frames, a synthetic vLLM-format event stream, a fleet of
replicas known only by their events, and a comparable view of a prefix index."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvrouter.config import FleetConfig, KvEventsConfig, ReplicaConfig
from kvrouter.index import PrefixIndex
from kvrouter.typedefs import EngineBlockHash, ReplicaName
from tests.shared_data import VLLM_CAPTURES, shared


def fixture_frames(run: str) -> list[list[bytes]]:
    """The raw ZMQ messages [topic, seq, payload] a real vLLM published in `run`."""
    frames_dir = shared(VLLM_CAPTURES / "runs" / run / "frames")
    messages = []
    for line in (frames_dir / "index.jsonl").read_text().splitlines():
        record = json.loads(line)
        messages.append([(frames_dir / name).read_bytes() for name in record["files"]])
    return messages


def synthetic_fleet(*names: ReplicaName, block_size: int = 16) -> FleetConfig:
    """Replicas that exist only as event streams the test feeds (port 9 in their URL and endpoint: never dialed)."""
    return FleetConfig(
        replicas=[
            ReplicaConfig(
                name=name,
                url="http://127.0.0.1:9",  # type: ignore[arg-type]
                kv_events=KvEventsConfig(endpoint="tcp://127.0.0.1:9"),
            )
            for name in names
        ],
        block_size=block_size,
    )


class SyntheticEngine:
    """vLLM >= 0.24-shaped payloads: chains of stored blocks (with parents), LRU evictions, optional clears."""

    def __init__(self, seed: int, *, block_size: int = 16, capacity: int = 400, vocabulary: int = 5000) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.capacity = capacity
        self.vocabulary = vocabulary
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.encoder = msgspec.msgpack.Encoder()
        self.ts = 1_796_000_000.0

    def _hash(self) -> int:
        return self.rng.getrandbits(64)

    def step(self, *, clear: bool = False) -> bytes:
        events: list[dict[str, object]] = []
        if clear:
            self.cached.clear()
            events.append({"type": "AllBlocksCleared"})
        blocks = self.rng.randint(1, 8)
        parent = None
        if self.cached and self.rng.random() < 0.7:
            parent = self.rng.choice(list(self.cached)[-50:])
        hashes = [self._hash() for _ in range(blocks)]
        tokens = [self.rng.randrange(self.vocabulary) for _ in range(blocks * self.block_size)]
        stored: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "medium": "GPU",
        }
        events.append(stored)
        for h in hashes:
            self.cached[h] = None
        evicted = []
        while len(self.cached) > self.capacity:
            evicted.append(self.cached.popitem(last=False)[0])
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        self.ts += 0.01
        return self.encoder.encode([self.ts, events, 0])


def index_view(index: PrefixIndex, replicas: Iterable[ReplicaName], hashes: Iterable[int]) -> dict[str, object]:
    """What an index says about every engine hash ever published: comparable across router instances."""
    view: dict[str, object] = {"counts": index.block_counts()}
    hash_list = list(hashes)
    for replica in replicas:
        view[replica] = {h: index.key_of(replica, EngineBlockHash(h)) for h in hash_list}
    return view


class FramePublisher:
    """A vLLM-style publisher of raw payloads: PUB ``[topic, seq, payload]`` and a ROUTER replay socket that
    answers ``[b"", seq]`` with every buffered message from `seq` on, then the end marker (seq 2**64-1)."""

    def __init__(self, context: zmq.asyncio.Context, *, topic: bytes = b"kv-events", buffer: int = 10_000) -> None:
        self.context = context
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.next_seq = 0
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = context.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.task = asyncio.create_task(self._serve_replay())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, payload: bytes) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.replay.recv_multipart()
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.replay.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([identity, b"", b"", ((1 << 64) - 1).to_bytes(8, "big"), b""])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(linger=0)
        self.replay.close(linger=0)


class TwoReplicaPlane:
    """The Redis event plane over two synthetic replicas, ``good`` and ``bad``: a relay core (driven by the test:
    `write` feeds engine steps and flushes; `verify` is the relay's idle check) and one router's follower over a
    real `PrefixIndex`. Hostile tests write into ``bad``'s keys with `raw` and check that ``good`` keeps flowing."""

    GOOD = ReplicaName("good")
    BAD = ReplicaName("bad")

    def __init__(self, url: str, *, follower_knobs: Any = None, sink: PrefixIndex | None = None) -> None:
        from kvrouter.events.wire import WireDecoder
        from kvrouter.redisplane.follower import FollowerKnobs, RedisFollower, connect_redis
        from kvrouter.redisplane.writer import WriterKnobs
        from kvrouter.relay import Relay, RelayKnobs

        self.url = url
        self.fleet = synthetic_fleet(self.GOOD, self.BAD)
        self.redis = connect_redis(url, socket_timeout_s=10.0)
        self.raw = connect_redis(url, socket_timeout_s=10.0)
        knobs = RelayKnobs(flush_interval_s=0.0, verify_interval_s=0.1, writer=WriterKnobs(snapshot_min_blocks=64))
        self.relay = Relay(
            self.redis, self.fleet, [self.GOOD, self.BAD], clock_ms=lambda: time.time_ns() // 10**6, knobs=knobs
        )
        self.engines = {self.GOOD: SyntheticEngine(1), self.BAD: SyntheticEngine(2)}
        self.seqs = {self.GOOD: 0, self.BAD: 0}
        self.decoder = WireDecoder()
        self.index = sink if sink is not None else PrefixIndex()
        self.follower = RedisFollower(
            lambda: connect_redis(url, block_ms=100),
            [self.GOOD, self.BAD],
            self.index,
            hash_seed=0,
            clock=time.monotonic,
            knobs=follower_knobs
            or FollowerKnobs(
                block_ms=100, backoff_initial_s=0.05, backoff_max_s=0.2, resync_initial_s=0.1, resync_max_s=0.5,
                taint_check_s=0.1,
            ),
        )  # fmt: skip

    async def start(self, *, loaded: bool = True) -> None:
        await self.relay.open()
        await self.relay.flush()
        self.follower.start()
        if loaded:
            await asyncio.wait_for(self.follower.loaded.wait(), 20)

    async def write(self, replica: ReplicaName, steps: int = 5) -> None:
        for _ in range(steps):
            batch, problems = self.decoder.decode_payload(replica, self.seqs[replica], self.engines[replica].step())
            assert batch is not None and not problems
            self.seqs[replica] += 1
            self.relay.accept(batch)
        await self.relay.flush()

    def held(self, replica: ReplicaName) -> dict[int, int]:
        """The relay's authoritative blocks of `replica`: engine hash -> key."""
        return {h: k for table in self.relay.book[replica].blocks().values() for h, k in table.items()}

    def indexed(self, replica: ReplicaName) -> dict[int, int]:
        return {h: int(self.index.key_of(replica, EngineBlockHash(h)) or -1) for h in self.held(replica)}

    def agrees(self, replica: ReplicaName) -> bool:
        """The router's index holds exactly the relay's blocks for `replica`, and no more."""
        return self.index.blocks_of(replica) == len(self.relay.book[replica]) and self.indexed(replica) == self.held(
            replica
        )

    def problems(self, replica: ReplicaName) -> dict[str, int]:
        follower = {reason: n for (name, reason), n in self.follower.problems.counts.items() if name == replica}
        relay = self.relay.writers[replica].problems.counts
        return follower | {f"relay:{reason}": n for (_, reason), n in relay.items()}

    async def close(self) -> None:
        await self.follower.stop()
        await self.redis.aclose()
        await self.raw.aclose()
