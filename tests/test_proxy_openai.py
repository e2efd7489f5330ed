"""The real `openai` client, sync and async, streaming and not, talking to kvrouter in front of fake replicas."""

from __future__ import annotations

import asyncio

import pytest
from openai import APIStatusError, AsyncOpenAI, OpenAI

from tests.conftest import ReplicaFactory, RouterFactory

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


async def base_url(fake_replicas: ReplicaFactory, make_router: RouterFactory, **behaviour: object) -> str:
    replicas = await fake_replicas(2, chunks=4, chunk_delay=0.002, cached_tokens=16, **behaviour)
    client = await make_router(replicas)
    return str(client.make_url("/v1"))


async def test_async_client_chat_and_completions(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    url = await base_url(fake_replicas, make_router)
    async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        chat = await client.chat.completions.create(model="fake-model", messages=MESSAGES)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == "r0-0 r0-1 r0-2 r0-3 "
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        assert chat.usage.prompt_tokens_details.cached_tokens == 16
        completion = await client.completions.create(model="fake-model", prompt="once", max_tokens=4)
        assert completion.choices[0].text == "r1-0 r1-1 r1-2 r1-3 "
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]


async def test_async_client_streams(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    url = await base_url(fake_replicas, make_router)
    async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces) == "r0-0 r0-1 r0-2 r0-3 "
        assert usage is not None and usage.completion_tokens == 4
        text_stream = await client.completions.create(model="fake-model", prompt="x", stream=True)
        texts = [chunk.choices[0].text async for chunk in text_stream]
        assert "".join(texts) == "r1-0 r1-1 r1-2 r1-3 "


async def test_sync_client_stream_and_not(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    url = await base_url(fake_replicas, make_router)

    def use_sync_client() -> tuple[str, str, str]:
        with OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            chat = client.chat.completions.create(model="fake-model", messages=MESSAGES)  # type: ignore[arg-type]
            stream = client.chat.completions.create(
                model="fake-model",
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
            )
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            completion = client.completions.create(model="fake-model", prompt=[1, 2, 3])
            return chat.choices[0].message.content or "", streamed, completion.choices[0].text

    # The client blocks, and the router serves on this test's loop: the client runs in a thread.
    chat, streamed, text = await asyncio.to_thread(use_sync_client)
    assert chat == "r0-0 r0-1 r0-2 r0-3 "
    assert streamed == "r1-0 r1-1 r1-2 r1-3 "
    assert text == "r0-0 r0-1 r0-2 r0-3 "


async def test_client_sees_openai_errors(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    url = await base_url(fake_replicas, make_router)
    async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        with pytest.raises(APIStatusError) as caught:
            await client.chat.completions.create(model="fake-model", messages=[])
        assert caught.value.status_code == 400
        assert "messages" in caught.value.message
