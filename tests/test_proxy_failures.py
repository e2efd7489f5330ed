"""Failover, the circuit breaker, client disconnects and load-aware routing, against fake replicas."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from kvrouter.server.app import REPLICAS
from tests.conftest import ReplicaFactory, RouterFactory, eventually
from tests.test_proxy import CHAT, metric_value


async def test_connect_failure_fails_over(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    await replicas[0].stop()
    for _ in range(4):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status == 200
        assert response.headers["x-kvrouter-replica"] == "r1"
    assert await metric_value(client, "kvrouter_retries_total", replica="r0", reason="connect") is not None


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_error_answer_before_first_byte_fails_over(
    fake_replicas: ReplicaFactory, make_router: RouterFactory, status: int
) -> None:
    replicas = await fake_replicas(2)
    replicas[0].behaviour.status = status
    client = await make_router(replicas)
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status == 200
        assert response.headers["x-kvrouter-replica"] == "r1"
        await response.read()
    assert len(replicas[0].completions_seen()) >= 1


async def test_last_error_answer_is_relayed_when_every_replica_fails(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2, status=500)
    client = await make_router(replicas, max_retries=1)
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 500
    assert "fails with 500" in (await response.json())["error"]["message"]
    assert sum(len(r.completions_seen()) for r in replicas) == 2


async def test_no_retry_once_streaming_started(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2, chunks=5)
    replicas[0].behaviour.die_after_chunks = 2
    client = await make_router(replicas)
    response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert response.headers["x-kvrouter-replica"] == "r0"
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for chunk in response.content.iter_any():
            received += chunk
    assert b"r0-1" in received and b"[DONE]" not in received
    assert replicas[1].seen == []


async def test_no_healthy_replica_gives_503(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas, breaker_failures=1, breaker_backoff_s=30.0)
    for replica in replicas:
        await replica.stop()
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 503
    error = (await response.json())["error"]
    assert error["code"] == "no_replica_available" and error["type"] == "server_error"
    # Both breakers are open now: the router answers without trying.
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status == 503
    assert (await response.json())["error"]["message"] == "no healthy replica is available"
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "unavailable"


async def test_breaker_skips_a_dead_replica_and_lets_it_back(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas, breaker_failures=2, breaker_backoff_s=0.3, max_retries=1)
    await replicas[0].stop()
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=CHAT)).headers["x-kvrouter-replica"] == "r1"
    state = client.app[REPLICAS].by_name["r0"]
    assert not state.routable
    assert (await (await client.get("/health")).json())["replicas"]["r0"]["state"] == "open"
    retries = await metric_value(client, "kvrouter_retries_total", replica="r0", reason="connect")
    for _ in range(4):
        assert (await client.post("/v1/chat/completions", json=CHAT)).headers["x-kvrouter-replica"] == "r1"
    assert await metric_value(client, "kvrouter_retries_total", replica="r0", reason="connect") == retries
    assert await metric_value(client, "kvrouter_breaker_opens_total", replica="r0") == 1

    await replicas[0].start()  # same port
    await eventually(lambda: state.routable, within_s=2.0)
    served = [(await client.post("/v1/chat/completions", json=CHAT)).headers["x-kvrouter-replica"] for _ in range(4)]
    assert "r0" in served
    assert (await (await client.get("/health")).json())["replicas"]["r0"]["state"] == "closed"


async def test_breaker_backoff_doubles_when_the_trial_fails(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas, breaker_failures=1, breaker_backoff_s=0.2)
    await replicas[0].stop()
    await client.post("/v1/chat/completions", json=CHAT)
    state = client.app[REPLICAS].by_name["r0"]
    first_window = state.open_until - time.monotonic()
    await eventually(lambda: state.routable)
    for _ in range(2):
        await client.post("/v1/chat/completions", json=CHAT)
    second_window = state.open_until - time.monotonic()
    assert state.opens == 2
    assert first_window <= 0.2
    assert 0.2 < second_window <= 0.4  # the back-off doubled (margin for a loaded machine)


async def test_active_probe_takes_a_sick_replica_out(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    replicas[0].behaviour.health_status = 503
    client = await make_router(replicas, health_interval_s=0.05, breaker_failures=2, breaker_backoff_s=0.1)
    state = client.app[REPLICAS].by_name["r0"]
    await eventually(lambda: not state.routable)
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=CHAT)).headers["x-kvrouter-replica"] == "r1"
    assert replicas[0].completions_seen() == []
    replicas[0].behaviour.health_status = 200
    await eventually(lambda: state.routable and state.consecutive_failures == 0)


async def test_client_disconnect_cancels_upstream_at_once(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    hold = asyncio.Event()
    replicas = await fake_replicas(1, hold=hold)
    client = await make_router(replicas)
    response = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "gone"}
    )
    await asyncio.wait_for(response.content.readany(), timeout=2.0)
    assert replicas[0].in_flight == 1
    response.close()  # drops the connection mid-stream
    took = await eventually(lambda: replicas[0].cancelled == ["gone"], within_s=2.0)
    assert took < 0.5
    assert replicas[0].finished == []
    await eventually(lambda: client.app[REPLICAS].replicas[0].consecutive_failures == 0)
    health = await (await client.get("/health")).json()
    assert health["replicas"]["r0"]["in_flight"] == 0


async def test_client_disconnect_before_first_token_cancels_upstream(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, first_delay=5.0)
    client = await make_router(replicas)
    task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "q"}))
    await eventually(lambda: replicas[0].in_flight == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: replicas[0].cancelled == ["q"], within_s=1.0)


async def test_least_loaded_avoids_a_replica_holding_slow_streams(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    hold = asyncio.Event()
    replicas[0].behaviour.hold = hold
    client = await make_router(replicas, policy="least_loaded")
    slow = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert slow.headers["x-kvrouter-replica"] == "r0"
    await slow.content.readany()
    served = [(await client.post("/v1/chat/completions", json=CHAT)).headers["x-kvrouter-replica"] for _ in range(5)]
    assert served == ["r1"] * 5
    hold.set()
    await slow.read()
    served = [(await client.post("/v1/chat/completions", json=CHAT)).headers["x-kvrouter-replica"] for _ in range(4)]
    assert sorted(set(served)) == ["r0", "r1"]  # idle again: ties rotate


async def test_half_open_replica_gets_one_trial_at_a_time(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas, breaker_failures=1, breaker_backoff_s=0.2)
    await replicas[0].stop()
    await client.post("/v1/chat/completions", json=CHAT)
    state = client.app[REPLICAS].by_name["r0"]
    assert not state.routable
    replicas[0].behaviour.first_delay = 0.3
    await replicas[0].start()
    await eventually(lambda: state.routable)
    burst = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT) for _ in range(6)))
    assert [r.headers["x-kvrouter-replica"] for r in burst].count("r0") == 1
    assert all(r.status == 200 for r in burst)
    assert (await (await client.get("/health")).json())["replicas"]["r0"]["state"] == "closed"
