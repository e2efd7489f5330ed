"""Event-driven load sharing: a change of an instance's own load goes out at once, never on the request's path.

The planes (kvrouter/redisplane/loadplane.py over a real redis-server; kvrouter/server/local_loadplane.py over
real Unix datagram sockets) run with a tick and a heartbeat of 5 s, so within a test shorter than that a peer can
only learn a dispatch through the event path. Dispatches are real ones: a `Router` commits them and its listener,
the `LoadShare`, wakes the plane."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from kvrouter.config import load_fleet
from kvrouter.policies.kv_aware import KvAwareConfig, KvAwarePolicy
from kvrouter.redisplane.loadplane import RedisLoadPlane, load_plane_client
from kvrouter.routing.herding import BlindGroup, BlindGroupConfig
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.routing.sharing import LoadShare
from kvrouter.server.app import LOAD, create_app
from kvrouter.server.local_loadplane import LocalLoadPlane
from kvrouter.typedefs import ReplicaName
from tests.conftest import ReplicaFactory, eventually, router_settings
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401  (fixture)
from tests.test_load_share import write_fleet

A, B = ReplicaName("a"), ReplicaName("b")
ROUTES = [Route(A, 16), Route(B, 16)]
SLOW_S = 5.0
"""Tick and heartbeat: no report goes out on a timer within a test."""


class Instance:
    """One router instance's routing core: a real `Router` whose listener is the `LoadShare`."""

    def __init__(self, name: str) -> None:
        self.load = LoadBook()
        self.share = LoadShare(name, self.load, lambda: [A, B])
        policy = KvAwarePolicy(KvAwareConfig(calibrate=False, tune=False), clock=time.monotonic)
        self.router = Router(policy=policy, load=self.load, listeners=[self.share], clock=time.monotonic)

    def dispatch(self, tokens: int = 300) -> Routed:
        facts = RoutingFacts([[1] * tokens])
        decision = self.router.decide(facts, ROUTES)
        route = next(route for route in ROUTES if route.name == decision.chosen)
        return self.router.commit(decision, facts, route)


def peer_in_flight(book: LoadBook) -> int:
    return sum(book.snapshot(replica).in_flight for replica in (A, B))


@contextlib.asynccontextmanager
async def running(*planes: RedisLoadPlane | LocalLoadPlane) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(plane.run()) for plane in planes]
    try:
        await eventually(lambda: all(plane.stats.connected for plane in planes), what="connected")
        await asyncio.sleep(0.05)  # every plane subscribed before the first dispatch
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def redis_plane(instance: Instance, url: str, connect: Callable[[], Redis] | None = None) -> RedisLoadPlane:
    return RedisLoadPlane(
        instance.share, connect or (lambda: load_plane_client(url)), interval_s=SLOW_S, heartbeat_s=SLOW_S
    )


@pytest.mark.redis
async def test_a_dispatch_reaches_the_peer_at_once_not_at_the_next_tick(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    x, y = Instance("x"), Instance("y")
    plane_x, plane_y = redis_plane(x, redis_server.url), redis_plane(y, redis_server.url)
    started = time.monotonic()
    async with running(plane_x, plane_y):
        announced = plane_x.stats.published
        routed = x.dispatch()
        took = await eventually(lambda: peer_in_flight(y.load) == 1, what="dispatch shared")
        assert y.load.in_flight_total() == 0 and y.load.peer_in_flight() == 1
        routed.first_token(time.monotonic())
        await eventually(lambda: y.load.snapshot(routed.replica).decode_requests == 1, what="prefill done shared")
        routed.finish(time.monotonic())
        await eventually(lambda: peer_in_flight(y.load) == 0, what="finish shared")
        assert time.monotonic() - started < SLOW_S  # no tick or heartbeat could have carried them
        assert took < 0.5
        assert plane_x.stats.published - announced == 3  # one report per change, nothing else
        # Its own echo measured how late its reports reach the peers.
        staleness = x.share.staleness_s
        assert staleness is not None and 0 <= staleness < 0.5


class HeldPublishes:
    """A Redis client whose PUBLISHes wait at a gate: one in flight stays there until the test opens it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight = 0
        self.most_in_flight = 0

    def connect(self) -> Redis:
        client = load_plane_client(self.url)
        publish = client.publish

        async def held(channel: Any, message: Any, **kwargs: Any) -> Any:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await self.gate.wait()
                return await publish(channel, message, **kwargs)
            finally:
                self.in_flight -= 1

        client.publish = held  # type: ignore[method-assign]
        return client


@pytest.mark.redis
async def test_a_burst_of_dispatches_waits_behind_one_publish_and_goes_out_as_one_report(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    x, y = Instance("x"), Instance("y")
    held = HeldPublishes(redis_server.url)
    plane_x = redis_plane(x, redis_server.url, held.connect)
    async with running(plane_x, redis_plane(y, redis_server.url)):
        announced = plane_x.stats.published
        held.gate.clear()
        first = x.dispatch()
        await eventually(lambda: held.in_flight == 1, what="first publish on its way")
        # The request path goes on while Redis holds the publish: 49 more dispatches, the loop turning between.
        burst = [first]
        for _ in range(49):
            burst.append(x.dispatch())
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        assert held.in_flight == 1 and plane_x.stats.published == announced
        held.gate.set()
        await eventually(lambda: peer_in_flight(y.load) == 50, what="burst shared")
        await asyncio.sleep(0.05)
        assert plane_x.stats.published - announced == 2  # the held one, then one carrying the other 49
        assert held.most_in_flight == 1
        for routed in burst:
            routed.finish(time.monotonic())
        await eventually(lambda: peer_in_flight(y.load) == 0, what="finishes shared")
        assert plane_x.stats.published - announced <= 4  # 50 finishes in one loop turn: one report (or two)


@pytest.mark.redis
async def test_requests_are_served_while_redis_holds_every_publish(
    aiohttp_client: Any,
    tmp_path: Path,
    fake_replicas: ReplicaFactory,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """CLIENT PAUSE WRITE holds every PUBLISH in Redis (the event plane's reads go on): a router's requests are
    answered meanwhile, so none waits on the load plane; its report goes out when Redis lets it."""
    replicas = await fake_replicas(2, chunks=2)
    path = write_fleet(tmp_path / "replicas.yaml", replicas)
    settings_ = router_settings(
        replicas=path, redis_url=redis_server.url, load_share_interval_s=1.0, load_share_heartbeat_s=SLOW_S
    )
    a = await aiohttp_client(create_app(settings_, load_fleet(path), registry=CollectorRegistry()))
    b = await aiohttp_client(create_app(settings_, load_fleet(path), registry=CollectorRegistry()))
    await asyncio.sleep(0.2)
    admin = Redis.from_url(redis_server.url)
    body = {"model": "fake-model", "prompt": "hello", "stream": False, "max_tokens": 4}

    async def published() -> float:
        text = await (await a.get("/metrics")).text()
        return next(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "kvrouter_load_share_published_total"
        )

    try:
        before = await published()
        await admin.execute_command("CLIENT", "PAUSE", "2000", "WRITE")
        started = time.monotonic()
        for _ in range(5):
            response = await a.post("/v1/completions", json=body)
            assert response.status == 200
            await response.read()
        assert time.monotonic() - started < 1.5  # all answered inside the pause
        assert await published() == before  # while the first report after them waits in Redis
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
    # a's dispatches are in b's book once Redis lets the reports through (all finished by now: zero), and a's
    # plane is still up.
    await eventually(lambda: cast(LoadBook, b.app[LOAD]).peer_in_flight() == 0, what="settled")
    metrics = await (await a.get("/metrics")).text()
    assert "kvrouter_load_share_up 1.0" in metrics


async def test_workers_hear_a_dispatch_at_once_and_a_burst_as_one_datagram(share_dir: Path) -> None:
    x, y = Instance("x"), Instance("y")
    plane_x = LocalLoadPlane(x.share, share_dir, interval_s=SLOW_S, heartbeat_s=SLOW_S)
    plane_y = LocalLoadPlane(y.share, share_dir, interval_s=SLOW_S, heartbeat_s=SLOW_S)
    started = time.monotonic()
    async with running(plane_y, plane_x):
        announced = plane_x.stats.published
        routed = x.dispatch()
        took = await eventually(lambda: peer_in_flight(y.load) == 1, what="dispatch shared")
        assert took < 0.5 and plane_x.stats.published - announced == 1
        # Dispatches made before the sender task runs (one loop turn) go out in one report.
        burst = [x.dispatch() for _ in range(20)]
        await eventually(lambda: peer_in_flight(y.load) == 21, what="burst shared")
        assert plane_x.stats.published - announced == 2
        for each in [routed, *burst]:
            each.finish(time.monotonic())
        await eventually(lambda: peer_in_flight(y.load) == 0, what="finishes shared")
        assert time.monotonic() - started < SLOW_S
        staleness = x.share.staleness_s  # its own datagram came back to it
        assert staleness is not None and staleness < 0.5


def test_the_own_echo_measures_staleness_and_sets_the_blind_horizon() -> None:
    group = BlindGroup(BlindGroupConfig(horizon_s=0.04), random.Random(0))
    share = LoadShare("x", LoadBook(), lambda: [A], blind_group=group)
    assert share.staleness_s is None
    first = share.report(now=10.0)
    second = share.report(now=10.001)
    share.report()  # sent without a time: its echo measures nothing
    assert not share.receive(first, 10.002)  # own echo: not folded in
    assert share.staleness_s == pytest.approx(0.002) and group.config.horizon_s == pytest.approx(0.004)
    assert not share.receive(second, 10.0015)
    assert share.staleness_s == pytest.approx(0.002)  # the largest recent echo counts
    assert share.problems == {}


@pytest.mark.redis
async def test_stop_ends_a_receiver_that_swallowed_its_cancel(
    redis_server: RedisServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py can swallow a cancel that lands as a blocking read starts; a worker then hung on SIGTERM. The
    receiver here swallows it outright and goes back to reading the channel: `stop` must still end the plane
    (by closing the client's connections), within its bounded waits."""
    plane = redis_plane(Instance("x"), redis_server.url)
    swallowed = asyncio.Event()

    async def stubborn_receiver(pubsub: Any) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # as redis-py's read can: the cancel is gone
        while True:
            await pubsub.get_message(timeout=None)  # blocks until its connection closes

    monkeypatch.setattr(plane, "_receiver", stubborn_receiver)
    task = asyncio.create_task(plane.run())
    await eventually(lambda: plane.stats.connected, what="connected")
    started = time.monotonic()
    await asyncio.wait_for(plane.stop(task), timeout=10.0)
    assert swallowed.is_set()
    assert task.done()
    assert time.monotonic() - started < 7.0
