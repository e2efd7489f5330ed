"""Forwarding and streaming through kvrouter in front of fake vLLM replicas (real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvrouter.server.app import LOAD, SESSION
from kvrouter.typedefs import ReplicaName
from tests.conftest import ReplicaFactory, RouterFactory

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


def sse_payloads(raw: bytes) -> list[Any]:
    events = [event for event in raw.split(b"\n\n") if event.strip()]
    payloads = []
    for event in events:
        assert event.startswith(b"data: "), event
        data = event[6:]
        payloads.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return payloads


async def metric_value(client: TestClient[Any, Any], name: str, **labels: str) -> float | None:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            return float(value)
    return None


async def test_chat_and_completion_round_trip(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    chat = await client.post("/v1/chat/completions", json=CHAT)
    assert chat.status == 200
    served = chat.headers["x-kvrouter-replica"]
    assert (await chat.json())["choices"][0]["message"]["content"] == f"{served}-0 {served}-1 {served}-2 "
    completion = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "once upon"})
    assert completion.status == 200
    served = completion.headers["x-kvrouter-replica"]
    assert (await completion.json())["choices"][0]["text"].startswith(f"{served}-0 ")
    assert [len(r.completions_seen()) for r in replicas] == [1, 1]


async def test_stream_is_relayed_event_by_event(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1, chunks=4, chunk_delay=0.01)
    client = await make_router(replicas)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in response.headers
    payloads = sse_payloads(await response.read())
    assert payloads[-1] == "[DONE]"
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[:-1] if p["choices"])
    assert text == "r0-0 r0-1 r0-2 r0-3 "
    assert payloads[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_first_chunk_arrives_before_the_replica_finishes(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    hold = asyncio.Event()
    replicas = await fake_replicas(1, hold=hold)
    client = await make_router(replicas)
    response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    first = await asyncio.wait_for(response.content.readany(), timeout=2.0)
    assert b"r0-0" in first
    assert replicas[0].finished == [] and replicas[0].in_flight == 1
    hold.set()
    rest = await response.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert len(replicas[0].finished) == 1


async def test_first_chunk_latency_on_kept_alive_connection(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    """No Nagle/delayed-ACK stall (about 40 ms) on either hop: each small chunk is forwarded at once."""
    replicas = await fake_replicas(1, chunks=3, chunk_delay=0.05)
    client = await make_router(replicas)
    firsts, gaps = [], []
    for _ in range(6):
        started = time.perf_counter()
        response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        chunk = await response.content.readany()
        while b"r0-0" not in chunk:
            chunk += await response.content.readany()
        firsts.append(time.perf_counter() - started)
        mark = time.perf_counter()
        chunk = await response.content.readany()
        while b"r0-1" not in chunk:
            chunk += await response.content.readany()
        gaps.append(time.perf_counter() - mark - 0.05)
        await response.read()
    assert statistics.median(firsts[1:]) < 0.015, firsts
    assert statistics.median(gaps[1:]) < 0.015, gaps


async def test_request_id_is_propagated_or_generated(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    given = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-42"})
    assert given.headers["x-request-id"] == "req-42"
    assert replicas[0].seen[-1].headers["x-request-id"] == "req-42"
    generated = await client.post("/v1/chat/completions", json=CHAT)
    request_id = generated.headers["x-request-id"]
    assert len(request_id) == 32 and request_id != "req-42"
    assert replicas[0].seen[-1].headers["x-request-id"] == request_id


async def test_hop_by_hop_headers_are_dropped(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    headers = {
        "Connection": "keep-alive, X-Private-Hop",
        "X-Private-Hop": "secret",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic abc",
        "Authorization": "Bearer client-key",
        "X-Custom": "kept",
        "OpenAI-Organization": "org-1",
    }
    response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status == 200
    seen = {name.lower(): value for name, value in replicas[0].seen[-1].headers.items()}
    for dropped in ("x-private-hop", "keep-alive", "te", "proxy-authorization", "authorization"):
        assert dropped not in seen, dropped
    assert seen["x-custom"] == "kept" and seen["openai-organization"] == "org-1"


async def test_authorization_is_forwarded_when_configured(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, forward_authorization=True)
    await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k"})
    assert replicas[0].seen[-1].headers["Authorization"] == "Bearer k"


async def test_unknown_fields_pass_through_byte_for_byte(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    raw = (
        b'{"model" : "fake-model",\n "messages":[{"role":"user","content":"h\\u00e9llo","name":"x"}],'
        b' "top_k": 5, "vendor_extension": {"nested": [1, 2.50, null]}, "guided_json": {"type": "object"}}'
    )
    response = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    assert response.status == 200
    assert replicas[0].seen[-1].body == raw


async def test_round_robin_alternates(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(3)
    client = await make_router(replicas, policy="round_robin")
    served = []
    for _ in range(6):
        response = await client.post("/v1/chat/completions", json=CHAT)
        served.append(response.headers["x-kvrouter-replica"])
    assert served == ["r0", "r1", "r2", "r0", "r1", "r2"]


async def test_models_are_merged_from_replicas(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(3)
    replicas[2].model = "other-model"
    client = await make_router(replicas)
    response = await client.get("/v1/models")
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "list"
    assert sorted(entry["id"] for entry in body["data"]) == ["fake-model", "other-model"]


async def test_other_vllm_paths_pass_through(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    tokenized = await client.post("/tokenize", json={"model": "fake-model", "prompt": "ab"})
    assert tokenized.status == 200
    assert (await tokenized.json())["tokens"] == [97, 98]
    assert tokenized.headers["x-kvrouter-replica"] in ("r0", "r1")
    detokenized = await client.post("/detokenize", json={"tokens": [104, 105]})
    assert (await detokenized.json())["prompt"] == "hi"
    missing = await client.get("/v1/no-such-thing?x=1")
    assert missing.status == 404  # the replica's answer, relayed


async def test_health_reports_router_and_replicas(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    response = await client.get("/health")
    assert response.status == 200
    body = await response.json()
    assert body["status"] == "ok" and body["policy"] == "round_robin"
    assert set(body["replicas"]) == {"r0", "r1"}
    assert body["replicas"]["r0"]["state"] == "closed" and body["replicas"]["r0"]["in_flight"] == 0


async def test_metrics_count_requests_and_ttft(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    await client.post("/v1/chat/completions", json=CHAT)
    await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).read()
    route = "/v1/chat/completions"
    assert await metric_value(client, "kvrouter_requests_total", replica="r0", route=route, status="200") == 2
    assert await metric_value(client, "kvrouter_ttft_seconds_count", replica="r0", route=route) == 1
    assert await metric_value(client, "kvrouter_request_duration_seconds_count", replica="r0", route=route) == 2
    assert await metric_value(client, "kvrouter_routing_decision_seconds_count") == 2
    assert await metric_value(client, "kvrouter_in_flight_requests", replica="r0") == 0
    assert await metric_value(client, "kvrouter_replica_healthy", replica="r0") == 1


async def test_engine_gauges_are_scraped_and_summed_over_engines(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, waiting=(2, 3), running=(1, 4), kv_usage=(0.2, 0.4))
    client = await make_router(replicas, metrics_interval_s=0.05)
    load = client.app[LOAD]
    for _ in range(100):
        snapshot = load.snapshot(ReplicaName("r0"))
        if snapshot.engine_waiting is not None:
            break
        await asyncio.sleep(0.02)
    assert (snapshot.engine_waiting, snapshot.engine_running) == (5, 5)
    assert snapshot.kv_usage is not None and abs(snapshot.kv_usage - 0.3) < 1e-9


async def test_debug_route_is_a_dry_run(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    first = await (await client.post("/debug/route", json=CHAT)).json()
    second = await (await client.post("/debug/route?endpoint=chat", json=CHAT)).json()
    assert first["chosen"] == second["chosen"] == "r0"
    assert [c["replica"] for c in first["candidates"]] == ["r0", "r1"]
    assert all({"cached_tokens", "score"} <= set(c) for c in first["candidates"])
    completion = await (await client.post("/debug/route", json={"prompt": "x"})).json()
    assert completion["endpoint"] == "completion"
    assert all(r.seen == [] for r in replicas)
    served = await client.post("/v1/chat/completions", json=CHAT)
    assert served.headers["x-kvrouter-replica"] == "r0"
    bad = await client.post("/debug/route/nonsense", json=CHAT)
    assert bad.status == 400


async def test_calibrated_costs_show_per_replica(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas, policy="kv_aware")
    # Before any traffic: the starting estimates, in the metrics and on every candidate of /debug/route.
    assert await metric_value(client, "kvrouter_kv_calibrated_prefill_tokens_per_s", replica="r1") == 10_000
    assert await metric_value(client, "kvrouter_kv_calibrated_samples", replica="r0") == 0
    assert await metric_value(client, "kvrouter_kv_cache_weight") == 1.0
    for _ in range(60):
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
    route = await (await client.post("/debug/route", json={"prompt": "x"})).json()
    for candidate in route["candidates"]:
        name = candidate["replica"]
        # Each replica was fitted on its own requests' TTFTs; the metric shows what the decision used.
        assert candidate["calibration_samples"] >= 24
        assert (
            await metric_value(client, "kvrouter_kv_calibrated_samples", replica=name)
            == (candidate["calibration_samples"])
        )
        assert await metric_value(client, "kvrouter_kv_calibrated_pass_seconds", replica=name) == pytest.approx(
            candidate["pass_fixed_s"]
        )
        assert candidate["prefill_tokens_per_s"] > 0


async def test_debug_route_needs_the_admin_token(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, admin_token="s3cret")
    denied = await client.post("/debug/route", json=CHAT)
    assert denied.status == 401
    assert (await denied.json())["error"]["code"] == "invalid_admin_token"
    allowed = await client.post("/debug/route", json=CHAT, headers={"Authorization": "Bearer s3cret"})
    assert allowed.status == 200 and (await allowed.json())["chosen"] == "r0"


async def test_predicted_and_actual_cached_tokens_are_recorded(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, cached_tokens=32)
    client = await make_router(replicas)
    await (await client.post("/v1/chat/completions", json=CHAT)).read()
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    await (await client.post("/v1/chat/completions", json=stream)).read()
    # A stream without a usage chunk reports nothing, so it must not count.
    await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).read()
    assert await metric_value(client, "kvrouter_actual_cached_tokens_total", replica="r0") == 64
    assert await metric_value(client, "kvrouter_predicted_cached_tokens_total", replica="r0") == 0
    assert await metric_value(client, "kvrouter_cached_tokens_error_count", replica="r0") == 2
    # Both requests were off by +32 tokens (no index yet: predicted 0).
    assert await metric_value(client, "kvrouter_cached_tokens_error_bucket", replica="r0", le="16.0") == 0
    assert await metric_value(client, "kvrouter_cached_tokens_error_bucket", replica="r0", le="64.0") == 2


def _nodelay(transport: Any) -> bool:
    sock = transport.get_extra_info("socket")
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


async def test_tcp_nodelay_on_both_hops(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    await (await client.post("/v1/chat/completions", json=CHAT)).read()
    assert client.server.runner is not None and client.server.runner.server is not None
    accepted = client.server.runner.server.connections
    assert accepted and all(_nodelay(handler.transport) for handler in accepted)
    # The pooled upstream connection, idle after the request (aiohttp keeps no public view of its pool).
    pooled = [proto for conns in client.app[SESSION].connector._conns.values() for proto, _ in conns]  # type: ignore[union-attr]
    assert pooled and all(_nodelay(proto.transport) for proto in pooled)
