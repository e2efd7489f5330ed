"""Drains and reloads reach every router instance through Redis: two real routers, one real redis-server, fake
replicas, all on 127.0.0.1. Each router has its own copy of replicas.yaml, as pods each have their own ConfigMap
copy."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from kvrouter.admin.api import ADMIN_KEY
from kvrouter.admin.shared import ADMIN_KEY as REDIS_KEY
from kvrouter.admin.shared import RedisAdminState
from kvrouter.config import load_fleet
from kvrouter.server.app import REPLICAS, create_app
from tests.conftest import ReplicaFactory, eventually, router_settings
from tests.fake_replica import FakeReplica
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.redis

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
Pair = tuple[TestClient[Any, Any], TestClient[Any, Any], Path, Path]


def write_fleet(path: Path, replicas: list[FakeReplica]) -> None:
    path.write_text(yaml.safe_dump({"replicas": [{"name": r.name, "url": r.url} for r in replicas]}), "utf-8")


@pytest.fixture
def two_routers(
    aiohttp_client: Any,
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> Callable[[list[FakeReplica]], Awaitable[Pair]]:
    async def make(replicas: list[FakeReplica]) -> Pair:
        clients = []
        paths = []
        for name in ("a", "b"):
            path = tmp_path / f"replicas-{name}.yaml"
            write_fleet(path, replicas)
            settings = router_settings(replicas=path, admin_token=TOKEN, redis_url=redis_server.url)
            app = create_app(settings, load_fleet(path), registry=CollectorRegistry())
            clients.append(await aiohttp_client(app))
            paths.append(path)
        # Both have read the shared state once (they start from the same reload generation).
        for client in clients:
            await eventually(lambda c=client: c.app[ADMIN_KEY]._generation is not None)
        return clients[0], clients[1], paths[0], paths[1]

    return make


def draining(client: TestClient[Any, Any]) -> set[str]:
    return set(client.app[REPLICAS].draining)


def names(client: TestClient[Any, Any]) -> list[str]:
    return [r.name for r in client.app[REPLICAS]]


async def served_by(client: TestClient[Any, Any], count: int) -> set[str]:
    seen = set()
    for _ in range(count):
        async with client.post("/v1/completions", json={"model": "m", "prompt": "hi"}) as response:
            assert response.status == 200
            seen.add(response.headers["x-kvrouter-replica"])
    return seen


async def test_a_drain_on_one_router_reaches_the_other(
    fake_replicas: ReplicaFactory, two_routers: Callable[[list[FakeReplica]], Awaitable[Pair]]
) -> None:
    a, b, _, _ = await two_routers(await fake_replicas(2))
    answer = await (await a.post("/admin/replicas/r0/drain", headers=AUTH)).json()
    assert answer["shared"] is True
    assert draining(a) == {"r0"}
    await eventually(lambda: draining(b) == {"r0"})
    assert await served_by(b, 4) == {"r1"}
    views = {v["name"]: v for v in (await (await b.get("/admin/replicas", headers=AUTH)).json())["replicas"]}
    assert views["r0"]["draining"] is True

    assert (await (await b.post("/admin/replicas/r0/undrain", headers=AUTH)).json())["shared"] is True
    await eventually(lambda: draining(a) == set())
    assert await served_by(a, 4) == {"r0", "r1"}


async def test_a_reload_on_one_router_reaches_the_other_once_its_file_matches(
    fake_replicas: ReplicaFactory, two_routers: Callable[[list[FakeReplica]], Awaitable[Pair]]
) -> None:
    r0, r1, r2 = await fake_replicas(3)
    a, b, path_a, path_b = await two_routers([r0, r1])
    write_fleet(path_a, [r0, r1, r2])
    answer = await (await a.post("/admin/reload", headers=AUTH)).json()
    assert answer["changes"]["added"] == ["r2"] and answer["shared"] is True
    # b's own copy has not changed yet (a ConfigMap updates pod by pod): b waits instead of reloading the old file.
    await asyncio.sleep(1.5)
    assert names(b) == ["r0", "r1"]
    write_fleet(path_b, [r0, r1, r2])
    await eventually(lambda: names(b) == ["r0", "r1", "r2"])
    assert "r2" in await served_by(b, 6)
    # a does not reload again on its own announcement.
    metrics = await (await a.get("/metrics")).text()
    assert 'kvrouter_fleet_reloads_total{result="applied"} 1.0' in metrics


async def test_redis_down_applies_locally_and_shares_when_back(
    fake_replicas: ReplicaFactory,
    two_routers: Callable[[list[FakeReplica]], Awaitable[Pair]],
    redis_server: RedisServer,  # noqa: F811
) -> None:
    a, b, _, _ = await two_routers(await fake_replicas(2))
    redis_server.kill()
    answer = await (await a.post("/admin/replicas/r1/drain", headers=AUTH)).json()
    assert answer["shared"] is False and answer["draining"] is True
    assert await served_by(a, 3) == {"r0"}
    await asyncio.sleep(1.5)
    assert draining(a) == {"r1"} and draining(b) == set()
    redis_server.start()
    await eventually(lambda: draining(b) == {"r1"}, within_s=15)
    assert draining(a) == {"r1"}


async def test_shared_state_survives_a_bad_hash(redis_server: RedisServer) -> None:  # noqa: F811
    state = RedisAdminState(redis_server.url)
    try:
        client = state._client()
        await client.hset(REDIS_KEY, mapping={"reload_generation": "not a number", "drain:x": "1", "other": "y"})
        view = await state.read()
        assert view is not None
        assert view.draining == {"x"} and view.reload_generation == 0
        assert await state.set_draining("x", False)
        assert await state.publish_reload("abc") == 1
        view = await state.read()
        assert view is not None and view.draining == frozenset() and view.reload_sha256 == "abc"
    finally:
        await state.close()
    unreachable = RedisAdminState("redis://127.0.0.1:1/0", timeout_s=0.2)
    assert await unreachable.read() is None
    assert await unreachable.set_draining("x", True) is False
    assert await unreachable.publish_reload("abc") is None
    await unreachable.close()
