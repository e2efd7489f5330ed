"""Helpers for the Redis event-plane tests: real vLLM frames, a synthetic vLLM-format event stream, and a
comparable view of a prefix index."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import msgspec
import pytest

from kvrouter.index import PrefixIndex
from kvrouter.typedefs import EngineBlockHash, ReplicaName

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
KV_EVENTS = SHARED / "fixtures" / "vllm-kv-events"


def fixture_frames(run: str) -> list[list[bytes]]:
    """The raw ZMQ messages [topic, seq, payload] a real vLLM published in `run`."""
    frames_dir = KV_EVENTS / "runs" / run / "frames"
    if not frames_dir.is_dir():
        pytest.skip(f"real vLLM KV-event captures not found at {frames_dir}")
    messages = []
    for line in (frames_dir / "index.jsonl").read_text().splitlines():
        record = json.loads(line)
        messages.append([(frames_dir / name).read_bytes() for name in record["files"]])
    return messages


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
