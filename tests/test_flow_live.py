"""The router queue over real sockets: it holds, releases, rejects with Retry-After, forgets a client that left,
orders by band, and shows itself in /metrics and /debug (fake vLLM replicas on 127.0.0.1, the tiny tokenizer)."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.server.app import PROXY, create_app
from tests.conftest import ReplicaFactory, eventually, router_settings
from tests.fake_replica import FakeReplica
from tests.test_prefix_integration import PROMPT, tokenizer_dir
from tests.test_proxy import metric_value

__all__ = ["tokenizer_dir"]

# One prompt (~400 tokens) is far more than a 64-token engine pass, and the pinned 50 tokens/s keep kv_aware's
# estimate of its progress low: a replica with one request prefilling is saturated until its first token.
SATURATING = {
    "policy": "kv_aware",
    "kv_batch_tokens": 64,
    "kv_prefill_tokens_per_s": 50.0,
    "kv_calibrate": False,
}


async def start_router(
    aiohttp_client: Any,
    replicas: list[FakeReplica],
    tokenizer: Path,
    flow: dict[str, Any] | None = None,
    **settings: Any,
) -> TestClient[Any, Any]:
    fleet = parse_fleet(
        {
            "tokenizer": str(tokenizer),
            "block_size": 16,
            "replicas": [{"name": r.name, "url": r.url} for r in replicas],
            **({"flow": flow} if flow is not None else {}),
        },
        Path("replicas.yaml"),
    )
    app = create_app(router_settings(**{**SATURATING, **settings}), fleet, registry=CollectorRegistry())
    client: TestClient[Any, Any] = await aiohttp_client(app)
    return client


def body(number: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": f"{number} {PROMPT}", "max_tokens": 2, "stream": True, **extra}


async def queued(client: TestClient[Any, Any]) -> int:
    snapshot = await (await client.get("/debug/queue")).json()
    return sum(snapshot["queued"].values())


async def test_requests_wait_while_the_fleet_is_saturated_and_go_when_it_frees(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    (replica,) = await fake_replicas(1, first_delay=0.4)
    client = await start_router(aiohttp_client, [replica], tokenizer_dir)
    first = asyncio.create_task(client.post("/v1/completions", json=body(0)))
    await eventually(lambda: len(replica.completions_seen()) == 1, what="the first request reached the replica")
    others = [asyncio.create_task(client.post("/v1/completions", json=body(n))) for n in (1, 2)]
    await asyncio.sleep(0.1)
    assert await queued(client) == 2 and len(replica.completions_seen()) == 1  # held in the router
    snapshot = await (await client.get("/debug/queue")).json()
    assert snapshot["replicas"][replica.name].startswith("queued prefill")
    assert [entry["band"] for entry in snapshot["waiting"]] == ["normal", "normal"]
    responses = [await first, *[await task for task in others]]
    assert [response.status for response in responses] == [200, 200, 200]
    for response in responses:
        await response.read()
    assert len(replica.completions_seen()) == 3
    assert await metric_value(client, "kvrouter_flow_dispatched_total", path="queued") == 2
    assert await metric_value(client, "kvrouter_flow_dispatched_total", path="direct") == 1
    assert await metric_value(client, "kvrouter_flow_wait_seconds_count", band="normal") == 2
    assert await metric_value(client, "kvrouter_flow_queued", band="normal") == 0


async def test_a_full_band_and_a_wait_past_the_ttl_are_429_with_retry_after(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    (replica,) = await fake_replicas(1, first_delay=1.5)
    flow = {"bands": [{"name": "normal", "ttl_s": 0.3, "max_queue": 1}]}
    client = await start_router(aiohttp_client, [replica], tokenizer_dir, flow=flow)
    first = asyncio.create_task(client.post("/v1/completions", json=body(0)))
    await eventually(lambda: len(replica.completions_seen()) == 1, what="the first request reached the replica")
    waiting = asyncio.create_task(client.post("/v1/completions", json=body(1)))
    await eventually(lambda: len(client.app[PROXY].gate.queue) == 1, what="the second request queued")  # type: ignore[union-attr]
    full = await client.post("/v1/completions", json=body(2))
    assert full.status == 429 and int(full.headers["Retry-After"]) >= 1
    error = (await full.json())["error"]
    assert error["code"] == "queue_full" and "full" in error["message"]
    expired = await waiting
    assert expired.status == 429 and int(expired.headers["Retry-After"]) >= 1
    assert "waited" in (await expired.json())["error"]["message"]
    assert (await first).status == 200
    assert len(replica.completions_seen()) == 1  # neither refused request reached the replica
    assert await metric_value(client, "kvrouter_flow_rejected_total", reason="queue_full") == 1
    assert await metric_value(client, "kvrouter_flow_rejected_total", reason="ttl") == 1


async def test_a_client_that_leaves_while_queued_sends_nothing_upstream(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    (replica,) = await fake_replicas(1, first_delay=0.8)
    client = await start_router(aiohttp_client, [replica], tokenizer_dir)
    gate = client.app[PROXY].gate
    assert gate is not None
    first = asyncio.create_task(client.post("/v1/completions", json=body(0)))
    await eventually(lambda: len(replica.completions_seen()) == 1, what="the first request reached the replica")
    # A separate connection that the client closes while its request waits in the router.
    url = str(client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as session:
        leaving = asyncio.create_task(session.post(url, json=body(1)))
        await eventually(lambda: len(gate.queue) == 1, what="the second request queued")
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
    await eventually(lambda: len(gate.queue) == 0, what="the queue forgot the client that left")
    assert (await first).status == 200
    await asyncio.sleep(0.2)
    assert len(replica.completions_seen()) == 1
    assert await metric_value(client, "kvrouter_flow_cancelled_total", band="normal") == 1
    assert client.app[PROXY].load.in_flight_total() == 0


@pytest.mark.parametrize("flow", [{}, {"band_headroom": True}, {"kv_capacity_tokens": 1_000_000}])
async def test_a_high_priority_request_overtakes_the_queue(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path, flow: dict[str, Any]
) -> None:
    (replica,) = await fake_replicas(1, first_delay=0.3)
    client = await start_router(aiohttp_client, [replica], tokenizer_dir, flow)
    gate = client.app[PROXY].gate
    assert gate is not None
    assert (gate.kv_reserve is not None) == ("kv_capacity_tokens" in flow)
    tasks = [asyncio.create_task(client.post("/v1/completions", json=body(0)))]
    await eventually(lambda: len(replica.completions_seen()) == 1, what="the first request reached the replica")
    for number in (1, 2):
        tasks.append(asyncio.create_task(client.post("/v1/completions", json=body(number))))
        await eventually(lambda n=number: len(gate.queue) == n, what="queued")  # type: ignore[misc]
    tasks.append(
        asyncio.create_task(client.post("/v1/completions", json=body(3), headers={"x-kvrouter-priority": "high"}))
    )
    await eventually(lambda: len(gate.queue) == 3, what="the urgent one queued")
    for task in tasks:
        assert (await task).status == 200
    order = [seen.json()["prompt"].split(" ", 1)[0] for seen in replica.completions_seen()]
    assert order == ["0", "3", "1", "2"]


async def test_bad_and_unknown_flow_values(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    (replica,) = await fake_replicas(1)
    client = await start_router(aiohttp_client, [replica], tokenizer_dir)
    bad = await client.post("/v1/completions", json=body(0), headers={"x-kvrouter-priority": "ASAP!!"})
    assert bad.status == 400
    error = (await bad.json())["error"]
    assert error["param"] == "x-kvrouter-priority" and error["type"] == "invalid_request_error"
    bad_body = await client.post("/v1/completions", json=body(0, priority="high"))
    assert bad_body.status == 400 and (await bad_body.json())["error"]["param"] == "priority"
    unknown = await client.post("/v1/completions", json=body(0), headers={"x-kvrouter-priority": "urgent"})
    assert unknown.status == 200
    await unknown.read()
    assert await metric_value(client, "kvrouter_flow_unknown_values_total", field="priority") == 1
    assert len(replica.completions_seen()) == 1


async def test_flow_control_off_sends_everything_at_once(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    (replica,) = await fake_replicas(1, first_delay=0.3)
    client = await start_router(aiohttp_client, [replica], tokenizer_dir, flow_control=False)
    tasks = [asyncio.create_task(client.post("/v1/completions", json=body(n))) for n in range(3)]
    await eventually(lambda: len(replica.completions_seen()) == 3, what="all three reached the replica at once")
    for task in tasks:
        assert (await task).status == 200
    assert (await (await client.get("/debug/queue")).json())["enabled"] is False
    # Off, the priority and tenant headers are not read at all: not even a malformed one is refused.
    odd = await client.post("/v1/completions", json=body(7), headers={"x-kvrouter-priority": "ASAP!!"})
    assert odd.status == 200


async def test_debug_route_says_whether_a_request_would_queue(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    (replica,) = await fake_replicas(1, first_delay=0.5)
    client = await start_router(aiohttp_client, [replica], tokenizer_dir)
    idle = await (await client.post("/debug/route", json=body(9))).json()
    assert idle["flow"]["would_queue"] is False and idle["flow"]["band"] == "normal"
    first = asyncio.create_task(client.post("/v1/completions", json=body(0)))
    await eventually(lambda: len(replica.completions_seen()) == 1, what="the first request reached the replica")
    busy = await (await client.post("/debug/route", json=body(9), headers={"x-kvrouter-priority": "low"})).json()
    assert busy["flow"]["would_queue"] is True and busy["flow"]["band"] == "low"
    assert busy["flow"]["replicas"][replica.name] is not None
    assert (await first).status == 200


async def test_engine_priority_writes_the_header_band_into_the_body_only_when_asked(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    (replica,) = await fake_replicas(1)
    plain = await start_router(aiohttp_client, [replica], tokenizer_dir)
    sent = body(0, stream=False)
    response = await plain.post("/v1/completions", json=sent, headers={"x-kvrouter-priority": "high"})
    assert response.status == 200
    await response.read()
    assert "priority" not in replica.completions_seen()[-1].json()  # off by default: the body goes unchanged
    client = await start_router(aiohttp_client, [replica], tokenizer_dir, flow={"engine_priority": True})
    cases = [
        ({"x-kvrouter-priority": "high"}, {}, -1),
        ({"x-kvrouter-priority": "LOW"}, {}, 1),
        ({"x-kvrouter-priority": "-5"}, {}, -1),  # the band's distance from the default, not the header's integer
        ({"x-kvrouter-priority": "normal"}, {}, None),  # the default band: nothing to write
        ({"x-kvrouter-priority": "urgent"}, {}, None),  # an unknown band is the default band (counted)
        ({"x-kvrouter-priority": "high"}, {"priority": 3}, 3),  # the client's own field wins and is kept
        ({}, {}, None),
    ]
    for headers, extra, expected in cases:
        response = await client.post("/v1/completions", json=body(1, stream=False, **extra), headers=headers)
        assert response.status == 200, headers
        await response.read()
        forwarded = replica.completions_seen()[-1]
        assert forwarded.json().get("priority") == expected, headers
        # Nothing else changed (the router asks for a stream to assemble the answer, kvrouter.server.assembly).
        rest = {key: value for key, value in forwarded.json().items() if key not in ("stream", "stream_options")}
        assert rest == {
            key: value
            for key, value in {**body(1, **extra), "priority": expected}.items()
            if key != "stream" and value is not None
        }
    # A streamed request, a gzip body: the written field reaches the replica in plain JSON.
    packed = gzip.compress(json.dumps(body(2)).encode())
    headers = {"x-kvrouter-priority": "high", "Content-Encoding": "gzip", "Content-Type": "application/json"}
    response = await client.post("/v1/completions", data=packed, headers=headers)
    assert response.status == 200
    await response.read()
    forwarded = replica.completions_seen()[-1]
    assert forwarded.json() == {**body(2), "priority": -1}
    assert "content-encoding" not in {name.lower() for name in forwarded.headers}


async def test_a_heavy_tenant_is_held_out_of_a_light_tenants_share(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    # A budget of 2 x 1,024 tokens per replica: each ~400-token prompt takes a slice, none saturates alone.
    replicas = await fake_replicas(2, first_delay=1.5)
    client = await start_router(aiohttp_client, replicas, tokenizer_dir, kv_batch_tokens=1024)
    gate = client.app[PROXY].gate
    assert gate is not None and gate.shares is not None
    # Each direct-path answer (the tenant shares' O(1) one while nothing is queued) is the full scan's too.
    answers: list[bool] = []
    direct = gate._eligible

    def checked(flow: Any, routable: Any) -> bool:
        answer = direct(flow, routable)
        eligible = gate._dispatchable(routable)
        assert answer == (eligible is None or eligible(flow))
        answers.append(answer)
        return answer

    gate._eligible = checked  # type: ignore[method-assign]

    def seen() -> int:
        return sum(len(replica.completions_seen()) for replica in replicas)

    def send(number: int, tenant: str) -> asyncio.Task[Any]:
        headers = {"x-kvrouter-tenant": tenant}
        return asyncio.create_task(client.post("/v1/completions", json=body(number), headers=headers))

    tasks = [send(0, "light")]
    await eventually(lambda: seen() == 1, what="the light tenant's request reached a replica")
    # The noisy tenant sends until the router holds it back: it has taken more than its share of the service.
    for number in range(1, 20):
        tasks.append(send(number, "noisy"))
        await eventually(lambda n=number: seen() == n + 1 or len(gate.queue) == 1, what="sent or held")  # type: ignore[misc]
        if len(gate.queue) == 1:
            break
    assert len(gate.queue) == 1
    snapshot = await (await client.get("/debug/queue")).json()
    assert None in snapshot["replicas"].values()  # held although a replica has room: that room is the light tenant's
    assert snapshot["held_back"] == ["other"]  # the noisy tenant, not configured: its label is `other`
    held = seen()
    tasks.append(send(100, "light"))
    await eventually(lambda: seen() == held + 1, what="the light tenant's second request went past the noisy one")
    assert len(gate.queue) == 1
    for task in tasks:
        assert (await task).status == 200  # the held one goes once the prefills end
    assert seen() == len(tasks)
    assert True in answers and False in answers
