"""Redis goes away for a while and comes back, with a router in relay mode serving requests throughout.

While Redis is down the router keeps routing (requests never fail for it) on the index it has, says so in its
metrics (`kvrouter_redis_events_up` 0), and once Redis is back it follows the events written after the outage.
The outage lasts KVROUTER_FAULT_REDIS_DOWN_S seconds (3 in CI; the benchmark run in docs/reliability.md uses 30).
Killing and restarting the relay process is tests/test_redis_relay.py; Redis restarted empty or with its data is
tests/test_redis_plane.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvrouter.config import parse_fleet
from kvrouter.events.wire import WireDecoder
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.follower import connect_redis
from kvrouter.relay import Relay
from kvrouter.server.app import ROUTER, create_app
from kvrouter.typedefs import ReplicaName
from tests.conftest import ReplicaFactory, router_settings
from tests.redis_fixtures import RedisServer, redis_server_persistent
from tests.redis_plane_support import SyntheticEngine

pytestmark = pytest.mark.redis
__all__ = ["redis_server_persistent"]

DOWN_S = float(os.environ.get("KVROUTER_FAULT_REDIS_DOWN_S", "3"))
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


async def relay_steps(url: str, fleet: Any, engine: SyntheticEngine, seqs: range) -> int:
    """A relay (as after a restart: it reads its state back from Redis) writes `seqs` of the engine; blocks held."""
    redis = connect_redis(url, socket_timeout_s=5.0)
    relay = Relay(redis, fleet, [ReplicaName("r0")], clock_ms=lambda: time.time_ns() // 10**6)
    await relay.open()
    decoder = WireDecoder()
    for seq in seqs:
        batch, _ = decoder.decode_payload("r0", seq, engine.step())
        assert batch is not None
        relay.accept(batch)
    await relay.flush()
    held = len(relay.book[ReplicaName("r0")])
    await redis.aclose()
    return held


async def test_redis_down_and_back_while_serving(
    redis_server_persistent: RedisServer, fake_replicas: ReplicaFactory, aiohttp_client: Any
) -> None:
    server = redis_server_persistent
    replicas = await fake_replicas(1)
    fleet = parse_fleet(
        {"block_size": 16, "replicas": [
            {"name": "r0", "url": replicas[0].url, "kv_events": {"endpoint": "tcp://127.0.0.1:9"}}
        ]},
        Path("replicas.yaml"),
    )  # fmt: skip
    engine = SyntheticEngine(5)
    held = await relay_steps(server.url, fleet, engine, range(0, 30))
    client = await aiohttp_client(create_app(router_settings(redis_url=server.url), fleet))
    index = client.app[ROUTER].index
    assert isinstance(index, PrefixIndex)
    deadline = time.monotonic() + 15
    while index.blocks_of(ReplicaName("r0")) != held:
        assert time.monotonic() < deadline, "the router never loaded the index from Redis"
        await asyncio.sleep(0.05)

    server.kill()
    down_at = time.monotonic()
    statuses: list[int] = []
    while time.monotonic() - down_at < DOWN_S:
        async with client.post("/v1/chat/completions", json=CHAT) as response:
            statuses.append(response.status)
            await response.read()
        await asyncio.sleep(0.05)
    assert statuses and set(statuses) == {200}, "Redis being away must not fail requests"
    assert "kvrouter_redis_events_up 0.0" in await (await client.get("/metrics")).text()
    assert index.blocks_of(ReplicaName("r0")) == held, "the index the router has is kept while Redis is away"

    server.start()
    back_at = time.monotonic()
    held_after = await relay_steps(server.url, fleet, engine, range(30, 60))
    while index.blocks_of(ReplicaName("r0")) != held_after:
        assert time.monotonic() - back_at < 20, "the router never caught up after Redis came back"
        await asyncio.sleep(0.05)
    caught_up = time.monotonic() - back_at
    print(f"Redis down {DOWN_S:.0f} s: {len(statuses)} requests, all 200; caught up {caught_up:.2f} s after")
    assert "kvrouter_redis_events_up 1.0" in await (await client.get("/metrics")).text()
