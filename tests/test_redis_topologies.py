"""The event plane on the other Redis topologies: behind Sentinel, and on a three-shard Redis Cluster.

Real processes only: redis-server as master and as Sentinel (``--sentinel``), or three cluster-enabled
redis-servers joined by ``redis-cli --cluster create``. A relay core writes three replicas; two followers read
them through the topology's URL and end with the relay's state.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_sync

from kvrouter.events.wire import WireDecoder
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.clients import is_cluster
from kvrouter.redisplane.follower import FollowerKnobs, RedisFollower, connect_redis
from kvrouter.relay import Relay
from kvrouter.typedefs import ReplicaName
from tests.redis_fixtures import RedisServer, free_port
from tests.redis_plane_support import SyntheticEngine, index_view, synthetic_fleet
from tests.shared_data import ci_tool

pytestmark = pytest.mark.redis
NAMES = [ReplicaName(f"r{i}") for i in range(3)]


@pytest.fixture
def sentinel_url(tmp_path: Path) -> Iterator[str]:
    master = RedisServer(tmp_path / "master")
    master.start()
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\nsentinel monitor kvr 127.0.0.1 {master.port} 1\n")
    sentinel = subprocess.Popen([master.binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL)
    try:
        client = redis_sync.Redis(port=port)
        for _ in range(200):
            try:
                if client.sentinel_get_master_addr_by_name("kvr"):
                    break
            except redis_sync.RedisError:
                pass
            time.sleep(0.05)
        yield f"redis+sentinel://127.0.0.1:{port}/kvr"
    finally:
        sentinel.kill()
        sentinel.wait()
        master.kill()


@pytest.fixture
def cluster_url(tmp_path: Path) -> Iterator[str]:
    cli = ci_tool("redis-cli", "redis-tools, a dependency of redis-server")
    nodes = [RedisServer(tmp_path / f"node{i}") for i in range(3)]
    for node in nodes:
        node.command = _cluster_command(node)  # type: ignore[method-assign]
        node.start()
    try:
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        client = redis_sync.Redis(port=nodes[0].port)
        for _ in range(300):
            if b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"):
                break
            time.sleep(0.05)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    finally:
        for node in nodes:
            node.kill()


def _cluster_command(node: RedisServer):  # type: ignore[no-untyped-def]
    base = RedisServer.command
    bus_port = free_port()  # explicit: the default (port + 10000) overflows for high ephemeral ports

    def command() -> list[str]:
        return [
            *base(node),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(node.directory / "nodes.conf"),
            "--cluster-port",
            str(bus_port),
        ]

    return command


async def run_plane(url: str) -> None:
    redis = connect_redis(url, socket_timeout_s=5.0)
    relay = Relay(redis, synthetic_fleet(*NAMES), NAMES, clock_ms=lambda: time.time_ns() // 10**6)
    await relay.open()
    decoder = WireDecoder()
    hashes: set[int] = set()
    engines = {name: SyntheticEngine(40 + i) for i, name in enumerate(NAMES)}
    for seq in range(60):
        for name, engine in engines.items():
            batch, _ = decoder.decode_payload(name, seq, engine.step())
            assert batch is not None
            for event in batch.events:
                hashes.update(getattr(event, "engine_hashes", ()))
            relay.accept(batch)
        if seq % 10 == 0:
            await relay.flush()
    await relay.flush()
    streams_per_read = 1 if is_cluster(url) else None
    followers = [
        RedisFollower(
            lambda: connect_redis(url, block_ms=100),
            NAMES,
            PrefixIndex(),
            hash_seed=0,
            clock=time.monotonic,
            knobs=FollowerKnobs(block_ms=100, streams_per_read=streams_per_read),
        )
        for _ in range(2)
    ]
    for follower in followers:
        follower.start()
    try:
        expected = {
            "counts": {name: len(relay.book[name]) for name in NAMES},
            **{name: {h: relay.book[name].key_of(name, h) for h in hashes} for name in NAMES},  # type: ignore[arg-type]
        }
        deadline = time.monotonic() + 20
        for follower in followers:
            index = follower.sink
            assert isinstance(index, PrefixIndex)
            while index_view(index, NAMES, hashes) != expected:
                assert time.monotonic() < deadline, follower.health()
                await asyncio.sleep(0.05)
    finally:
        for follower in followers:
            await follower.stop()
        await redis.aclose()


async def test_event_plane_behind_sentinel(sentinel_url: str) -> None:
    await run_plane(sentinel_url)


async def test_event_plane_on_redis_cluster(cluster_url: str) -> None:
    await run_plane(cluster_url)
