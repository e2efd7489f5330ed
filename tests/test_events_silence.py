"""A replica whose kv_events endpoint never delivers: warned about once, its event age exported and shown.

An engine publishes only when its blocks change, so silence alone is no fault; silence from a replica the router
has been sending requests to (their blocks are provisional marks in the index) is. Real ZMQ: the router follows
an endpoint where nothing publishes, then a real PUB socket binds there and speaks.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from kvrouter.blocks import chain_keys
from kvrouter.config import parse_fleet
from kvrouter.events.embedded import EmbeddedEvents
from kvrouter.events.metrics import EventMetrics
from kvrouter.events.wire import encode_seq
from kvrouter.index import PrefixIndex
from kvrouter.server.app import create_app
from kvrouter.typedefs import ReplicaName
from tests.conftest import router_settings
from tests.redis_fixtures import free_port

A = ReplicaName("a")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_silent_endpoint_is_warned_about_once_and_its_age_exported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    fleet = parse_fleet(
        {"replicas": [{"name": "a", "url": "http://127.0.0.1:9", "kv_events": {"endpoint": endpoint}}]},
        Path("replicas.yaml"),
    )
    registry = CollectorRegistry(auto_describe=True)
    index = PrefixIndex(provisional_ttl_s=1e9)
    clock = Clock()
    events = EmbeddedEvents(fleet, index, EventMetrics(registry), silent_after_s=60.0, clock=clock)
    await events.start()
    context = zmq.asyncio.Context()
    try:
        clock.now += 120
        assert events.check_silent() == [], "an idle replica that nobody routes to may stay silent"
        index.add_provisional(A, chain_keys(list(range(32)), 16, seed=0), clock.now)
        with caplog.at_level(logging.WARNING, logger="kvrouter.events.embedded"):
            assert events.check_silent() == [A]
            assert events.check_silent() == [], "warned once"
        assert any(endpoint in record.getMessage() for record in caplog.records)
        assert events.describe(A) == {"endpoint": endpoint, "last_event_age_s": None, "silent": True}
        assert 'kvrouter_kv_event_age_seconds{replica="a"} 120.0' in generate_latest(registry).decode()

        pub = context.socket(zmq.PUB)
        pub.bind(endpoint)
        payload = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}], 0])
        for seq in range(200):  # PUB/SUB drops messages until the subscription has propagated
            await pub.send_multipart([b"kv-events", encode_seq(seq), payload])
            await asyncio.sleep(0.02)
            if events.describe(A)["last_event_age_s"] is not None:  # type: ignore[index]
                break
        described = events.describe(A)
        assert described is not None and described["last_event_age_s"] == 0.0
        clock.now += 5
        assert 'kvrouter_kv_event_age_seconds{replica="a"} 5.0' in generate_latest(registry).decode()
        pub.close(0)
    finally:
        await events.stop()
        context.destroy(linger=0)


async def test_health_shows_each_replicas_event_stream(aiohttp_client: Any) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    fleet = parse_fleet(
        {"replicas": [{"name": "a", "url": "http://127.0.0.1:9", "kv_events": {"endpoint": endpoint}}]},
        Path("replicas.yaml"),
    )
    client = await aiohttp_client(create_app(router_settings(), fleet, registry=CollectorRegistry()))
    response = await client.get("/health")
    body = await response.json()
    assert body["replicas"]["a"]["kv_events"] == {"endpoint": endpoint, "last_event_age_s": None, "silent": False}
