"""The admin API end to end: a real kvrouter in front of fake replicas, all over sockets on 127.0.0.1.

Drain under load loses no request and moves new ones away at once; reload adds and removes replicas live while
requests stream on the replica being removed; bad or unsafe files change nothing; SIGHUP reloads; /ready and
/live answer for orchestrators.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from kvrouter.admin.api import READINESS_KEY
from kvrouter.admin.fleet import ReloadRefused, plan_reload
from kvrouter.config import load_fleet, parse_fleet
from kvrouter.server.app import REPLICAS, create_app
from tests.conftest import ReplicaFactory, eventually, router_settings, stop_process
from tests.fake_replica import FakeReplica

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
AdminRouter = Callable[..., Awaitable[tuple[TestClient[Any, Any], Path]]]


def write_fleet(path: Path, replicas: list[FakeReplica], **extra: Any) -> None:
    data = {**extra, "replicas": [{"name": r.name, "url": r.url} for r in replicas]}
    path.write_text(yaml.safe_dump(data), encoding="utf-8")


@pytest.fixture
def admin_router(aiohttp_client: Any, tmp_path: Path) -> AdminRouter:
    """`await admin_router(replicas, **settings)`: a kvrouter started from a replicas.yaml file it can re-read."""

    async def make(replicas: list[FakeReplica], **overrides: Any) -> tuple[TestClient[Any, Any], Path]:
        path = tmp_path / "replicas.yaml"
        write_fleet(path, replicas)
        settings = router_settings(replicas=path, admin_token=TOKEN, **overrides)
        app = create_app(settings, load_fleet(path), registry=CollectorRegistry())
        client: TestClient[Any, Any] = await aiohttp_client(app)
        return client, path

    return make


async def stream_completion(client: TestClient[Any, Any], prompt: str = "hello") -> tuple[int, str, str]:
    """(status, replica that answered, whole body) of one streamed completion."""
    async with client.post("/v1/completions", json={"model": "m", "prompt": prompt, "stream": True}) as response:
        body = await response.text()
        return response.status, response.headers.get("x-kvrouter-replica", ""), body


# -- auth ---------------------------------------------------------------------------------------------------


async def test_admin_api_is_disabled_without_a_token(fake_replicas: ReplicaFactory, make_router: Any) -> None:
    client = await make_router(await fake_replicas(1))
    response = await client.get("/admin/replicas", headers=AUTH)
    assert response.status == 403
    assert (await response.json())["error"]["code"] == "admin_disabled"
    assert (await client.post("/admin/replicas/r0/drain")).status == 403


async def test_admin_api_wants_the_bearer_token(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    client, _ = await admin_router(await fake_replicas(1))
    assert (await client.get("/admin/replicas")).status == 401
    wrong = await client.get("/admin/replicas", headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    assert wrong.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await client.post("/admin/reload", headers={"Authorization": TOKEN})).status == 401
    assert (await client.get("/admin/replicas", headers=AUTH)).status == 200


async def test_list_replicas_shows_state_and_load(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    replicas = await fake_replicas(2, chunks=2)
    hold = asyncio.Event()
    replicas[0].behaviour.hold = hold
    client, _ = await admin_router(replicas)
    held = asyncio.ensure_future(stream_completion(client))
    await eventually(lambda: replicas[0].in_flight == 1)
    body = await (await client.get("/admin/replicas", headers=AUTH)).json()
    views = {view["name"]: view for view in body["replicas"]}
    assert list(views) == ["r0", "r1"]
    assert views["r0"]["in_flight"] == 1 and views["r1"]["in_flight"] == 0
    assert views["r0"]["load"]["in_flight"] == 1
    assert views["r0"]["url"] == replicas[0].url
    assert views["r0"]["state"] == "closed" and views["r0"]["draining"] is False
    hold.set()
    assert (await held)[0] == 200


# -- drain --------------------------------------------------------------------------------------------------


async def test_drain_under_load_loses_no_request(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    replicas = await fake_replicas(2, chunks=4, chunk_delay=0.01)
    client, _ = await admin_router(replicas)
    drained_at: list[float] = []
    loop = asyncio.get_running_loop()
    results: list[tuple[float, int, str, str]] = []

    async def user(turns: int) -> None:
        for turn in range(turns):
            started = loop.time()
            status, replica, body = await stream_completion(client, f"turn {turn}")
            results.append((started, status, replica, body))

    async def operator() -> None:
        await eventually(lambda: len(results) >= 12)
        response = await client.post("/admin/replicas/r0/drain", headers=AUTH)
        assert response.status == 200
        drained_at.append(loop.time())
        assert (await response.json())["draining"] is True

    await asyncio.gather(operator(), *(user(12) for _ in range(4)))

    assert len(results) == 48
    assert all(status == 200 for _, status, _, _ in results)
    # Every stream is complete: all its words and the end marker, whichever replica served it.
    for _, _, replica, body in results:
        assert body.rstrip().endswith("data: [DONE]")
        assert all(f"{replica}-{i} " in body for i in range(4))
    assert any(replica == "r0" for _, _, replica, _ in results)
    after = [replica for started, _, replica, _ in results if started > drained_at[0]]
    assert after and set(after) == {"r1"}
    view = {v["name"]: v for v in (await (await client.get("/admin/replicas", headers=AUTH)).json())["replicas"]}
    assert view["r0"]["draining"] is True and view["r1"]["draining"] is False


async def test_drain_wait_returns_when_in_flight_requests_finished(
    fake_replicas: ReplicaFactory, admin_router: AdminRouter
) -> None:
    replicas = await fake_replicas(2, chunks=2)
    hold = asyncio.Event()
    replicas[0].behaviour.hold = hold
    client, _ = await admin_router(replicas)
    held = asyncio.ensure_future(stream_completion(client))
    await eventually(lambda: replicas[0].in_flight == 1)

    quick = await (await client.post("/admin/replicas/r0/drain?wait=0.1", headers=AUTH)).json()
    assert quick == {"replica": "r0", "draining": True, "in_flight": 1, "idle": False, "shared": None}

    waiting = asyncio.ensure_future(client.post("/admin/replicas/r0/drain?wait=10", headers=AUTH))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    hold.set()
    answer = await (await waiting).json()
    assert answer["idle"] is True and answer["in_flight"] == 0
    status, replica, body = await held
    assert (status, replica) == (200, "r0") and body.rstrip().endswith("[DONE]")


async def test_undrain_brings_traffic_back(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    replicas = await fake_replicas(2)
    client, _ = await admin_router(replicas)
    await client.post("/admin/replicas/r1/drain", headers=AUTH)
    served = {(await stream_completion(client))[1] for _ in range(4)}
    assert served == {"r0"}
    undrained = await client.post("/admin/replicas/r1/undrain", headers=AUTH)
    assert (await undrained.json()) == {"replica": "r1", "draining": False, "shared": None}
    served = {(await stream_completion(client))[1] for _ in range(4)}
    assert served == {"r0", "r1"}


async def test_draining_every_replica_answers_503_not_a_hang(
    fake_replicas: ReplicaFactory, admin_router: AdminRouter
) -> None:
    client, _ = await admin_router(await fake_replicas(2))
    for name in ("r0", "r1"):
        await client.post(f"/admin/replicas/{name}/drain", headers=AUTH)
    response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert response.status == 503
    assert "error" in await response.json()


async def test_drain_rejects_unknown_replica_and_bad_wait(
    fake_replicas: ReplicaFactory, admin_router: AdminRouter
) -> None:
    client, _ = await admin_router(await fake_replicas(1))
    missing = await client.post("/admin/replicas/nope/drain", headers=AUTH)
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "unknown_replica"
    for wait in ("soon", "-1", "99999"):
        bad = await client.post(f"/admin/replicas/r0/drain?wait={wait}", headers=AUTH)
        assert bad.status == 400, wait
    assert client.app[REPLICAS].draining == set()


# -- reload -------------------------------------------------------------------------------------------------


async def test_reload_adds_and_removes_replicas_live(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    r0, r1, r2 = await fake_replicas(3, chunks=3)
    hold = asyncio.Event()
    r1.behaviour.hold = hold
    client, path = await admin_router([r0, r1])
    # Streams parked on r1, the replica about to be removed.
    held = [asyncio.ensure_future(stream_completion(client, f"held {i}")) for i in range(4)]
    await eventually(lambda: r1.in_flight == 2)

    write_fleet(path, [r0, r2])
    response = await client.post("/admin/reload", headers=AUTH)
    assert response.status == 200
    changes = (await response.json())["changes"]
    assert changes["added"] == ["r2"] and changes["removed"] == ["r1"] and changes["unchanged"] == ["r0"]

    names = [view["name"] for view in (await (await client.get("/admin/replicas", headers=AUTH)).json())["replicas"]]
    assert names == ["r0", "r2"]
    served = [(await stream_completion(client, f"new {i}"))[1] for i in range(6)]
    assert set(served) == {"r0", "r2"}
    assert len(r1.completions_seen()) == 2

    hold.set()
    outcomes = await asyncio.gather(*held)
    assert all(status == 200 and body.rstrip().endswith("[DONE]") for status, _, body in outcomes)
    assert sorted(replica for _, replica, _ in outcomes) == ["r0", "r0", "r1", "r1"]
    assert r1.cancelled == []
    metrics = await (await client.get("/metrics")).text()
    assert 'kvrouter_fleet_reloads_total{result="applied"} 1.0' in metrics
    assert "kvrouter_fleet_replicas 2.0" in metrics


async def test_reload_keeps_drain_and_applies_weights(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    r0, r1 = await fake_replicas(2)
    client, path = await admin_router([r0, r1])
    await client.post("/admin/replicas/r0/drain", headers=AUTH)
    path.write_text(
        yaml.safe_dump({"replicas": [{"name": "r0", "url": r0.url}, {"name": "r1", "url": r1.url, "weight": 3.0}]}),
        encoding="utf-8",
    )
    changes = (await (await client.post("/admin/reload", headers=AUTH)).json())["changes"]
    assert changes["reweighted"] == ["r1"]
    views = {v["name"]: v for v in (await (await client.get("/admin/replicas", headers=AUTH)).json())["replicas"]}
    assert views["r1"]["weight"] == 3.0
    assert views["r0"]["draining"] is True
    assert {(await stream_completion(client))[1] for _ in range(3)} == {"r1"}


async def test_reload_with_a_bad_file_changes_nothing(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    r0, r1 = await fake_replicas(2)
    client, path = await admin_router([r0, r1])
    path.write_text("replicas: [{name: r0}]\n", encoding="utf-8")
    invalid = await client.post("/admin/reload", headers=AUTH)
    assert invalid.status == 400
    error = (await invalid.json())["error"]
    assert error["code"] == "invalid_replicas_file" and "url" in error["message"] and str(path) in error["message"]

    write_fleet(path, [r0, r1], block_size=32)
    refused = await client.post("/admin/reload", headers=AUTH)
    assert refused.status == 409
    assert "block_size" in (await refused.json())["error"]["message"]

    names = {v["name"] for v in (await (await client.get("/admin/replicas", headers=AUTH)).json())["replicas"]}
    assert names == {"r0", "r1"}
    assert {(await stream_completion(client))[1] for _ in range(4)} == {"r0", "r1"}
    metrics = await (await client.get("/metrics")).text()
    assert 'kvrouter_fleet_reloads_total{result="invalid"} 1.0' in metrics
    assert 'kvrouter_fleet_reloads_total{result="refused"} 1.0' in metrics


async def test_reload_without_a_file_path_is_refused(fake_replicas: ReplicaFactory, aiohttp_client: Any) -> None:
    replicas = await fake_replicas(1)
    fleet = parse_fleet({"replicas": [{"name": "r0", "url": replicas[0].url}]}, Path("inline.yaml"))
    app = create_app(router_settings(admin_token=TOKEN), fleet, registry=CollectorRegistry())
    client = await aiohttp_client(app)
    response = await client.post("/admin/reload", headers=AUTH)
    assert response.status == 409


async def test_sighup_reloads(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    r0, r1 = await fake_replicas(2)
    client, path = await admin_router([r0])
    if signal.getsignal(signal.SIGHUP) in (signal.SIG_DFL, signal.SIG_IGN, None):
        pytest.skip("no SIGHUP handler on this loop (not the main thread)")
    write_fleet(path, [r0, r1])
    os.kill(os.getpid(), signal.SIGHUP)
    await eventually(lambda: "r1" in client.app[REPLICAS].by_name)
    assert [r.name for r in client.app[REPLICAS]] == ["r0", "r1"]


# -- readiness ------------------------------------------------------------------------------------------------


async def test_ready_and_live(fake_replicas: ReplicaFactory, admin_router: AdminRouter) -> None:
    replicas = await fake_replicas(1)
    client, _ = await admin_router(replicas)
    ready = await client.get("/ready")
    assert ready.status == 200
    assert (await ready.json())["checks"]["replicas"] == "ok"

    catching_up = {"done": False}
    client.app[READINESS_KEY].add("events", lambda: catching_up["done"] or "loading replica state from Redis")
    not_ready = await client.get("/ready")
    assert not_ready.status == 503
    assert (await not_ready.json())["checks"]["events"] == "loading replica state from Redis"
    catching_up["done"] = True
    assert (await client.get("/ready")).status == 200

    # Liveness does not depend on the replicas: /health is 503 when none is routable, /live stays 200.
    await replicas[0].stop()
    assert (await client.get("/live")).status == 200


async def test_ready_answers_503_with_a_reason_while_no_replica_is_routable(
    fake_replicas: ReplicaFactory, admin_router: AdminRouter
) -> None:
    # README: /ready means "replicas routable". It used to answer 200 with every replica drained or broken.
    replicas = await fake_replicas(2)
    client, _ = await admin_router(replicas, breaker_failures=1, breaker_backoff_s=60.0)
    for name in ("r0", "r1"):
        assert (await client.post(f"/admin/replicas/{name}/drain", headers=AUTH)).status == 200
    drained = await client.get("/ready")
    assert drained.status == 503
    body = await drained.json()
    assert body["ready"] is False and body["checks"]["replicas"] == "no replica is routable: all 2 are draining"
    assert body["reason"] == "replicas: no replica is routable: all 2 are draining"
    assert (await client.post("/admin/replicas/r1/undrain", headers=AUTH)).status == 200
    assert (await client.get("/ready")).status == 200

    # r0 drained, r1 dead with its breaker open: still nothing routable, and the reason says both.
    await replicas[1].stop()
    assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 503
    mixed = await client.get("/ready")
    assert mixed.status == 503
    assert (await mixed.json())["checks"][
        "replicas"
    ] == "no replica is routable: 1 draining, 1 with the circuit breaker open"

    # Every breaker open.
    assert (await client.post("/admin/replicas/r0/undrain", headers=AUTH)).status == 200
    await replicas[0].stop()
    assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 503
    broken = await client.get("/ready")
    assert (await broken.json())["checks"]["replicas"] == "no replica is routable: the circuit breaker is open on all 2"
    assert broken.status == 503
    assert (await client.get("/live")).status == 200


def test_ready_check_with_no_replica_configured() -> None:
    from kvrouter.admin.api import replicas_routable

    class Empty:
        draining: set[Any] = set()

        def __iter__(self) -> Iterator[Any]:
            return iter(())

    assert replicas_routable(Empty())() == "no replicas configured"


# -- the pure plan --------------------------------------------------------------------------------------------


def fleet_of(*replicas: dict[str, Any], **extra: Any) -> Any:
    return parse_fleet({**extra, "replicas": list(replicas)}, Path("replicas.yaml"))


def test_plan_reload_classifies_changes() -> None:
    a = {"name": "a", "url": "http://10.0.0.1:8000"}
    b = {"name": "b", "url": "http://10.0.0.2:8000"}
    current = fleet_of(a, b)
    plan = plan_reload(current, fleet_of(a, {**b, "weight": 2.0}, {"name": "c", "url": "http://10.0.0.3:8000"}))
    assert plan.as_json() == {"added": ["c"], "removed": [], "replaced": [], "reweighted": ["b"], "unchanged": ["a"]}
    moved = plan_reload(current, fleet_of({**a, "url": "http://10.0.0.9:8000"}, b))
    assert moved.as_json()["replaced"] == ["a"]
    events = plan_reload(current, fleet_of(a, {**b, "kv_events": {"endpoint": "tcp://10.0.0.2:5557"}}))
    assert events.as_json()["replaced"] == ["b"]
    resized = plan_reload(current, fleet_of(a, {**b, "block_size": 32}))
    assert resized.as_json()["replaced"] == ["b"]
    assert plan_reload(current, fleet_of(a, b)).empty
    assert plan_reload(current, fleet_of(b)).removed == ("a",)


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer": "/models/other"},
        {"block_size": 32},
        {"hash_seed": 7},
        {"lora_adapters": ["sql"]},
        {"flow": {"tenants": {"team-a": {"weight": 2}}}},
    ],
)
def test_plan_reload_refuses_fleet_wide_changes(change: dict[str, Any]) -> None:
    a = {"name": "a", "url": "http://10.0.0.1:8000"}
    with pytest.raises(ReloadRefused, match=next(iter(change))):
        plan_reload(fleet_of(a), fleet_of(a, **change))


async def test_an_event_source_that_is_catching_up_holds_readiness(aiohttp_client: Any) -> None:
    from aiohttp import web

    from kvrouter.admin.control import install_admin
    from kvrouter.metrics import RouterMetrics
    from kvrouter.routing.load import LoadBook
    from kvrouter.server.replicas import ReplicaSet

    class CatchingUp:
        loaded = False

        def is_ready(self) -> bool:
            return self.loaded

    registry = CollectorRegistry()
    fleet = fleet_of({"name": "a", "url": "http://127.0.0.1:9"})
    settings = router_settings()
    metrics = RouterMetrics(registry)
    load = LoadBook()
    app = web.Application()
    source = CatchingUp()
    install_admin(
        app,
        fleet=fleet,
        fleet_path=None,
        admin_token=None,
        metrics=metrics,
        registry=registry,
        load=load,
        replicas=ReplicaSet(fleet, settings, load, metrics, lambda: 0.0),
        events=source,
        reload_on_sighup=False,
    )
    client = await aiohttp_client(app)
    waiting = await client.get("/ready")
    assert waiting.status == 503
    assert "loading" in (await waiting.json())["checks"]["events"]
    source.loaded = True
    assert (await client.get("/ready")).status == 200


# -- SIGHUP on the real `kvrouter` process ------------------------------------------------------------------


@pytest.fixture
def router_process(tmp_path: Path) -> Iterator[Callable[..., tuple[int, str]]]:
    """`start(fleet_file, *flags)` runs `kvrouter --replicas FILE` on a free port; (pid, base URL). Stopped by
    PID."""
    import subprocess
    import sys

    from tests.redis_fixtures import free_port

    started: list[subprocess.Popen[bytes]] = []

    def start(fleet_file: Path, *flags: str) -> tuple[int, str]:
        port = free_port()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvrouter.cli",
                "--replicas",
                str(fleet_file),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--admin-token",
                TOKEN,
                "--health-interval",
                "30",
                "--policy",
                "round_robin",
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "router.log").open("wb"),
        )
        started.append(process)
        return process.pid, f"http://127.0.0.1:{port}"

    yield start
    for process in started:
        stop_process(process, timeout_s=15)


@pytest.mark.parametrize("workers", [1, 2])
async def test_sighup_reloads_a_running_kvrouter_process(
    fake_replicas: ReplicaFactory, router_process: Callable[..., tuple[int, str]], tmp_path: Path, workers: int
) -> None:
    import aiohttp

    r0, r1 = await fake_replicas(2)
    fleet_file = tmp_path / "replicas.yaml"
    write_fleet(fleet_file, [r0])
    pid, url = router_process(fleet_file, "--workers", str(workers))
    # A fresh connection per call, so with several workers the kernel spreads the calls over all of them.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:

        async def listed() -> list[str]:
            try:
                async with session.get(f"{url}/admin/replicas", headers=AUTH) as response:
                    return [view["name"] for view in (await response.json())["replicas"]]
            except aiohttp.ClientError:
                return []

        for _ in range(300):
            if await listed() == ["r0"]:
                break
            await asyncio.sleep(0.1)
        assert await listed() == ["r0"]
        if workers > 1:
            await asyncio.sleep(3)  # every worker up (the first answer came from one of them)
        write_fleet(fleet_file, [r0, r1])
        os.kill(pid, signal.SIGHUP)
        for _ in range(100):
            if await listed() == ["r0", "r1"]:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        # Every worker reloaded: many calls, each on a new connection, all see the new fleet.
        assert [await listed() for _ in range(12)] == [["r0", "r1"]] * 12
        served = set()
        for _ in range(4):
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as response:
                assert response.status == 200
                served.add(response.headers["x-kvrouter-replica"])
        assert served == {"r0", "r1"}
