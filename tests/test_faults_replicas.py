"""Replica faults, end to end over real sockets: replicas in their own processes killed by SIGKILL, replicas that
hang, and things listening at a replica's address that do not speak vLLM's HTTP.

What a client must see: a clean end — an OpenAI-style error status, or for a stream already under way an SSE
error event and the end of the connection — never a hang; and the router's in-flight accounting must be back to
zero once the request is over.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from kvrouter.server.app import LOAD, PROXY
from kvrouter.typedefs import ReplicaName
from tests.conftest import ReplicaFactory, RouterFactory, eventually
from tests.faults_support import RawServer, ReplicaProcess
from tests.test_proxy import CHAT, metric_value

STREAM = {**CHAT, "stream": True}


@pytest.fixture
async def processes() -> AsyncIterator[list[ReplicaProcess]]:
    started: list[ReplicaProcess] = []
    yield started
    for replica in started:
        replica.kill()


def start_process(started: list[ReplicaProcess], name: str, **behaviour: Any) -> ReplicaProcess:
    replica = ReplicaProcess(name, **behaviour).start()
    started.append(replica)
    return replica


def in_flight(client: TestClient[Any, Any], replica: str) -> int:
    return client.app[LOAD].snapshot(ReplicaName(replica)).in_flight


async def read_stream(response: aiohttp.ClientResponse) -> tuple[bytes, str | None]:
    """Everything the client got, and how the stream ended: None when cleanly, else the exception's name."""
    received = b""
    try:
        async for chunk in response.content.iter_any():
            received += chunk
    except aiohttp.ClientError as error:
        return received, type(error).__name__
    return received, None


def sse_errors(received: bytes) -> list[dict[str, Any]]:
    events = [line[5:].strip() for line in received.split(b"\n") if line.startswith(b"data:")]
    decoded = [json.loads(e) for e in events if e and e != b"[DONE]"]
    return [e["error"] for e in decoded if "error" in e]


async def test_replica_killed_mid_stream_gives_an_error_event_and_releases_accounting(
    processes: list[ReplicaProcess], make_router: RouterFactory
) -> None:
    victim = start_process(processes, "r0", chunks=500, chunk_delay=0.01)
    client = await make_router([victim])
    response = await client.post("/v1/chat/completions", json=STREAM)
    assert response.status == 200
    first = await response.content.readany()
    assert b"r0-0" in first or b"assistant" in first
    assert in_flight(client, "r0") == 1
    victim.kill()
    started = time.perf_counter()
    received, ending = await asyncio.wait_for(read_stream(response), timeout=5)
    ended_after = time.perf_counter() - started
    assert ending is not None, "a broken stream must not look complete"
    assert b"[DONE]" not in received
    errors = sse_errors(first + received)
    assert errors and errors[-1]["code"] == "upstream_error" and errors[-1]["type"] == "server_error"
    assert ended_after < 2.0
    await eventually(lambda: in_flight(client, "r0") == 0 and client.app[PROXY].active == 0, what="accounting")
    assert await metric_value(client, "kvrouter_requests_total", replica="r0", status="upstream_error") == 1


async def test_replica_killed_before_the_first_byte_is_retried_on_another(
    processes: list[ReplicaProcess], make_router: RouterFactory
) -> None:
    slow = start_process(processes, "r0", first_delay=10.0)
    healthy = start_process(processes, "r1")
    client = await make_router([slow, healthy])
    # Round robin: of two requests in flight at once, one is parked in r0's prefill when r0 dies.
    requests = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for body in (STREAM, CHAT)]
    await asyncio.sleep(0.5)
    slow.kill()
    responses = await asyncio.wait_for(asyncio.gather(*requests), timeout=5)
    for response in responses:
        assert response.status == 200
        assert response.headers["x-kvrouter-replica"] == "r1"
        body = await response.read()
        assert b"r1-0" in body
    assert await metric_value(client, "kvrouter_retries_total", replica="r0", reason="connect") == 1
    assert in_flight(client, "r0") == 0 and in_flight(client, "r1") == 0


@pytest.mark.parametrize("body", [CHAT, STREAM], ids=["json", "stream"])
async def test_replica_that_accepts_and_says_nothing_times_out_cleanly(
    make_router: RouterFactory, body: dict[str, Any]
) -> None:
    silent = await RawServer("r0", None).start()
    try:
        client = await make_router([silent], read_timeout_s=0.5, max_retries=0)
        started = time.perf_counter()
        response = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), timeout=5)
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "no_replica_available"
        assert time.perf_counter() - started < 2.0
        assert in_flight(client, "r0") == 0
    finally:
        await silent.stop()


async def test_silent_replica_is_passed_over_for_a_healthy_one(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    silent = await RawServer("silent", None).start()
    try:
        healthy = await fake_replicas(1)
        client = await make_router([silent, *healthy], read_timeout_s=0.5, max_retries=1)
        for _ in range(4):
            response = await client.post("/v1/chat/completions", json=STREAM)
            assert response.status == 200 and response.headers["x-kvrouter-replica"] == healthy[0].name
            assert (await response.read()).rstrip().endswith(b"[DONE]")
    finally:
        await silent.stop()


async def test_replica_that_stalls_mid_stream_hits_the_per_chunk_timeout(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    stall = asyncio.Event()  # never set: the stream parks after its first chunk
    replicas = await fake_replicas(1, hold=stall, chunks=5)
    client = await make_router(replicas, read_timeout_s=0.5)
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=STREAM)
    assert response.status == 200
    received, ending = await asyncio.wait_for(read_stream(response), timeout=5)
    assert ending is not None and b"[DONE]" not in received
    assert 0.4 < time.perf_counter() - started < 2.0
    errors = sse_errors(received)
    assert errors and "TimeoutError" in errors[-1]["message"]
    await eventually(lambda: in_flight(client, "r0") == 0, what="accounting")
    await eventually(lambda: replicas[0].in_flight == 0, what="the replica's stream closed")
    stall.set()


GARBAGE = b"\x00\x17\x03garbage that is not HTTP\r\n\r\n"
HTML = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 24\r\n\r\n<html>maintenance</html>"
BROKEN_CHUNKS = [
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'10\r\ndata: {"x": 1}\n\n\r\n',
    b"zz-not-a-chunk-size\r\n",
]


@pytest.mark.parametrize(
    ("answer", "status", "code"),
    [(GARBAGE, 503, "no_replica_available"), (HTML, 502, "bad_upstream_response"), (b"", 503, "no_replica_available")],
    ids=["not-http", "html-instead-of-sse", "closes-at-once"],
)
async def test_replica_answering_garbage_gives_a_clean_error(
    make_router: RouterFactory, answer: bytes, status: int, code: str
) -> None:
    bad = await RawServer("r0", answer).start()
    try:
        client = await make_router([bad], max_retries=0)
        response = await asyncio.wait_for(client.post("/v1/chat/completions", json=STREAM), timeout=5)
        assert response.status == status
        assert (await response.json())["error"]["code"] == code
        assert in_flight(client, "r0") == 0
    finally:
        await bad.stop()


async def test_non_sse_answer_to_a_stream_is_retried_on_a_healthy_replica(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    bad = await RawServer("html", HTML).start()
    try:
        healthy = await fake_replicas(1)
        client = await make_router([bad, *healthy], max_retries=1)
        for _ in range(2):
            response = await client.post("/v1/chat/completions", json=STREAM)
            assert response.status == 200 and response.headers["x-kvrouter-replica"] == healthy[0].name
            await response.read()
    finally:
        await bad.stop()


async def test_broken_framing_mid_stream_ends_with_an_error_event(make_router: RouterFactory) -> None:
    """aiohttp stops its read timer on a framing error mid-body; the proxy's own per-chunk deadline ends it."""
    bad = await RawServer("r0", BROKEN_CHUNKS).start()
    try:
        client = await make_router([bad], max_retries=0, read_timeout_s=0.5)
        response = await client.post("/v1/chat/completions", json=STREAM)
        assert response.status == 200
        received, ending = await asyncio.wait_for(read_stream(response), timeout=5)
        assert ending is not None
        assert b'data: {"x": 1}' in received and sse_errors(received)[-1]["code"] == "upstream_error"
        await eventually(lambda: in_flight(client, "r0") == 0, what="accounting")
    finally:
        await bad.stop()


async def test_broken_framing_on_a_passthrough_path_ends_too(make_router: RouterFactory) -> None:
    bad = await RawServer("r0", BROKEN_CHUNKS).start()
    try:
        client = await make_router([bad], max_retries=0, read_timeout_s=0.5)
        response = await client.post("/tokenize", json={"prompt": "hi"})
        _, ending = await asyncio.wait_for(read_stream(response), timeout=5)
        assert ending is not None
        await eventually(lambda: in_flight(client, "r0") == 0, what="accounting")
    finally:
        await bad.stop()
