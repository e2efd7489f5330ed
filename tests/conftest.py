"""Shared fixtures: fake vLLM replicas and a kvrouter in front of them, all on real sockets on 127.0.0.1; and the
small helpers many test modules share (polling until a condition holds, stopping a subprocess this test started).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from kvrouter.config import Settings, parse_fleet
from kvrouter.server.app import create_app
from tests.fake_replica import FakeBehaviour, FakeReplica

ReplicaFactory = Callable[..., Awaitable[list[FakeReplica]]]
RouterFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def fake_replicas() -> AsyncIterator[ReplicaFactory]:
    """`await fake_replicas(n, **behaviour)`: n started replicas named r0, r1, ... (stopped at teardown)."""
    started: list[FakeReplica] = []

    async def make(count: int = 2, **behaviour: Any) -> list[FakeReplica]:
        replicas = []
        for _ in range(count):
            replica = FakeReplica(f"r{len(started)}", behaviour=FakeBehaviour(**behaviour))
            await replica.start()
            started.append(replica)
            replicas.append(replica)
        return replicas

    yield make
    for replica in started:
        await replica.stop()


def router_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "policy": "round_robin",
        "host": "127.0.0.1",
        "health_interval_s": 30.0,
        "metrics_interval_s": 30.0,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 10.0,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def make_router(aiohttp_client: Any) -> RouterFactory:
    """`await make_router(replicas, **settings)`: a started kvrouter (TestClient) in front of `replicas`."""

    async def make(replicas: list[FakeReplica], **overrides: Any) -> TestClient[Any, Any]:
        fleet = parse_fleet(
            {"replicas": [{"name": r.name, "url": r.url} for r in replicas]}, Path("test-replicas.yaml")
        )
        app = create_app(router_settings(**overrides), fleet, registry=CollectorRegistry())
        client: TestClient[Any, Any] = await aiohttp_client(app)
        return client

    return make


async def eventually(
    condition: Callable[[], bool], within_s: float = 10.0, what: str = "condition", poll_s: float = 0.01
) -> float:
    """Poll `condition()` until it holds; returns the seconds it took, fails the test past `within_s`."""
    started = time.perf_counter()
    while not condition():
        if time.perf_counter() - started > within_s:
            raise AssertionError(f"{what} not met within {within_s} s")
        await asyncio.sleep(poll_s)
    return time.perf_counter() - started


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM the process this test started, and SIGKILL it if it has not exited within `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


@pytest.fixture
def share_dir() -> Iterator[Path]:
    """A private directory for Unix sockets (the workers' load-share planes and metrics) under /tmp: a socket's
    path is at most 108 bytes, and pytest's tmp_path is deep."""
    directory = Path(tempfile.mkdtemp(prefix="kvr-sock-", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
