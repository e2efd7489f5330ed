"""A simulated replica over real sockets: vLLM's OpenAI API, usage, metrics, reset, disconnects, the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvrouter.config import load_fleet
from kvrouter.routing.engine_rates import EngineTotals, parse_engine_totals
from kvrouter.sim.cli import ENGINE_KEEPALIVE_S, free_port_run
from kvrouter.sim.engine import VllmEngine
from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.sim.server import ReplicaSettings, build_replica_app
from kvrouter.sim.textio import SimTokenizer
from kvrouter.tinymodel import ensure_tokenizer
from tests.edge_support import closed_within, read_response

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[[web.Application], Awaitable[Client]]
BLOCK = 32
SCALE = 20.0
"""The `client` replica's time scale: it runs 20 times faster than its profile."""


@pytest.fixture(scope="module")
def tokenizer() -> SimTokenizer:
    return SimTokenizer(ensure_tokenizer())


@pytest.fixture
async def client(aiohttp_client: MakeClient, tokenizer: SimTokenizer) -> Client:
    profile = get_profile("cpu-tiny")
    settings = ReplicaSettings(
        name="t0", model_name="tiny", max_model_len=4096, request_overhead_s=profile.request_overhead_s,
        time_scale=SCALE,
    )  # fmt: skip
    app = build_replica_app(settings, build_engine(profile, block_size=BLOCK), tokenizer)
    return await aiohttp_client(app)


def sse_events(raw: str) -> list[Any]:
    events: list[Any] = []
    for line in raw.split("\n"):
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def metric(client: Client, name: str) -> float:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            assert 'engine="0"' in line and 'model_name="tiny"' in line
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


LONG = " ".join(f"clause {i} of the shared system prompt says something specific." for i in range(30))


async def test_completion_reports_usage_and_cached_tokens(client: Client) -> None:
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 5}
    first = await (await client.post("/v1/completions", json=body)).json()
    second = await (await client.post("/v1/completions", json=body)).json()
    usage = first["usage"]
    prompt = usage["prompt_tokens"]
    assert prompt > 3 * BLOCK
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == prompt + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // BLOCK * BLOCK
    choice = first["choices"][0]
    assert first["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str) and len(choice["text"].split()) == 5
    assert await metric(client, "vllm:prefix_cache_queries_total") == 2 * prompt
    assert await metric(client, "vllm:prefix_cache_hits_total") == (prompt - 1) // BLOCK * BLOCK


async def test_streaming_completion_with_usage(client: Client) -> None:
    body = {"prompt": LONG, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    tokens, usage = events[:-2], events[-2]
    assert len(tokens) == 4
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    without = sse_events(await (await client.post("/v1/completions", json={**body, "stream_options": None})).text())
    assert all("usage" not in e for e in without[:-1])


async def test_token_id_and_batch_prompts(client: Client) -> None:
    ids = list(range(300, 300 + 3 * BLOCK + 5))
    one = await (await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})).json()
    assert one["usage"]["prompt_tokens"] == len(ids)
    batch = await (await client.post("/v1/completions", json={"prompt": [ids, ids[:40]], "max_tokens": 3})).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["usage"]["prompt_tokens"] == len(ids) + 40
    assert batch["usage"]["completion_tokens"] == 6
    assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK + BLOCK  # both hit the first ids


async def test_chat_uses_the_chat_template_without_extra_special_tokens(
    client: Client, tokenizer: SimTokenizer
) -> None:
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Hello there"}]
    counted = await (await client.post("/tokenize", json={"messages": messages})).json()
    assert counted["tokens"] == tokenizer.encode_chat(messages)
    assert counted["tokens"].count(counted["tokens"][0]) == 1  # one BOS, from the template
    reply = await (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})).json()
    assert reply["object"] == "chat.completion"
    assert reply["usage"]["prompt_tokens"] == counted["count"]
    assert reply["choices"][0]["message"]["role"] == "assistant"
    streamed = sse_events(
        await (
            await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "stream": True})
        ).text()
    )
    assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed[0]["object"] == "chat.completion.chunk"
    assert [e["choices"][0]["finish_reason"] for e in streamed[1:-1]] == [None, "length"]
    plain = await (await client.post("/tokenize", json={"prompt": "Hello"})).json()
    assert plain["tokens"] == tokenizer.encode_completion("Hello")


async def test_models_health_reset_and_errors(client: Client) -> None:
    assert "version" in await (await client.get("/version")).json()
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 4096
    assert (await client.get("/health")).status == 200
    body = {"prompt": LONG, "max_tokens": 2}
    await client.post("/v1/completions", json=body)
    reset = await client.post("/reset_prefix_cache")
    assert reset.status == 200 and (await reset.json()) == {"success": True}
    again = await (await client.post("/v1/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    too_long = await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 5000})
    assert too_long.status == 400 and "maximum context length" in (await too_long.json())["error"]["message"]
    assert (await client.post("/v1/completions", data=b"{nope")).status == 400
    assert (await client.post("/v1/completions", json={"prompt": 5})).status == 400
    assert (await client.post("/v1/chat/completions", json={"messages": []})).status == 400


async def test_lora_adapter_requests_get_their_own_cache(aiohttp_client: MakeClient, tokenizer: SimTokenizer) -> None:
    settings = ReplicaSettings(name="t2", model_name="tiny", max_model_len=4096, time_scale=20.0, lora_adapters=("jp",))
    app = build_replica_app(settings, build_engine(get_profile("cpu-tiny"), block_size=BLOCK), tokenizer)
    client = await aiohttp_client(app)
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "jp"] and models["data"][1]["parent"] == "tiny"

    async def cached(model: str) -> int:
        body = {"model": model, "prompt": LONG, "max_tokens": 1}
        reply = await (await client.post("/v1/completions", json=body)).json()
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached("tiny") == 0
    assert await cached("jp") == 0  # same tokens, different adapter: nothing shared
    assert await cached("jp") > 0
    assert await cached("anything-else") > 0  # served by the base model


async def test_strict_model_refuses_another_name_as_vllm_does(
    aiohttp_client: MakeClient, tokenizer: SimTokenizer
) -> None:
    settings = ReplicaSettings(
        name="t3", model_name="tiny", max_model_len=4096, time_scale=20.0, lora_adapters=("jp",), strict_model=True,
        model_root="/models/tiny",
    )  # fmt: skip
    app = build_replica_app(settings, build_engine(get_profile("cpu-tiny"), block_size=BLOCK), tokenizer)
    client = await aiohttp_client(app)
    for path, body in (
        ("/v1/completions", {"model": "unknown", "prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "unknown", "messages": [{"role": "user", "content": "hi"}]}),
        ("/tokenize", {"model": "unknown", "prompt": "hi"}),
    ):
        refused = await client.post(path, json=body)
        error = (await refused.json())["error"]
        assert refused.status == 404, path
        assert error == {"message": "The model `unknown` does not exist.", "type": "NotFoundError", "param": "model",
                         "code": 404}  # fmt: skip
    for model in ("tiny", "jp", "", None):  # the served name, an adapter; missing or empty means the base model
        body = {"prompt": "hi", "max_tokens": 1} | ({} if model is None else {"model": model})
        assert (await client.post("/v1/completions", json=body)).status == 200, model
    cards = (await (await client.get("/v1/models")).json())["data"]
    assert cards[0]["root"] == "/models/tiny" and cards[0]["max_model_len"] == 4096
    assert cards[0]["permission"][0]["object"] == "model_permission"
    assert cards[1]["id"] == "jp" and cards[1]["parent"] == "tiny" and cards[1]["max_model_len"] is None


async def test_time_scale_paces_tokens_like_the_profile(aiohttp_client: MakeClient, tokenizer: SimTokenizer) -> None:
    profile = get_profile("cpu-tiny")
    scale = 4.0
    settings = ReplicaSettings(
        name="t1", model_name="tiny", max_model_len=4096, request_overhead_s=profile.request_overhead_s,
        time_scale=scale,
    )  # fmt: skip
    client = await aiohttp_client(build_replica_app(settings, build_engine(profile, block_size=BLOCK), tokenizer))
    prompt = list(range(300, 300 + 1000))
    outputs = 200
    expected = (
        profile.request_overhead_s
        + profile.step_time(1000, 0, 1000, 1000 * 500)
        + sum(profile.step_time(0, 1, 1000 + i, 0.0) for i in range(1, outputs))
    ) / scale
    started = time.monotonic()
    reply = await (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": outputs})).json()
    elapsed = time.monotonic() - started
    assert reply["usage"]["completion_tokens"] == outputs
    assert 0.9 * expected <= elapsed <= 2.5 * expected + 0.2, (elapsed, expected)
    e2e_sum = await metric(client, "vllm:e2e_request_latency_seconds_sum")
    assert e2e_sum == pytest.approx(elapsed, rel=0.2)  # metrics in wall seconds, as the client measured


async def test_a_client_that_disconnects_is_aborted_in_the_engine(client: Client) -> None:
    body = {"prompt": LONG, "max_tokens": 3000, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(client.make_url("/v1/completions"), json=body)
        await response.content.readline()
        assert await metric(client, "vllm:num_requests_running") == 1
        response.close()
    deadline = time.monotonic() + 10
    while await metric(client, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the engine kept running a request nobody reads"
        await asyncio.sleep(0.05)
    assert await metric(client, "vllm:kv_cache_usage_perc") == 0.0


async def test_cli_serves_replicas_and_writes_a_fleet_file(tmp_path: Path) -> None:
    base = free_port_run(2)
    fleet_file = tmp_path / "replicas.yaml"
    command = [
        sys.executable, "-m", "kvrouter.cli", "sim", "--replicas", "2", "--profile", "cpu-tiny",
        "--base-port", str(base), "--kv-base-port", str(free_port_run(4)), "--write-replicas", str(fleet_file),
        "--time-scale", "10", "--num-gpu-blocks", "512", "--tokenizer", str(ensure_tokenizer()),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while not fleet_file.exists():
            assert process.returncode is None, "kvrouter sim exited early"
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        fleet = load_fleet(fleet_file)
        assert [r.name for r in fleet.replicas] == ["sim-0", "sim-1"]
        assert fleet.block_size == 32 and fleet.tokenizer == str(ensure_tokenizer().resolve())
        events = fleet.replicas[1].kv_events
        assert events is not None and events.bind is False and events.endpoint.startswith("tcp://127.0.0.1:")
        async with aiohttp.ClientSession() as session:
            for replica in fleet.replicas:
                url = f"{replica.base_url}/v1/completions"
                async with session.post(url, json={"prompt": "hi there", "max_tokens": 2}) as response:
                    assert (await response.json())["usage"]["completion_tokens"] == 2
        # Like vLLM, a replica closes a connection left idle for ENGINE_KEEPALIVE_S (what a router in front of
        # real engines must live with), not aiohttp's 75 s.
        reader, writer = await asyncio.open_connection("127.0.0.1", base)
        writer.write(b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n")
        await writer.drain()
        assert (await read_response(reader))[0] == 200
        answered = time.monotonic()
        await closed_within(reader, ENGINE_KEEPALIVE_S + 5)
        idle = time.monotonic() - answered
        writer.close()
        assert ENGINE_KEEPALIVE_S - 0.5 <= idle <= ENGINE_KEEPALIVE_S + 3, idle
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)


async def test_metrics_carry_the_prefill_histograms_kv_aware_reads(client: Client) -> None:
    """Per request when it finishes, like vLLM: queue time, prefill time (scheduled to first token, in wall
    seconds: the replica runs at the profile's speed x the time scale) and the prompt tokens it computed; the
    router's engine source parses them."""
    profile = get_profile("cpu-tiny")
    prompt = list(range(300, 1300))
    for _ in range(2):  # the second finds all but the last partial block cached
        reply = await (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})).json()
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    text = await (await client.get("/metrics")).text()
    totals = parse_engine_totals(text)
    assert isinstance(totals, EngineTotals)
    assert totals.prefill_requests == 2
    assert totals.computed_tokens == len(prompt) + (len(prompt) - cached)
    first_pass = profile.step_time(len(prompt), 0, len(prompt), len(prompt) * len(prompt) / 2) / SCALE
    assert 0.9 * first_pass <= totals.prefill_s <= 3.0 * first_pass + 0.5, (totals.prefill_s, first_pass)
    assert await metric(client, "vllm:request_queue_time_seconds_count") == 2
    assert await metric(client, "vllm:time_to_first_token_seconds_sum") >= totals.prefill_s


async def test_priority_policy_serves_the_urgent_request_first_and_fcfs_refuses_priorities(
    aiohttp_client: MakeClient, tokenizer: SimTokenizer
) -> None:
    profile = get_profile("cpu-tiny")
    # One sequence at a time, so the engine's waiting order is the order requests finish in.
    config = dataclasses.replace(profile.scheduler_config(block_size=BLOCK), max_num_seqs=1, policy="priority")
    settings = ReplicaSettings(name="p0", model_name="tiny", max_model_len=4096, scheduling_policy="priority")
    client = await aiohttp_client(build_replica_app(settings, VllmEngine(config, profile), tokenizer))
    finished: list[str] = []

    async def send(name: str, priority: int | None, max_tokens: int) -> None:
        body: dict[str, Any] = {"prompt": list(range(100, 400)), "max_tokens": max_tokens}
        if priority is not None:
            body["priority"] = priority
        reply = await client.post("/v1/completions", json=body)
        assert reply.status == 200, await reply.text()
        await reply.read()
        finished.append(name)

    busy = asyncio.create_task(send("busy", None, 150))  # ~0.5 s of decoding holds the only slot
    await asyncio.sleep(0.1)
    low = asyncio.create_task(send("low", 5, 10))
    await asyncio.sleep(0.05)
    high = asyncio.create_task(send("high", -5, 10))
    await asyncio.gather(busy, low, high)
    assert finished == ["busy", "high", "low"]
    refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": "high"})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "priority"

    fcfs = ReplicaSettings(name="p1", model_name="tiny", max_model_len=4096)
    plain = await aiohttp_client(build_replica_app(fcfs, build_engine(profile, block_size=BLOCK), tokenizer))
    answer = await plain.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": -1})
    error = (await answer.json())["error"]
    assert answer.status == 400 and error["message"] == "Got priority -1 but Priority scheduling is not enabled."
    zero = await plain.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 0})
    assert zero.status == 200
