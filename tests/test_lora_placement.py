"""LoRA adapter placement: a request naming an adapter goes only to replicas that serve it, KV-aware among them;
with none routable it is a 503 that says so, counted. The routing core alone, then simulated replicas on real
sockets (each serving its own adapters and publishing KV events) behind a running router."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.config import Settings, parse_fleet
from kvrouter.index import PrefixIndex
from kvrouter.policies import build_policy
from kvrouter.routing.adapters import serving
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.server.app import INDEX, create_app
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually, router_settings
from tests.sim_fleet_support import SimFleetFactory, chat, sim_fleet

__all__ = ["sim_fleet"]  # the fixture, imported for pytest

ADMIN = {"Authorization": "Bearer admin-secret"}
SQL = frozenset({ReplicaName("l0"), ReplicaName("l1")})


def routes() -> list[Route]:
    return [
        Route(ReplicaName("l0"), 16, lora_adapters=frozenset({"sql", "style"})),
        Route(ReplicaName("l1"), 16, lora_adapters=frozenset({"sql", "style"})),
        Route(ReplicaName("l2"), 16, lora_adapters=frozenset({"style"})),
    ]


def test_serving_keeps_the_replicas_of_the_adapter() -> None:
    assert [r.name for r in serving(routes(), "sql")] == ["l0", "l1"]
    assert [r.name for r in serving(routes(), "style")] == ["l0", "l1", "l2"]
    assert [r.name for r in serving(routes(), None)] == ["l0", "l1", "l2"]
    assert serving(routes(), "absent") == []
    unplaced = [Route(ReplicaName("x"), 16)]  # replay's routes: placement unknown, every adapter
    assert serving(unplaced, "sql") == unplaced


def test_decide_is_kv_aware_among_the_adapters_replicas() -> None:
    clock = lambda: 100.0  # noqa: E731
    index = PrefixIndex(provisional_ttl_s=60.0)
    router = Router(
        policy=build_policy("kv_aware", Settings(), clock=clock),
        load=LoadBook(),
        index=index,
        hash_seed=0,
        lora_adapters=("sql", "style"),
        clock=clock,
    )
    prompt = list(range(1, 200))
    cached_on_l2 = RoutingFacts([prompt], lora="sql")
    index.add_provisional(ReplicaName("l2"), cached_on_l2.keys(16, 0), clock())
    decision = router.decide(cached_on_l2, routes())
    # l2 holds the whole prompt under the adapter's keys but does not serve the adapter: never a candidate.
    assert {c.replica for c in decision.candidates} == SQL
    index.add_provisional(ReplicaName("l1"), cached_on_l2.keys(16, 0), clock())
    decision = router.decide(RoutingFacts([prompt], lora="sql"), routes())
    assert decision.chosen == "l1"
    assert decision.score_of(ReplicaName("l1")) is not None
    base = router.decide(RoutingFacts([prompt]), routes())
    assert {c.replica for c in base.candidates} == {"l0", "l1", "l2"}
    with pytest.raises(ValueError, match="sql"):
        router.decide(RoutingFacts([prompt], lora="sql"), routes()[2:])


async def lora_router(sim_fleet: SimFleetFactory, aiohttp_client: Any) -> TestClient[Any, Any]:
    tokenizer = ensure_tokenizer()
    replicas = [
        await sim_fleet.start("l0", "tiny", tokenizer, 16, ("sql", "style")),
        await sim_fleet.start("l1", "tiny", tokenizer, 16, ("sql", "style")),
        await sim_fleet.start("l2", "tiny", tokenizer, 16, ("style",)),
    ]
    fleet = parse_fleet(
        {
            "model": "tiny",
            "tokenizer": str(tokenizer),
            "block_size": 16,
            "lora_adapters": ["style"],
            "replicas": [
                replicas[0].config(lora_adapters=["sql"]),
                replicas[1].config(lora_adapters=["sql"]),
                replicas[2].config(lora_adapters=[]),
            ],
        },
        Path("replicas.yaml"),
    )
    settings = router_settings(policy="kv_aware", admin_token="admin-secret")
    client: TestClient[Any, Any] = await aiohttp_client(create_app(settings, fleet, registry=CollectorRegistry()))
    await asyncio.sleep(0.3)  # the router's SUB sockets connect before the first event is published
    return client


async def send(client: TestClient[Any, Any], body: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
    response = await client.post("/v1/chat/completions", json=body)
    payload: dict[str, Any] = await response.json()
    return response.status, response.headers.get("x-kvrouter-replica"), payload


async def test_adapter_requests_go_only_to_its_replicas_kv_aware(
    sim_fleet: SimFleetFactory, aiohttp_client: Any
) -> None:
    client = await lora_router(sim_fleet, aiohttp_client)
    chosen = set()
    for n in range(6):
        status, replica, _ = await send(client, chat("sql", f"select the rows of table {n} " * 20))
        assert status == 200
        chosen.add(replica)
    assert chosen <= SQL
    text = "with the order history as h, join every customer on their id and sum the totals " * 8
    status, first, _ = await send(client, chat("sql", text))
    assert status == 200 and first in SQL
    index = client.app[INDEX]
    await eventually(lambda: index.blocks_of(ReplicaName(str(first))) > 0, what="the prompt's KV events")
    route = await client.post("/debug/route", json=chat("sql", text), headers=ADMIN)
    decision = await route.json()
    assert decision["lora_adapter"] == "sql" and decision["not_serving_adapter"] == ["l2"]
    assert {c["replica"] for c in decision["candidates"]} == SQL
    assert decision["chosen"] == first
    assert next(c["cached_tokens"] for c in decision["candidates"] if c["replica"] == first) >= 16
    for _ in range(3):
        assert (await send(client, chat("sql", text)))[1] == first
    # The fleet-wide adapter and the base model are served by every replica.
    for model in ("style", "tiny"):
        wide = await (await client.post("/debug/route", json=chat(model, text), headers=ADMIN)).json()
        assert {c["replica"] for c in wide["candidates"]} == {"l0", "l1", "l2"}


async def test_no_routable_replica_of_the_adapter_is_a_counted_503(
    sim_fleet: SimFleetFactory, aiohttp_client: Any
) -> None:
    client = await lora_router(sim_fleet, aiohttp_client)
    for name in sorted(SQL):
        assert (await client.post(f"/admin/replicas/{name}/drain", headers=ADMIN)).status == 200
    status, _, body = await send(client, chat("sql", "select 1"))
    assert status == 503
    assert body["error"]["message"] == "no healthy replica serves the LoRA adapter 'sql'"
    assert body["error"]["code"] == "no_replica_available"
    debug = await client.post("/debug/route", json=chat("sql", "select 1"), headers=ADMIN)
    assert debug.status == 503
    status, replica, _ = await send(client, chat("tiny", "hello there"))
    assert status == 200 and replica == "l2"
    metrics = await (await client.get("/metrics")).text()
    unavailable = {
        s.labels["adapter"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "kvrouter_lora_unavailable"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert unavailable == {"sql": 1.0}
    await client.post("/admin/replicas/l1/undrain", headers=ADMIN)
    assert (await send(client, chat("sql", "select 1")))[1] == "l1"
