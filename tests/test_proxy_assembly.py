"""Non-streaming requests fetched as streams and assembled (kvrouter/server/assembly.py), over real sockets.

The first assemblable request a replica gets goes whole and teaches the router the replica's answer layout; from
the second on the router asks for a stream, sees the first token when the fake engine sends it (the load book
moves the request from pending prefill to decoding at once, not at the end of its decode) and hands the client the
answer the replica would have sent whole.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from kvrouter.server.app import LOAD, PROXY
from kvrouter.typedefs import ReplicaName
from tests.conftest import ReplicaFactory, RouterFactory, eventually

CHAT: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
COMPLETION: dict[str, Any] = {"model": "fake-model", "prompt": "hello", "max_tokens": 8}
R0 = ReplicaName("r0")


def without_clock(answer: bytes) -> dict[str, Any]:
    """The answer less its clock (created) and its usage counts (the fake counts the forwarded body's bytes)."""
    decoded: dict[str, Any] = json.loads(answer)
    decoded.pop("created")
    decoded["usage"] = list(decoded["usage"])
    return decoded


def metric(client: Any, name: str, **labels: str) -> float:
    value = client.app[PROXY].metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


async def test_the_second_request_is_streamed_upstream_and_answered_as_the_replica_would(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, chunks=5)
    client = await make_router(replicas)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        learned = await client.post(path, json=body)
        assert learned.status == 200
        whole = await learned.read()
        assert "stream" not in replicas[0].seen[-1].json()  # the first one went as the client sent it
        assembled = await client.post(path, json=body)
        assert assembled.status == 200 and assembled.content_type == "application/json"
        forwarded = replicas[0].seen[-1].json()
        assert forwarded["stream"] is True and forwarded["stream_options"] == {"include_usage": True}
        assert {key: forwarded[key] for key in body} == body
        # The answer the replica sends whole, in its JSON style (learned), apart from the clock and the counts.
        assert without_clock(await assembled.read()) == without_clock(whole)
        assert (await assembled.read()).startswith(whole[: whole.index(b'"created"')])
    assert metric(client, "kvrouter_non_streaming_requests_total", replica="r0", reason="learning") == 2
    assert metric(client, "kvrouter_non_streaming_requests_total", replica="r0", reason="assembled") == 2
    assert metric(client, "kvrouter_answer_assembly_mismatches_total", replica="r0") == 0
    # The engine's cached-token report reached the router from the stream's usage chunk.
    assert metric(client, "kvrouter_actual_cached_tokens_total", replica="r0") == 0
    assert client.app[LOAD].snapshot(R0).in_flight == 0


async def test_an_assembled_request_leaves_pending_prefill_at_its_first_token(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, chunks=6, first_delay=0.05, chunk_delay=0.25)
    client = await make_router(replicas)
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200  # learns the layout
    load = client.app[LOAD]
    pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    # Decoding: the first chunk came after 0.05 s, the answer needs ~1.3 s more.
    waited = await eventually(lambda: load.snapshot(R0).decode_requests == 1, within_s=1.0, what="first token")
    snapshot = load.snapshot(R0)
    assert snapshot.in_flight == 1 and snapshot.decode_requests == 1 and not pending.done()
    response = await pending
    assert response.status == 200 and waited < 1.0
    assert load.snapshot(R0).in_flight == 0 and load.snapshot(R0).decode_requests == 0


async def test_whole_answers_stay_pending_until_their_end_when_assembly_is_off(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, chunks=6, first_delay=0.4)
    client = await make_router(replicas, assemble_non_streaming=False)
    raw = json.dumps(CHAT).encode()
    for _ in range(2):
        pending = asyncio.create_task(client.post("/v1/chat/completions", data=raw))
        await eventually(lambda: client.app[LOAD].snapshot(R0).in_flight == 1, what="request in flight")
        await asyncio.sleep(0.2)
        assert client.app[LOAD].snapshot(R0).decode_requests == 0  # no first token seen before the answer
        assert (await pending).status == 200
        assert replicas[0].seen[-1].body == raw  # forwarded byte for byte
    assert metric(client, "kvrouter_non_streaming_requests_total", replica="r0", reason="disabled") == 2


async def test_requests_a_stream_cannot_reproduce_go_whole(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    await client.post("/v1/chat/completions", json=CHAT)  # the layout is known from here on
    shapes = (
        {**CHAT, "n": 2},
        {**CHAT, "logprobs": True, "top_logprobs": 2},
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {**CHAT, "vendor_extension": 1},
        {**COMPLETION, "prompt": ["a", "b"]},
        {**COMPLETION, "echo": True},
    )
    for body in shapes:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert (await client.post(path, json=body)).status == 200
        assert "stream" not in replicas[0].seen[-1].json(), body
    assert metric(client, "kvrouter_non_streaming_requests_total", replica="r0", reason="request_shape") == 6


async def test_a_client_that_leaves_during_an_assembled_answer_cancels_the_engine(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, chunks=20, chunk_delay=0.2)
    client = await make_router(replicas)
    replicas[0].behaviour.chunk_delay = 0.0
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    replicas[0].behaviour.chunk_delay = 0.2
    url = str(client.make_url("/v1/chat/completions"))
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(url, json=CHAT))
        await eventually(lambda: client.app[LOAD].snapshot(R0).decode_requests == 1, what="first token")
        task.cancel()
    await eventually(lambda: len(replicas[0].cancelled) == 1, what="the engine's request cancelled")
    await eventually(lambda: client.app[LOAD].snapshot(R0).in_flight == 0, what="the ticket released")


async def test_a_stream_that_breaks_is_retried_and_answered_once(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2, chunks=4)
    client = await make_router(replicas, policy="round_robin")
    for _ in range(2):  # both replicas learn their layout
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    served = {replica.name: len(replica.seen) for replica in replicas}
    broken = next(replica for replica in replicas if replica.name == "r0")
    broken.behaviour.die_after_chunks = 2
    answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
    assert [answer.status for answer in answers] == [200, 200]
    texts = [json.loads(await answer.read())["choices"][0]["message"]["content"] for answer in answers]
    assert texts == ["r1-0 r1-1 r1-2 r1-3 "] * 2  # r0 broke mid-stream: nothing of it reached the client
    assert len(broken.seen) - served["r0"] >= 1


async def test_an_error_event_in_the_stream_becomes_the_answer_status(
    fake_replicas: ReplicaFactory, make_router: RouterFactory, aiohttp_server: Any
) -> None:
    """vLLM reports a failure after the stream began as one `data: {"error": ...}` event; the client asked for
    a whole answer, so it gets that error as JSON with the error's status."""
    from aiohttp import web

    whole = {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
        "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1},
    }
    error = {"error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=json.dumps(whole, separators=(",", ":")), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    server = await aiohttp_server(app)

    class Upstream:
        name = "e0"
        url = str(server.make_url("")).rstrip("/")

    client = await make_router([Upstream()])  # type: ignore[list-item]
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    failed = await client.post("/v1/completions", json=COMPLETION)
    assert failed.status == 400 and failed.content_type == "application/json"
    assert json.loads(await failed.read()) == error
