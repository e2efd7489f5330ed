"""The whole prefix plane in a running router: a PUB socket speaking vLLM's KV-event wire format on 127.0.0.1,
the router's embedded ZMQ ingest, the tokenizer, the index, and /debug/route showing the cached tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvrouter.blocks import cacheable_tokens
from kvrouter.config import parse_fleet
from kvrouter.events.wire import encode_seq
from kvrouter.openai_request import parse_request
from kvrouter.server.app import create_app
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer
from tests.conftest import ReplicaFactory, router_settings
from tests.redis_fixtures import free_port

BLOCK = 16
PROMPT = "def handler(request):\n    return request.json()\n" * 30


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture
async def publisher() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    pub = context.socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    yield pub, endpoint
    pub.close(linger=0)
    context.destroy(linger=0)


def stored(hashes: list[int], token_ids: list[int]) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "token_ids": token_ids,
        "block_size": BLOCK,
        "medium": "GPU",
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return msgspec.msgpack.encode([time.time(), [event], 0])


def removed(hashes: list[int]) -> bytes:
    return msgspec.msgpack.encode([time.time(), [{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}], 0])


async def route(client: Any) -> dict[str, int]:
    response = await client.post("/debug/route", json={"model": "m", "prompt": PROMPT})
    assert response.status == 200, await response.text()
    body = await response.json()
    return {c["replica"]: c["cached_tokens"] for c in body["candidates"]}


async def eventually(client: Any, expected: dict[str, int]) -> None:
    for _ in range(300):
        if await route(client) == expected:
            return
        await asyncio.sleep(0.02)
    assert await route(client) == expected


async def test_events_from_a_pub_socket_show_up_as_cached_tokens_on_the_right_replica(
    aiohttp_client: Any,
    fake_replicas: ReplicaFactory,
    tokenizer_dir: Path,
    publisher: tuple[zmq.asyncio.Socket, str],
) -> None:
    pub, endpoint = publisher
    replicas = await fake_replicas(2)
    fleet = parse_fleet(
        {
            "tokenizer": str(tokenizer_dir),
            "block_size": BLOCK,
            "replicas": [
                {"name": replicas[0].name, "url": replicas[0].url},
                {
                    "name": replicas[1].name,
                    "url": replicas[1].url,
                    "kv_events": {"endpoint": endpoint, "topic": "kv-events"},
                },
            ],
        },
        Path("replicas.yaml"),
    )
    client = await aiohttp_client(create_app(router_settings(), fleet, registry=CollectorRegistry()))
    ids = HfPromptTokenizer(tokenizer_dir, threads=1).token_ids(
        parse_request("completion", msgspec.json.encode({"prompt": PROMPT}))
    )[0]
    held = 10
    assert len(ids) > held * BLOCK
    hashes = [1000 + n for n in range(held)]
    first, rest = ids[: 4 * BLOCK], ids[4 * BLOCK : held * BLOCK]

    # PUB/SUB loses messages until the subscription lands, so the first store is published until it shows.
    seq = 0
    for _ in range(300):
        await pub.send_multipart([b"kv-events", encode_seq(seq), stored(hashes[:4], first)])
        seq += 1
        await asyncio.sleep(0.02)
        if (await route(client))[replicas[1].name]:
            break
    await eventually(client, {replicas[0].name: 0, replicas[1].name: 4 * BLOCK})

    # A child store chains from its parent (engine hash 1003) to the full ten blocks.
    rest_event = msgspec.msgpack.decode(stored(hashes[4:], rest))
    rest_event[1][0]["parent_block_hash"] = hashes[3]
    await pub.send_multipart([b"kv-events", encode_seq(seq), msgspec.msgpack.encode(rest_event)])
    seq += 1
    expected = cacheable_tokens(len(ids), held, BLOCK)
    await eventually(client, {replicas[0].name: 0, replicas[1].name: expected})

    metrics = await (await client.get("/metrics")).text()
    assert f'kvrouter_index_blocks{{replica="{replicas[1].name}"}} 10.0' in metrics
    assert f'kvrouter_kv_events_total{{replica="{replicas[1].name}",status="ok",type="BlockStored"}}' in metrics
    assert "kvrouter_routing_load_only 0.0" in metrics
    samples = dict(line.split(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    index_bytes = float(samples["kvrouter_index_bytes"])
    assert 0 < index_bytes < 1_000_000  # the tables of ten blocks: a few small slot arrays
    assert samples["kvrouter_tokenizer_cache_entries"] == "0.0"  # completions are not rendered
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
    assert (await client.post("/debug/route/chat", json=chat)).status == 200
    metrics = await (await client.get("/metrics")).text()
    samples = dict(line.split(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert samples["kvrouter_tokenizer_cache_entries"] == "1.0"
    assert len(PROMPT) < float(samples["kvrouter_tokenizer_cache_bytes"]) < 4 * len(PROMPT) + 4096

    # The engine evicts block 6: the prefix ends there.
    await pub.send_multipart([b"kv-events", encode_seq(seq), removed([hashes[6]])])
    seq += 1
    await eventually(client, {replicas[0].name: 0, replicas[1].name: 6 * BLOCK})

    # The engine restarts (its seq starts over): everything it held is gone.
    await pub.send_multipart([b"kv-events", encode_seq(0), removed([12345])])
    await eventually(client, {replicas[0].name: 0, replicas[1].name: 0})
    metrics = await (await client.get("/metrics")).text()
    restart = f'kvrouter_kv_events_total{{replica="{replicas[1].name}",status="restart",type="AllBlocksCleared"}} 1.0'
    assert restart in metrics


async def test_without_a_tokenizer_routing_is_load_only_and_says_so(
    aiohttp_client: Any, fake_replicas: ReplicaFactory
) -> None:
    replicas = await fake_replicas(2)
    fleet = parse_fleet({"replicas": [{"name": r.name, "url": r.url} for r in replicas]}, Path("replicas.yaml"))
    client = await aiohttp_client(create_app(router_settings(), fleet, registry=CollectorRegistry()))
    assert set((await route(client)).values()) == {0}
    assert "kvrouter_routing_load_only 1.0" in await (await client.get("/metrics")).text()
