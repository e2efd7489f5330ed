"""The request path frees what it makes by reference counting: no reference cycles for the garbage collector.

Cyclic garbage costs twice: the collector's passes (3% of the router's CPU samples under load, docs/benchmarks.md
"Third pass") and the memory it holds until then. A closure that re-armed its own timer once made a cycle per
first-byte wait, two per request. Here a router with a tokenizer and kv_aware serves streamed, assembled and whole
answers over real sockets while the collector saves everything it finds unreachable; nothing of kvrouter's may be
among it.
"""

from __future__ import annotations

import gc
import types
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.server.app import create_app
from kvrouter.tinymodel import ensure_tokenizer
from tests.conftest import ReplicaFactory, router_settings

SYSTEM = "You are a careful assistant. " * 40


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


def kvrouter_made(thing: object) -> bool:
    """An object of a kvrouter type, or a function, frame or coroutine of kvrouter's code."""
    if type(thing).__module__.startswith("kvrouter"):
        return True
    if isinstance(thing, types.FunctionType):
        return thing.__module__.startswith("kvrouter")
    code = getattr(thing, "f_code", None) or getattr(thing, "cr_code", None)
    return isinstance(code, types.CodeType) and f"{Path('kvrouter')}/" in code.co_filename


def describe(thing: object) -> str:
    name = getattr(thing, "__qualname__", None) or getattr(getattr(thing, "f_code", None), "co_qualname", None)
    return f"{type(thing).__module__}.{type(thing).__qualname__} {name or ''}".strip()


async def test_requests_leave_no_cycles_of_kvrouter_objects(
    fake_replicas: ReplicaFactory, aiohttp_client: Any, tiny_dir: Path
) -> None:
    replicas = await fake_replicas(2, chunks=5)
    fleet = parse_fleet(
        {"tokenizer": str(tiny_dir), "block_size": 16, "replicas": [{"name": r.name, "url": r.url} for r in replicas]},
        Path("test-replicas.yaml"),
    )
    app = create_app(router_settings(policy="kv_aware"), fleet, registry=CollectorRegistry())
    client = await aiohttp_client(app)

    async def serve(turn: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {turn}"}]
        for extra in ({"stream": True, "stream_options": {"include_usage": True}}, {}, {"n": 2}):
            # streamed; non-streaming, assembled from a stream once the layout is learnt; `n` 2: fetched whole
            response = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages, **extra})
            assert response.status == 200, await response.text()
            await response.read()

    for turn in range(3):  # caches, layouts and lazily built state settle first
        await serve(turn)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for turn in range(3, 15):
            await serve(turn)
        gc.collect()
        ours = [describe(thing) for thing in gc.garbage if kvrouter_made(thing)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not ours, sorted(set(ours))[:20]
