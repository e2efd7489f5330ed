"""Access control and limits, over real sockets: client API keys, the separate admin token, what crosses to the
replicas, that nothing but configured replicas is ever contacted, body size and concurrency limits, and that logs
carry no prompt text unless `log_prompts` is set.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvrouter.server.app import SETTINGS
from tests.conftest import ReplicaFactory, RouterFactory
from tests.test_proxy import CHAT

STREAM = {**CHAT, "stream": True}
SECRET = "zebra-cobalt-7731"
"""A marker that appears in prompts and must not appear in logs."""

FORWARDING_ROUTES = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "fake-model", "prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def call(
    client: TestClient[Any, Any], method: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with client.request(method, path, json=body, headers=headers) as response:
        payload = await response.json(content_type=None) if response.content_type == "application/json" else None
        return response.status, payload


@pytest.mark.parametrize(("method", "path", "body"), FORWARDING_ROUTES, ids=[r[1] for r in FORWARDING_ROUTES])
async def test_client_keys_guard_every_forwarding_route(
    fake_replicas: ReplicaFactory, make_router: RouterFactory, method: str, path: str, body: Any
) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, api_keys=["key-one", "key-two"])
    for headers in (None, bearer("wrong"), {"Authorization": "Basic a2V5LW9uZQ=="}, bearer("")):
        status, payload = await call(client, method, path, body, headers)
        assert status == 401, headers
        assert payload["error"]["code"] == "invalid_api_key" and payload["error"]["type"] == "authentication_error"
    assert replicas[0].seen == []
    status, _ = await call(client, method, path, body, {"Authorization": "bearer key-two"})
    assert status == 200
    assert len(replicas[0].seen) == (0 if path == "/v1/models" else 1)  # the fake does not record model listings


async def test_admin_token_and_client_keys_do_not_stand_in_for_each_other(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, api_keys=["client-key"], admin_token="admin-token")
    assert (await call(client, "POST", "/debug/route", CHAT, bearer("client-key")))[0] == 401
    assert (await call(client, "GET", "/admin/replicas", None, bearer("client-key")))[0] == 401
    assert (await call(client, "POST", "/v1/chat/completions", CHAT, bearer("admin-token")))[0] == 401
    assert (await call(client, "POST", "/debug/route", CHAT, bearer("admin-token")))[0] == 200
    assert (await call(client, "GET", "/admin/replicas", None, bearer("admin-token")))[0] == 200
    assert (await call(client, "POST", "/v1/chat/completions", CHAT, bearer("client-key")))[0] == 200


async def test_without_an_admin_token_admin_is_off_and_debug_needs_a_client_key(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    """/debug/route tells which prompts are cached where: with client keys set it is never open to anyone."""
    replicas = await fake_replicas(1)
    client = await make_router(replicas, api_keys=["client-key"])
    status, payload = await call(client, "POST", "/admin/replicas/r0/drain", None)
    assert status == 403 and payload["error"]["code"] == "admin_disabled"
    assert (await call(client, "POST", "/debug/route", CHAT))[0] == 401
    assert (await call(client, "POST", "/debug/route", CHAT, bearer("client-key")))[0] == 200


async def test_the_routers_auth_header_stays_at_the_router_unless_configured(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1)
    headers = {**bearer("client-key"), "Proxy-Authorization": "Basic eDp5", "Cookie": "a=b"}
    for forward in (False, True):
        client = await make_router(replicas, api_keys=["client-key"], forward_authorization=forward)
        for method, path, body in FORWARDING_ROUTES:
            assert (await call(client, method, path, body, headers))[0] == 200
        forwarded = [seen.headers for seen in replicas[0].seen if seen.path != "/v1/models"]
        replicas[0].seen.clear()
        assert forwarded
        for seen in forwarded:
            assert ("authorization" in seen) is forward
            assert "proxy-authorization" not in seen


async def test_only_configured_replicas_are_ever_contacted(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    """No open proxying: absolute URIs, Host headers, authority-looking paths and CONNECT all stay in the fleet."""
    fleet_replica, canary = await fake_replicas(2)
    client = await make_router([fleet_replica])
    target = f"127.0.0.1:{canary.port}"
    host, port = "127.0.0.1", client.port
    attempts = [
        f"GET http://{target}/v1/models HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"GET /v1/models HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"POST /tokenize HTTP/1.1\r\nHost: {target}\r\nContent-Length: 2\r\n\r\n{{}}",
        f"GET //{target}/v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n",
        f"GET @{target}/v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n",
        f"GET /..//{target}/health HTTP/1.1\r\nHost: {host}\r\n\r\n",
        f"GET /%2F%2F{target}/health HTTP/1.1\r\nHost: {host}\r\n\r\n",
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"GET http://user@{target}/x HTTP/1.1\r\nHost: {host}\r\n\r\n",
        f"POST http://{target}/v1/chat/completions HTTP/1.1\r\nHost: {target}\r\nContent-Length: 2\r\n\r\n{{}}",
    ]
    for attempt in attempts:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(attempt.encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), timeout=5)
        writer.close()
        assert head.startswith(b"HTTP/1."), (attempt, head[:80])
    await asyncio.sleep(0.1)
    assert canary.seen == [], [(s.method, s.path) for s in canary.seen]


async def test_body_over_the_limit_is_413_everywhere(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, max_body_bytes=2048)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/debug/route"):
        status, payload = await call(client, "POST", path, big)
        assert status == 413, path
        assert payload["error"]["code"] == "request_too_large"

    async def chunks() -> Any:
        for _ in range(8):
            yield b"x" * 512

    async with client.post("/v1/chat/completions", data=chunks()) as response:
        assert response.status == 413
    assert replicas[0].seen == []


async def test_concurrency_limit_answers_429_and_frees_with_the_streams(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    hold = asyncio.Event()
    replicas = await fake_replicas(1, hold=hold)
    client = await make_router(replicas, max_concurrency=3)
    streams = [await client.post("/v1/chat/completions", json=STREAM) for _ in range(3)]
    for stream in streams:
        assert stream.status == 200
        await stream.content.readany()
    status, payload = await call(client, "POST", "/v1/chat/completions", CHAT)
    assert status == 429
    assert payload["error"]["code"] == "overloaded" and payload["error"]["message"]
    hold.set()
    for stream in streams:
        await stream.read()
    assert (await call(client, "POST", "/v1/chat/completions", CHAT))[0] == 200


async def exercise(client: TestClient[Any, Any]) -> None:
    """Requests whose prompts hold SECRET, down the paths that log: success, retry, client error, no replica."""
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": f"my password is {SECRET}"}]}
    prompt = {"model": "fake-model", "prompt": f"{SECRET} " * 10, "stream": True}
    await call(client, "POST", "/v1/chat/completions", chat)
    await call(client, "POST", "/v1/completions", prompt)
    await call(client, "POST", "/v1/chat/completions", {**chat, "max_tokens": SECRET})
    await call(client, "POST", "/v1/chat/completions", {"messages": SECRET})
    await call(client, "POST", "/v1/completions", {"prompt": {SECRET: 1}})
    await call(client, "POST", "/debug/route", chat)
    await call(client, "POST", "/tokenize", {"prompt": SECRET})


async def test_logs_hold_no_prompt_text_unless_asked(
    fake_replicas: ReplicaFactory, make_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    healthy = await fake_replicas(1)
    failing = await fake_replicas(1, status=500)
    client = await make_router([failing[0], healthy[0]])
    await exercise(client)
    assert healthy[0].completions_seen(), "the requests went through"
    assert caplog.records, "the paths under test log something"
    assert SECRET not in caplog.text

    caplog.clear()
    client = await make_router([failing[0], healthy[0]], log_prompts=True)
    assert client.app[SETTINGS].log_prompts
    await exercise(client)
    assert SECRET in caplog.text
