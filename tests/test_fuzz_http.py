"""Fuzz request bodies through the real router over HTTP: a client mistake is always the right 4xx with OpenAI
error JSON, never a 500 and never a hang.

tests/test_fuzz_request_bodies.py already fuzzes the parser alone with 10,000 cases per property; this goes
through everything after it too — the size cap, the chat template and tokenizer (the project's tiny tokenizer,
so routing is KV-aware and every accepted body is tokenized), block hashing, the routing decision, the relay to
a fake replica and back — over a real socket. CI runs 2,000 bodies over HTTP in all; KVROUTER_FUZZ_HTTP_EXAMPLES
sets the total for longer runs.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.server.app import create_app
from kvrouter.tinymodel import ensure_tokenizer
from tests.conftest import router_settings
from tests.fake_replica import FakeReplica
from tests.test_fuzz_request_bodies import bodies, json_values

EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_HTTP_EXAMPLES", "2000"))
MAX_BODY = 64 * 1024
ROUTES = ("/v1/chat/completions", "/v1/completions")


def fuzz(share: float) -> Any:
    examples = max(1, int(EXAMPLES * share))
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)


class Stack:
    """A fake replica and a kv_aware router with a real tokenizer, on one event loop the tests drive by hand."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.replica = FakeReplica("r0")
        self.runner: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> None:
        await self.replica.start()
        fleet = parse_fleet(
            {
                "tokenizer": str(ensure_tokenizer()),
                "block_size": 16,
                "replicas": [{"name": "r0", "url": self.replica.url}],
            },
            Path("replicas.yaml"),
        )
        settings_ = router_settings(policy="kv_aware", max_body_bytes=MAX_BODY, read_timeout_s=5.0)
        app = create_app(settings_, fleet, registry=CollectorRegistry())
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.runner is not None:
            await self.runner.cleanup()
        await self.replica.stop()

    def post(self, path: str, raw: bytes, content_type: str = "application/json") -> tuple[int, bytes, str]:
        async def send() -> tuple[int, bytes, str]:
            assert self.session is not None
            headers = {"Content-Type": content_type}
            async with self.session.post(self.url + path, data=raw, headers=headers) as response:
                return response.status, await response.read(), response.content_type

        return self.loop.run_until_complete(send())


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    loop = asyncio.new_event_loop()
    built = Stack(loop)
    loop.run_until_complete(built.start())
    yield built
    loop.run_until_complete(built.stop())
    loop.close()


def check(stack: Stack, path: str, raw: bytes) -> int:
    status, body, content_type = stack.post(path, raw)
    assert status < 500, (status, body[:300])
    if status == 200:
        return status
    assert 400 <= status < 500 and content_type == "application/json", (status, body[:300])
    error = json.loads(body)["error"]
    assert {"message", "type", "code"} <= set(error)
    assert status in (400, 413, 422), status
    if len(raw) > MAX_BODY:
        assert status == 413
    return status


@fuzz(0.5)
@given(path=st.sampled_from(ROUTES), body=bodies)
def test_structured_bodies_over_http_are_200_or_a_clean_4xx(stack: Stack, path: str, body: dict[str, Any]) -> None:
    check(stack, path, json.dumps(body).encode())


messages_of_any_shape = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | json_values},
        optional={
            "content": json_values
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": json_values})),
            "name": json_values,
            "tool_calls": json_values,
        },
    ),
    min_size=1,
    max_size=4,
)


@fuzz(0.3)
@given(
    messages=messages_of_any_shape,
    extra=st.fixed_dictionaries(
        {},
        optional={
            "stream": json_values,
            "max_tokens": json_values,
            "tools": json_values,
            "chat_template_kwargs": json_values,
            "add_generation_prompt": json_values,
            "continue_final_message": json_values,
        },
    ),
)
def test_chat_messages_of_any_shape_through_the_chat_template(
    stack: Stack, messages: list[Any], extra: dict[str, Any]
) -> None:
    check(stack, ROUTES[0], json.dumps({"model": "m", "messages": messages, **extra}).encode())


@fuzz(0.2)
@given(path=st.sampled_from(ROUTES), raw=st.binary(max_size=300))
def test_random_bytes_over_http_are_a_clean_4xx(stack: Stack, path: str, raw: bytes) -> None:
    assert check(stack, path, raw) != 200 or raw.strip().startswith(b"{")


def test_pathological_bodies(stack: Stack) -> None:
    cases: list[tuple[str, bytes, set[int]]] = [
        (ROUTES[0], b"[" * 60_000 + b"]" * 60_000, {413}),
        (ROUTES[0], b"[" * 30_000 + b"]" * 30_000, {400}),
        (ROUTES[1], b'{"prompt": "hi", "x": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}", {200, 400}),
        (ROUTES[0], b'{"messages": [{"role": "user", "content": "\xff\xfe\xc0"}]}', {400}),
        (ROUTES[1], b'{"prompt": "\\ud800 lone surrogate"}', {200, 400}),
        (ROUTES[1], json.dumps({"prompt": "y" * (MAX_BODY - 100)}).encode(), {200}),
        (ROUTES[1], json.dumps({"prompt": "y" * (MAX_BODY + 1)}).encode(), {413}),
        # Token ids the parser takes but no vocabulary has: forwarded, the engine judges them.
        (ROUTES[1], json.dumps({"prompt": [2**70]}).encode(), {200, 400}),
        (ROUTES[1], json.dumps({"prompt": [-1, 5]}).encode(), {200, 400}),
        (ROUTES[1], json.dumps({"prompt": [[1, 2], "mixed"]}).encode(), {400}),
        (ROUTES[1], json.dumps({"prompt": "x", "max_tokens": 1e308}).encode(), {400}),
        (ROUTES[1], json.dumps({"prompt": "x", "max_tokens": -1}).encode(), {400}),
        (ROUTES[1], json.dumps({"prompt": "x", "stream": "yes"}).encode(), {400}),
        (ROUTES[0], json.dumps({"messages": "hello"}).encode(), {400}),
        (ROUTES[0], json.dumps({"messages": []}).encode(), {400}),
        (ROUTES[0], b"", {400}),
        (ROUTES[0], b"null", {400}),
        (ROUTES[0], b'{"messages": [{"role": "user", "content": "a"}], "messages": 5}', {400}),
    ]
    for path, raw, expected in cases:
        status, body, _ = stack.post(path, raw)
        assert status in expected, (raw[:60], status, body[:200])
    # A form body, or no content type at all, is still read as the JSON it is or refused as a 4xx.
    for content_type in ("application/x-www-form-urlencoded", "text/plain", ""):
        status, body, _ = stack.post(ROUTES[1], b'{"prompt": "hi"}', content_type)
        assert status == 200, (content_type, body[:200])
