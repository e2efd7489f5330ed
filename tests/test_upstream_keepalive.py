"""Idle upstream connections: the router never sends a request on a connection the engine is about to close.

vLLM (uvicorn) closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A request the router writes on such
a connection just as the engine closes it is lost: the router sees the connection drop, counts a failure against a
healthy replica and retries the request elsewhere, away from its cache. `upstream_keepalive_s` (below the engine's
timeout) keeps the router from reusing a connection that old.

The replica here makes that race deterministic: a request that arrives on a connection idle for longer than its
timeout is dropped unanswered with the connection, as if the close had won by a hair.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.server.app import create_app
from tests.conftest import router_settings
from tests.edge_support import content_length
from tests.faults_support import RawServer
from tests.test_proxy import metric_value

ANSWER = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class ClosingReplica(RawServer):
    """HTTP/1.1 with keep-alive, losing any request that comes on a connection idle past `idle_timeout_s`."""

    def __init__(self, name: str, idle_timeout_s: float) -> None:
        super().__init__(name, answer=None)
        self.idle_timeout_s = idle_timeout_s
        self.answered = 0
        self.dropped = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        idle_since = time.monotonic()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if time.monotonic() - idle_since > self.idle_timeout_s:
                    self.dropped += 1
                    return  # the engine's idle timer fired first: the request is lost with the connection
                await reader.readexactly(content_length(head))
                body = json.dumps(ANSWER).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                if head.startswith(b"POST"):
                    self.answered += 1
                idle_since = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def closing_replicas() -> AsyncIterator[list[ClosingReplica]]:
    replicas = [ClosingReplica(f"r{i}", idle_timeout_s=0.6) for i in range(2)]
    for replica in replicas:
        await replica.start()
    yield replicas
    for replica in replicas:
        await replica.stop()


async def send_spaced(
    aiohttp_client: Any, replicas: list[ClosingReplica], keepalive_s: float
) -> tuple[list[int], float]:
    """Four requests 0.4 s apart through a round-robin router (each replica's connection idle 0.8 s between its
    requests): the statuses the client got and the router's connection-failure retries."""
    fleet = parse_fleet({"replicas": [{"name": r.name, "url": r.url} for r in replicas]}, Path("replicas.yaml"))
    settings = router_settings(upstream_keepalive_s=keepalive_s, assemble_non_streaming=False)
    client = await aiohttp_client(create_app(settings, fleet, registry=CollectorRegistry()))
    statuses = []
    for turn in range(4):
        if turn:
            await asyncio.sleep(0.4)
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        statuses.append(response.status)
    retries = 0.0
    for replica in replicas:
        retries += await metric_value(client, "kvrouter_retries_total", replica=replica.name, reason="connect") or 0
    return statuses, retries


async def test_no_request_is_sent_on_a_connection_the_engine_is_closing(
    aiohttp_client: Any, closing_replicas: list[ClosingReplica]
) -> None:
    statuses, retries = await send_spaced(aiohttp_client, closing_replicas, keepalive_s=0.3)
    assert statuses == [200] * 4 and retries == 0
    assert [r.dropped for r in closing_replicas] == [0, 0]
    assert sum(r.answered for r in closing_replicas) == 4
    assert sum(r.connections for r in closing_replicas) >= 4  # a fresh connection each time


async def test_a_keepalive_longer_than_the_engines_loses_requests(
    aiohttp_client: Any, closing_replicas: list[ClosingReplica]
) -> None:
    """The control: with the router's keep-alive past the engine's (as it was, 60 s), requests land on closing
    connections and fail: retried on the other replica, or a 503 for the client when that one's is closing too."""
    statuses, retries = await send_spaced(aiohttp_client, closing_replicas, keepalive_s=60.0)
    assert retries >= 1 and statuses[0] == 200
    assert sum(r.dropped for r in closing_replicas) >= 1
