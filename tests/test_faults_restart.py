"""A replica restarts: no request may be routed on the cache credit of the engine that died, from one second after
the router can know of the restart.

Two `kvrouter sim` processes (one simulated vLLM replica each, publishing KV events over ZMQ) behind a router
(kv_aware, embedded event ingest). The router learns of a restart in one of two ways, and each is tested:
* the restarted engine's KV-event sequence numbers start over (the ZMQ source turns that into
  `AllBlocksCleared(restart=True)` for every rank);
* a connection to the replica is refused (a health probe or a request): nothing listens there, so the engine
  and its cache are gone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.index import PrefixIndex
from kvrouter.server.app import ROUTER, create_app
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually, router_settings
from tests.faults_support import SimProcess
from tests.test_proxy import metric_value

SYSTEM = "You are the support assistant of a bank. " * 30
PROMPT = {
    "model": "cpu-tiny",
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "my card is blocked"}],
    "max_tokens": 4,
}


@pytest.fixture
async def sims(tmp_path: Path) -> AsyncIterator[list[SimProcess]]:
    started = [SimProcess(name, tmp_path) for name in ("a", "b")]
    await asyncio.gather(*(asyncio.to_thread(sim.start) for sim in started))
    yield started
    for sim in started:
        sim.kill()


async def router_for(aiohttp_client: Any, sims: list[SimProcess], **overrides: Any) -> TestClient[Any, Any]:
    fleet = parse_fleet(
        {"tokenizer": sims[0].tokenizer(), "block_size": 16, "replicas": [s.replica_entry() for s in sims]},
        Path("replicas.yaml"),
    )
    settings = router_settings(policy="kv_aware", **overrides)
    client: TestClient[Any, Any] = await aiohttp_client(create_app(settings, fleet, registry=CollectorRegistry()))
    return client


def index_of(client: TestClient[Any, Any]) -> PrefixIndex:
    index = client.app[ROUTER].index
    assert isinstance(index, PrefixIndex)
    return index


async def credit(client: TestClient[Any, Any], replica: str) -> int:
    """Cached tokens the router would credit `replica` with for PROMPT right now (a dry run)."""
    answer = await (await client.post("/debug/route", json=PROMPT)).json()
    return next(int(c["cached_tokens"]) for c in answer["candidates"] if c["replica"] == replica)


async def predicted_tokens(client: TestClient[Any, Any], sims: list[SimProcess]) -> list[float]:
    """Per replica, the cached tokens the router has predicted for the requests it sent there."""
    name = "kvrouter_predicted_cached_tokens_total"
    return [await metric_value(client, name, replica=sim.name) or 0.0 for sim in sims]


async def accounted_requests(client: TestClient[Any, Any], sims: list[SimProcess]) -> float:
    """Requests whose predicted and reported cached tokens the router has counted, over all replicas."""
    name = "kvrouter_cached_tokens_error_count"
    return sum([await metric_value(client, name, replica=sim.name) or 0.0 for sim in sims])


async def eventually_async(value: Callable[[], Awaitable[float]], past: float, what: str) -> None:
    """Poll `value()` until it exceeds `past`, for up to 10 s."""
    deadline = time.perf_counter() + 10.0
    while await value() <= past:
        assert time.perf_counter() < deadline, f"{what} not counted within 10 s"
        await asyncio.sleep(0.02)


async def warm(client: TestClient[Any, Any]) -> str:
    """Send PROMPT until the replica that served it has published its blocks; returns that replica's name."""
    response = await client.post("/v1/chat/completions", json=PROMPT)
    assert response.status == 200
    await response.read()
    holder = response.headers["x-kvrouter-replica"]
    await eventually(lambda: index_of(client).blocks_of(ReplicaName(holder)) > 0, 10, "events from the holder")
    assert await credit(client, holder) > 0
    return holder


async def test_restart_seen_in_the_event_sequence_voids_the_old_credit(
    aiohttp_client: Any, sims: list[SimProcess]
) -> None:
    # Probes far apart, so the router learns of the restart only from the events.
    client = await router_for(aiohttp_client, sims, health_interval_s=60.0)
    holder = await warm(client)
    sim = next(s for s in sims if s.name == holder)
    # A working engine has published for a while: its sequence number is well past where a new one starts (the
    # new engine's first messages may be lost while the subscriber reconnects; any of the next ones shows it).
    async with aiohttp.ClientSession() as session:
        for n in range(20):
            busy = {**PROMPT, "messages": [{"role": "user", "content": f"earlier traffic {n} " * 20}]}
            async with session.post(sim.url + "/v1/chat/completions", json=busy) as response:
                assert response.status == 200
    sim.kill()
    await asyncio.to_thread(sim.start)
    # The restarted engine publishes as soon as it caches anything: a request straight to it, not through the router.
    restarts: float | None = None
    for attempt in range(50):
        other = {**PROMPT, "messages": [{"role": "user", "content": f"unrelated question {attempt} " * 20}]}
        async with aiohttp.ClientSession() as session, session.post(sim.url + "/v1/chat/completions", json=other) as r:
            assert r.status == 200
        restarts = await metric_value(
            client, "kvrouter_kv_events_total", replica=holder, type="AllBlocksCleared", status="restart"
        )
        if restarts:
            break
        await asyncio.sleep(0.1)
    assert restarts, "the router never saw the restarted engine's events"
    seen = time.perf_counter()
    # From one second after the router can know of the restart, the dead engine's credit must be gone.
    left = await credit(client, holder)
    while left and time.perf_counter() - seen < 1.0:
        await asyncio.sleep(0.02)
        left = await credit(client, holder)
    assert left == 0, f"{left} cached tokens still credited to {holder} 1 s after its restart was seen"
    # No replica holds PROMPT now (the holder restarted empty, the other never served it), so whichever serves it
    # must be predicted 0 cached tokens: a routing on the dead engine's credit counts them for the holder.
    predicted_before = await predicted_tokens(client, sims)
    accounted_before = await accounted_requests(client, sims)
    async with client.post("/v1/chat/completions", json=PROMPT) as response:
        assert response.status == 200
        await response.read()
        served_by = response.headers["x-kvrouter-replica"]
    await eventually_async(lambda: accounted_requests(client, sims), accounted_before, "the request's cached tokens")
    assert await predicted_tokens(client, sims) == predicted_before, f"{served_by} was credited cached tokens"


async def test_restart_seen_as_a_refused_connection_voids_the_old_credit(
    aiohttp_client: Any, sims: list[SimProcess]
) -> None:
    client = await router_for(aiohttp_client, sims, health_interval_s=0.2, breaker_failures=1)
    holder = await warm(client)
    sim = next(s for s in sims if s.name == holder)
    sim.kill()
    killed = time.perf_counter()
    # The next probe is refused: the credit goes with it, well within a probe period and a second.
    await eventually(lambda: index_of(client).blocks_of(ReplicaName(holder)) == 0, 5, "credit dropped")
    assert time.perf_counter() - killed < 0.2 + 1.0
    await asyncio.to_thread(sim.start)
    health: dict[str, Any] = {}
    for _ in range(100):
        health = await (await client.get("/health")).json()
        if health["replicas"][holder]["routable"]:
            break
        await asyncio.sleep(0.05)
    assert health["replicas"][holder]["routable"]
    assert await credit(client, holder) == 0
