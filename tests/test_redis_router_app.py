"""A router app in relay mode (``redis_url`` set): /ready waits for the index to load from Redis, the metrics
show the event source's health, and the index the routing core reads is the one filled from Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvrouter.config import Settings
from kvrouter.events.wire import WireDecoder
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.follower import connect_redis
from kvrouter.relay import Relay
from kvrouter.server.app import ROUTER, create_app
from kvrouter.typedefs import ReplicaName
from tests.redis_fixtures import RedisServer, redis_server_persistent
from tests.redis_plane_support import SyntheticEngine, synthetic_fleet

pytestmark = pytest.mark.redis
__all__ = ["redis_server_persistent"]

SYN = ReplicaName("syn")


async def fill_redis(url: str) -> Relay:
    redis = connect_redis(url, socket_timeout_s=5.0)
    relay = Relay(redis, synthetic_fleet(SYN), [SYN], clock_ms=lambda: time.time_ns() // 10**6)
    await relay.open()
    engine = SyntheticEngine(21)
    decoder = WireDecoder()
    for seq in range(40):
        batch, _ = decoder.decode_payload(SYN, seq, engine.step())
        assert batch is not None
        relay.accept(batch)
    await relay.flush()
    return relay


async def test_relay_mode_is_ready_only_once_the_index_is_loaded(
    redis_server_persistent: RedisServer, aiohttp_client: Any
) -> None:
    redis_server = redis_server_persistent
    relay = await fill_redis(redis_server.url)
    await relay.redis.aclose()
    redis_server.kill()  # Redis is away when the router starts
    settings = Settings(redis_url=redis_server.url, health_interval_s=60, metrics_interval_s=60)
    app = create_app(settings, synthetic_fleet(SYN))
    client = await aiohttp_client(app)
    index = app[ROUTER].index
    assert isinstance(index, PrefixIndex)
    await asyncio.sleep(0.3)
    response = await client.get("/ready")
    assert response.status == 503
    assert "events" in (await response.json())["checks"]
    assert "kvrouter_redis_events_up 0.0" in await (await client.get("/metrics")).text()

    redis_server.start()  # back, with the relay's data
    deadline = time.monotonic() + 15
    while (await client.get("/ready")).status != 200:
        assert time.monotonic() < deadline, "never ready"
        await asyncio.sleep(0.05)
    assert index.blocks_of(SYN) == len(relay.book[SYN]) > 0
    metrics = await (await client.get("/metrics")).text()
    assert "kvrouter_redis_events_up 1.0" in metrics
    assert "kvrouter_redis_events_loaded 1.0" in metrics
    assert 'kvrouter_redis_events_vouched{replica="syn"} 1.0' in metrics
