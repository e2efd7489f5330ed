"""Disaggregated prefill/decode on the live path (kvrouter.server.disagg_legs), over real sockets: both legs on the
wire as vLLM's disaggregated proxy sends them, conditional splitting, and every failure of a leg ending in one
clean answer — never a hang or a duplicated answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.server.app import LOAD, create_app
from kvrouter.server.disagg_legs import REMOTE_DECODE
from kvrouter.tinymodel import ensure_tokenizer
from tests.conftest import eventually, router_settings
from tests.fake_replica import FakeBehaviour, FakeReplica
from tests.test_proxy import metric_value

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there, a long question " * 20}]}
PdFleet = Callable[..., Awaitable[tuple[TestClient[Any, Any], dict[str, FakeReplica]]]]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture
async def pd_fleet(aiohttp_client: Any, tokenizer_dir: Path) -> AsyncIterator[PdFleet]:
    """`await pd_fleet("p0:prefill", "d0:decode", ..., mode=..., threshold=..., tokenizer=True)`: started fake
    replicas with those roles behind a started router (kv_aware)."""
    started: list[FakeReplica] = []

    async def make(
        *specs: str, mode: str = "always", threshold: int | None = None, tokenizer: bool = False, **settings: Any
    ) -> tuple[TestClient[Any, Any], dict[str, FakeReplica]]:
        replicas: dict[str, FakeReplica] = {}
        entries = []
        for spec in specs:
            name, role = spec.split(":")
            replica = FakeReplica(name, behaviour=FakeBehaviour())
            await replica.start()
            started.append(replica)
            replicas[name] = replica
            entries.append({"name": name, "url": replica.url, "role": role})
        disaggregation: dict[str, Any] = {"mode": mode, "prefill_timeout_s": 2.0}
        if threshold is not None:
            disaggregation["max_local_prefill_tokens"] = threshold
        fleet_data: dict[str, Any] = {"replicas": entries, "disaggregation": disaggregation}
        if tokenizer:
            fleet_data["tokenizer"] = str(tokenizer_dir)
        fleet = parse_fleet(fleet_data, Path("replicas.yaml"))
        app = create_app(router_settings(policy="kv_aware", **settings), fleet, registry=CollectorRegistry())
        client: TestClient[Any, Any] = await aiohttp_client(app)
        return client, replicas

    yield make
    for replica in started:
        await replica.stop()


async def test_a_split_request_sends_both_legs_as_vllms_proxy_does(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode")
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 50}
    response = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "req-1"})
    assert response.status == 200 and response.headers["x-kvrouter-replica"] == "d0"
    text = await response.text()
    assert text.rstrip().endswith("data: [DONE]") and text.count("data: [DONE]") == 1
    (prefill,) = replicas["p0"].completions_seen()
    sent = prefill.json()
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert "stream_options" not in sent and "max_completion_tokens" not in sent
    assert sent["kv_transfer_params"] == REMOTE_DECODE and sent["messages"] == CHAT["messages"]
    assert prefill.headers["x-request-id"] == "req-1"
    (decode,) = replicas["d0"].completions_seen()
    got = decode.json()
    params = got.pop("kv_transfer_params")
    assert params["remote_engine_id"] == "engine-p0" and params["do_remote_prefill"] is True
    assert params["remote_port"] == replicas["p0"].port and params["remote_block_ids"] == [[1, 2, 3]]
    assert got == body  # everything else exactly as the client sent it
    assert decode.headers["x-request-id"] == "req-1"
    assert await metric_value(client, "kvrouter_pd_plans_total", plan="split") == 1
    assert await metric_value(client, "kvrouter_pd_prefill_legs_total", replica="p0", outcome="ok") == 1
    load = client.app[LOAD]
    assert load.snapshot("p0").in_flight == 0 and load.snapshot("d0").in_flight == 0  # type: ignore[arg-type]


async def test_a_non_streaming_split_request_is_answered_whole(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode")
    for endpoint, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "m", "prompt": "x " * 300})):
        response = await client.post(endpoint, json=body)
        assert response.status == 200, await response.text()
        answer = await response.json()
        assert answer["choices"] and response.headers["x-kvrouter-replica"] == "d0"
        assert replicas["d0"].completions_seen()[-1].json()["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
    assert len(replicas["p0"].completions_seen()) == 2


async def test_conditional_runs_short_prompts_whole_on_a_decode_worker(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode", mode="conditional", threshold=64, tokenizer=True)
    short = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = await client.post("/v1/chat/completions", json=short)
    assert response.status == 200 and response.headers["x-kvrouter-replica"] == "d0"
    assert replicas["p0"].completions_seen() == []
    assert "kv_transfer_params" not in replicas["d0"].completions_seen()[-1].json()
    response = await client.post("/v1/chat/completions", json=CHAT)  # ~200 tokens: over the threshold
    assert response.status == 200
    assert len(replicas["p0"].completions_seen()) == 1
    assert "kv_transfer_params" in replicas["d0"].completions_seen()[-1].json()
    assert await metric_value(client, "kvrouter_pd_plans_total", plan="short") == 1
    # The decode worker now holds that prompt's KV (transferred), so the same prompt would run there whole...
    route = await (await client.post("/debug/route", json=CHAT)).json()
    view = route["disaggregation"]
    assert view["mode"] == "conditional" and view["max_local_prefill_tokens"] == 64
    assert view["split"] is False and view["plan"] == "short" and view["decode"] == "d0"
    # ...and a new long prompt would be split.
    other = {"model": "m", "messages": [{"role": "user", "content": "something else entirely " * 20}]}
    view = (await (await client.post("/debug/route", json=other)).json())["disaggregation"]
    assert view["split"] is True and view["prefill"] == "p0" and view["decode"] == "d0"
    assert view["local_uncached_tokens"] > 64


async def test_a_failed_prefill_worker_is_replaced_then_the_request_runs_whole(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "p1:prefill", "d0:decode")
    replicas["p0"].behaviour.status = 500
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200
    await response.read()
    prefilled_on = [name for name in ("p0", "p1") if replicas[name].completions_seen()]
    assert "p1" in prefilled_on  # p0 answered 500 (if it was asked first) and p1 did the prefill
    assert "kv_transfer_params" in replicas["d0"].completions_seen()[-1].json()
    # Every prefill worker failing: the request runs whole on the decode worker, one clean answer.
    replicas["p1"].behaviour.status = 503
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200 and response.headers["x-kvrouter-replica"] == "d0"
    assert (await response.text()).count("data: [DONE]") == 1
    assert "kv_transfer_params" not in replicas["d0"].completions_seen()[-1].json()
    assert await metric_value(client, "kvrouter_pd_fallbacks_total", reason="prefill_failed") == 1


async def test_a_prefill_answer_without_transfer_params_runs_the_request_whole(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode")
    replicas["p0"].behaviour.prefill_params = {}
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200
    assert "kv_transfer_params" not in replicas["d0"].completions_seen()[-1].json()
    assert await metric_value(client, "kvrouter_pd_prefill_legs_total", replica="p0", outcome="no_params") == 1


async def test_a_decode_worker_that_rejects_the_transfer_is_retried_whole(pd_fleet: PdFleet) -> None:
    # The prefill worker answered and then died, so the decode worker's KV pull fails and it answers 500 (as
    # vLLM does with kv_load_failure_policy "fail"): the request runs again whole, on the other decode worker.
    client, replicas = await pd_fleet("p0:prefill", "d0:decode", "d1:decode", max_retries=2)
    for name in ("d0", "d1"):
        replicas[name].behaviour.reject_transfer = 500
    for stream in (True, False):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status == 200
        if stream:
            assert (await response.text()).count("data: [DONE]") == 1
        else:
            assert len((await response.json())["choices"]) == 1
    seen = [request.json() for name in ("d0", "d1") for request in replicas[name].completions_seen()]
    assert len(seen) == 4  # per request: the refused decode leg, then the whole request on the other worker
    assert sum("kv_transfer_params" in body for body in seen) == 2
    assert await metric_value(client, "kvrouter_pd_fallbacks_total", reason="decode_refused") == 2


@pytest.mark.parametrize("stream", [True, False])
async def test_a_streamed_transfer_failure_is_retried_whole_even_on_the_same_decode_worker(
    pd_fleet: PdFleet, stream: bool
) -> None:
    # One prefill and one decode worker; the decode worker's KV pull fails and vLLM says so inside a 200 stream (a
    # non-streaming request is fetched as a stream and assembled, so it sees the same). The retry runs the request
    # whole, and the decode worker may take it: its refusal was about the transfer, not about itself.
    client, replicas = await pd_fleet("p0:prefill", "d0:decode", max_retries=1)
    replicas["d0"].behaviour.reject_transfer_streamed = True
    for _ in range(2):  # the first non-streaming request teaches the router the answer layout (sent whole)
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status == 200 and response.headers["x-kvrouter-replica"] == "d0"
        if stream:
            text = await response.text()
            assert '"error"' not in text and text.count("data: [DONE]") == 1
        else:
            assert (await response.json())["choices"][0]["message"]["content"]
    bodies = [request.json() for request in replicas["d0"].completions_seen()]
    assert [("kv_transfer_params" in body) for body in bodies] == [True, False, True, False]
    assert await metric_value(client, "kvrouter_pd_fallbacks_total", reason="decode_refused") == 2


async def test_a_prefill_4xx_goes_back_to_the_client_and_nothing_is_decoded(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode")
    replicas["p0"].behaviour.status = 400
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 400 and "error" in await response.json()
    assert response.headers["x-kvrouter-replica"] == "p0"
    assert replicas["d0"].completions_seen() == []
    assert await metric_value(client, "kvrouter_pd_prefill_legs_total", replica="p0", outcome="client_error") == 1
    assert await metric_value(client, "kvrouter_requests_total", replica="p0", status="400") == 1


async def test_a_clients_own_transfer_params_are_refused(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode")
    body = {**CHAT, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.1"}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "kv_transfer_params_not_allowed" and error["param"] == "kv_transfer_params"
    assert replicas["p0"].completions_seen() == [] and replicas["d0"].completions_seen() == []


async def test_a_client_leaving_during_the_prefill_cancels_it(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode")
    replicas["p0"].behaviour.first_delay = 30.0
    session = aiohttp.ClientSession()
    try:
        post = asyncio.ensure_future(session.post(f"http://127.0.0.1:{client.port}/v1/chat/completions", json=CHAT))
        await eventually(lambda: len(replicas["p0"].completions_seen()) == 1, what="the prefill leg sent")
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
    finally:
        await session.close()
    await eventually(lambda: len(replicas["p0"].cancelled) == 1, what="the prefill leg cancelled")
    load = client.app[LOAD]
    await eventually(lambda: load.snapshot("p0").in_flight == 0, what="the prefill ticket released")  # type: ignore[arg-type]
    assert replicas["d0"].completions_seen() == []


async def test_every_decode_worker_down_lets_a_prefill_worker_serve_whole(pd_fleet: PdFleet) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode")
    await replicas["d0"].stop()
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200
    await response.read()
    # d0 refused the decode leg's connection; the retry ran whole on the only replica left
    assert "kv_transfer_params" not in replicas["p0"].completions_seen()[-1].json()
