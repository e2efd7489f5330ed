"""Simulated vLLM replicas on real sockets for router tests: each serves one model (and LoRA adapters) over HTTP
on 127.0.0.1 and publishes its KV events on a ZMQ PUB socket the router connects to."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestServer

from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.sim.publisher import KvEventPublisher
from kvrouter.sim.server import ReplicaSettings, build_replica_app
from kvrouter.sim.textio import SimTokenizer


@dataclass(slots=True)
class SimReplica:
    name: str
    server: TestServer
    events: str
    """The bound ZMQ endpoint of its KV-event publisher."""
    lora_adapters: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def config(self, **extra: Any) -> dict[str, Any]:
        """Its entry in replicas.yaml."""
        entry: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "kv_events": {"endpoint": self.events, "topic": ""},
        }
        if self.lora_adapters:
            entry["lora_adapters"] = list(self.lora_adapters)
        return {**entry, **extra}


@dataclass(slots=True)
class SimFleetFactory:
    context: zmq.asyncio.Context
    started: list[SimReplica] = field(default_factory=list)
    tokenizers: dict[Path, SimTokenizer] = field(default_factory=dict)

    async def start(
        self, name: str, model: str, tokenizer: Path, block_size: int, lora_adapters: tuple[str, ...] = ()
    ) -> SimReplica:
        sim_tokenizer = self.tokenizers.get(tokenizer)
        if sim_tokenizer is None:
            sim_tokenizer = self.tokenizers[tokenizer] = SimTokenizer(tokenizer)
        engine = build_engine(get_profile("cpu-tiny"), block_size=block_size)
        publisher = KvEventPublisher(self.context, endpoint="tcp://127.0.0.1:*", topic="")
        settings = ReplicaSettings(
            name=name, model_name=model, max_model_len=4096, time_scale=50.0, lora_adapters=lora_adapters
        )
        server = TestServer(build_replica_app(settings, engine, sim_tokenizer, publisher=publisher), host="127.0.0.1")
        await server.start_server()
        assert publisher.bound_endpoint is not None
        replica = SimReplica(name, server, publisher.bound_endpoint, lora_adapters)
        self.started.append(replica)
        return replica


SimFleet = Callable[..., Awaitable[SimReplica]]


@pytest.fixture
async def sim_fleet() -> AsyncIterator[SimFleetFactory]:
    """`await sim_fleet.start(name, model, tokenizer_dir, block_size, lora_adapters)`: a started sim replica."""
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    factory = SimFleetFactory(context)
    yield factory
    for replica in factory.started:
        await replica.server.close()
    context.destroy(linger=0)


def chat(model: str | None, text: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}
    if model is not None:
        body["model"] = model
    return body
