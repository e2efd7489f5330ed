"""Hostile prompts (issue 15): caps checked before tokenizing (413, OpenAI's error shape), token ids outside
32 bits or the vocabulary (400), deep JSON nesting (400, /debug/route included), large prompts on their own
bounded lane (429 beyond), and a render cache bounded in bytes (measured with tracemalloc)."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvrouter.openai_request import parse_request
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer, PromptLimits
from tests.conftest import ReplicaFactory
from tests.edge_support import edge_router


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


async def post(url: str, path: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session, session.post(url + path, data=data, headers=headers) as response:
        return response.status, await response.json(content_type=None)


def assert_openai_error(answer: dict[str, Any], code: str) -> None:
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and isinstance(error["message"], str)


async def test_prompt_caps_token_ids_and_nesting_over_http(fake_replicas: ReplicaFactory, tiny_dir: Path) -> None:
    replicas = await fake_replicas(1)
    caps = {"max_prompt_chars": 2000, "max_prompt_tokens": 100, "policy": "kv_aware"}
    async with edge_router(replicas, tokenizer=tiny_dir, **caps) as router:
        chat = "/v1/chat/completions"
        long_chat = {"messages": [{"role": "user", "content": "a" * 1500}, {"role": "user", "content": "b" * 600}]}
        status, answer = await post(router.url, chat, long_chat)
        assert status == 413
        assert_openai_error(answer, "prompt_too_large")
        parts = [{"type": "text", "text": "c" * 1100}, {"type": "text", "text": "d" * 1000}]
        status, _ = await post(router.url, chat, {"messages": [{"role": "user", "content": parts}]})
        assert status == 413
        status, answer = await post(router.url, "/v1/completions", {"prompt": list(range(101))})
        assert status == 413
        assert_openai_error(answer, "prompt_too_large")
        status, _ = await post(router.url, "/v1/completions", {"prompt": "word " * 300})  # < 2000 chars, > 100 tokens
        assert status == 413
        assert router.rejections("prompt_too_large") == 4
        # Token ids: >= 2**32 and negative are 400 at parsing; outside the vocabulary, 400 before tokenizing.
        for ids in ([2**32], [2**40, 1], [-1], [[1, 2], [3, 2**32]]):
            status, answer = await post(router.url, "/v1/completions", {"prompt": ids})
            assert status == 400, ids
            assert_openai_error(answer, "invalid_request")
        status, answer = await post(router.url, "/v1/completions", {"prompt": [1, 10**9]})
        assert status == 400
        assert_openai_error(answer, "invalid_token_id")
        assert router.rejections("bad_token_ids") == 1
        # Deep nesting: the JSON decoder's recursion limit is a 400, on the completion path and on /debug/route.
        deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        for path in (chat, "/v1/completions", "/debug/route", "/debug/route/chat"):
            status, answer = await post(router.url, path, deep)
            assert status == 400, path
            assert_openai_error(answer, "invalid_request")
        nested: Any = "x"
        for _ in range(300):  # 600 levels: parses, and nothing after parsing may recurse into a 500
            nested = {"a": [nested]}
        inside = {"messages": [{"role": "user", "content": "hi", "extra": nested}], "tools_extra": nested}
        for path in (chat, "/debug/route"):
            status, answer = await post(router.url, path, inside)
            assert status in (200, 400), (path, answer)  # the template may refuse it; never a 500
            if status == 400:
                assert_openai_error(answer, "invalid_request")
        # Within the caps everything still routes.
        status, _ = await post(router.url, "/v1/completions", {"prompt": list(range(100))})
        assert status == 200


async def test_large_prompts_have_a_bounded_lane_of_their_own(tiny_dir: Path) -> None:
    limits = PromptLimits(max_chars=10**7, max_tokens=10**7, large_chars=1000, large_queue=1)
    refused: list[str] = []
    tokenizer = HfPromptTokenizer(tiny_dir, threads=1, limits=limits, on_refused=refused.append)
    try:
        big = parse_request("completion", json.dumps({"prompt": "word " * 40_000}).encode())
        small = parse_request("completion", json.dumps({"prompt": "hello there"}).encode())
        results = await asyncio.gather(
            tokenizer.prompt_token_ids(big),
            tokenizer.prompt_token_ids(big),
            tokenizer.prompt_token_ids(small),
            return_exceptions=True,
        )
        assert isinstance(results[0], list) and isinstance(results[2], list)
        error = results[1]
        assert getattr(error, "status", None) == 429 and getattr(error, "code", None) == "tokenizer_busy"
        assert refused == ["tokenizer_busy"]
        assert isinstance(await tokenizer.prompt_token_ids(big), list)  # the lane is free again
    finally:
        tokenizer.close()


def test_the_render_cache_is_bounded_in_bytes(tiny_dir: Path) -> None:
    budget = 4 * 1024 * 1024
    tokenizer = HfPromptTokenizer(tiny_dir, threads=1, cache_bytes=budget)
    try:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for turn in range(40):
            text = f"conversation {turn}: " + "lorem ipsum dolor sit amet " * 4000  # ~108k chars, ~20k+ tokens
            request = parse_request("chat", json.dumps({"messages": [{"role": "user", "content": text}]}).encode())
            tokenizer.token_ids(request)
            assert tokenizer.cache.nbytes <= budget
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert len(tokenizer.cache) >= 2
        # What the cache accounts is what it holds: the traced growth stays within the budget (plus slack for
        # the tokenizer's own buffers), where ids kept as Python int lists cost ~9x their 4-byte array form.
        assert held < budget + 2 * 1024 * 1024, f"{held} bytes held"
    finally:
        tokenizer.close()
