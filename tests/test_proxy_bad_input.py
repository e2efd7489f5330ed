"""The bad-input matrix: every malformed request gets the right status and OpenAI-style error JSON, fast, and
never reaches a replica."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import ReplicaFactory, RouterFactory

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"

CASES = [
    ("invalid json", CHAT_PATH, b'{"messages": [', 400, None),
    ("empty body", CHAT_PATH, b"", 400, None),
    ("not utf-8", CHAT_PATH, b'{"messages": "\xff\xfe"}', 400, None),
    ("array body", CHAT_PATH, b"[1, 2]", 400, None),
    ("string body", COMPLETION_PATH, b'"prompt"', 400, None),
    ("missing messages", CHAT_PATH, b'{"model": "m"}', 400, "messages"),
    ("messages not a list", CHAT_PATH, b'{"messages": "hi"}', 400, "messages"),
    ("empty messages", CHAT_PATH, b'{"messages": []}', 400, "messages"),
    ("message not an object", CHAT_PATH, b'{"messages": ["hi"]}', 400, "messages"),
    ("message without role", CHAT_PATH, b'{"messages": [{"content": "hi"}]}', 400, "messages"),
    ("content a number", CHAT_PATH, b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("missing prompt", COMPLETION_PATH, b'{"model": "m"}', 400, "prompt"),
    ("prompt a number", COMPLETION_PATH, b'{"prompt": 7}', 400, "prompt"),
    ("prompt mixed list", COMPLETION_PATH, b'{"prompt": ["a", 1]}', 400, "prompt"),
    ("negative token id", COMPLETION_PATH, b'{"prompt": [1, -2]}', 400, "prompt"),
    ("model a number", COMPLETION_PATH, b'{"prompt": "x", "model": 3}', 400, "model"),
    ("stream a string", COMPLETION_PATH, b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("max_tokens a string", COMPLETION_PATH, b'{"prompt": "x", "max_tokens": "9"}', 400, "max_tokens"),
    ("max_tokens negative", COMPLETION_PATH, b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("max_tokens boolean", COMPLETION_PATH, b'{"prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    ("cache_salt empty", COMPLETION_PATH, b'{"prompt": "x", "cache_salt": ""}', 400, "cache_salt"),
    ("empty prompt string", COMPLETION_PATH, b'{"prompt": ""}', 400, "prompt"),
    ("empty string in a prompt batch", COMPLETION_PATH, b'{"prompt": ["a", ""]}', 400, "prompt"),
    ("deep nesting", COMPLETION_PATH, b'{"prompt": "x", "a": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400, None),
    ("too large", COMPLETION_PATH, b'{"prompt": "' + b"x" * 5000 + b'"}', 413, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_input(
    fake_replicas: ReplicaFactory,
    make_router: RouterFactory,
    path: str,
    body: bytes,
    status: int,
    param: str | None,
) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, max_body_bytes=4096)
    response = await asyncio.wait_for(
        client.post(path, data=body, headers={"Content-Type": "application/json"}), timeout=5.0
    )
    assert response.status == status
    assert response.headers["content-type"].startswith("application/json")
    error = (await response.json())["error"]
    assert set(error) >= {"message", "type", "code"}
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert "x-request-id" in response.headers
    assert replicas[0].seen == []


async def test_chunked_body_over_the_limit_is_413(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, max_body_bytes=4096)

    async def chunks():  # type: ignore[no-untyped-def]
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    response = await client.post(COMPLETION_PATH, data=chunks())
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "request_too_large"


async def test_api_keys_are_enforced(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, api_keys=["k1", "k2"])
    body = {"prompt": "x"}
    missing = await client.post(COMPLETION_PATH, json=body)
    assert missing.status == 401
    assert (await missing.json())["error"]["type"] == "authentication_error"
    wrong = await client.post(COMPLETION_PATH, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    assert (await client.get("/v1/models")).status == 401
    assert (await client.post("/tokenize", json={"prompt": "a"})).status == 401
    ok = await client.post(COMPLETION_PATH, json=body, headers={"Authorization": "Bearer k2"})
    assert ok.status == 200
    assert "authorization" not in replicas[0].seen[-1].headers
    assert (await client.get("/health")).status == 200  # open for probes


async def test_concurrency_limit_answers_429(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    hold = asyncio.Event()
    replicas = await fake_replicas(1, hold=hold)
    client = await make_router(replicas, max_concurrency=1)
    first = await client.post(COMPLETION_PATH, json={"prompt": "x", "stream": True})
    await first.content.readany()
    second = await client.post(COMPLETION_PATH, json={"prompt": "x"})
    assert second.status == 429
    assert (await second.json())["error"]["code"] == "overloaded"
    hold.set()
    await first.read()
    assert (await client.post(COMPLETION_PATH, json={"prompt": "x"})).status == 200


async def test_wrong_method_is_rejected(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    response = await client.get(CHAT_PATH)
    assert response.status == 405
