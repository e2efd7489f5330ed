"""Forwarding and streaming through kvrouter in front of fake vLLM replicas."""

from __future__ import annotations

import json

from tests.conftest import ReplicaFactory, RouterFactory

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


async def test_chat_round_trip(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200
    body = await response.json()
    served = response.headers["x-kvrouter-replica"]
    assert body["choices"][0]["message"]["content"].startswith(served)
