"""A router stops on SIGTERM even when the Redis client swallows the cancel of a task that talks to Redis.

Seen live: `loadtest/router_pool.py` stops its redis-server and its kvrouter instances together; two instances
out of three stayed up, listening socket closed, waiting in `runner.cleanup()` on the shared admin state's poller,
whose cancel had landed while redis-py was reaching the vanished server and was swallowed there: the poller
polled on, and its task was awaited forever. These tests give the real poller, on a real Redis, a read that
swallows a cancel the way redis-py can, and check that shutdown still ends (kvrouter/redisplane/stopping.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from kvrouter.admin.api import ADMIN_KEY
from kvrouter.admin.shared import RedisAdminState, SharedView
from kvrouter.config import load_fleet
from kvrouter.redisplane.stopping import cancel_requested, stop_task
from kvrouter.server.app import create_app
from tests.conftest import ReplicaFactory, eventually, router_settings
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401  (fixture)


class SwallowingAdminState(RedisAdminState):
    """The real shared state, but a cancel that lands while a read is under way is swallowed and the read returns
    None (Redis unreachable), as redis-py can do while it connects to or reads from a server that went away."""

    reading = asyncio.Event()
    swallowed = 0

    async def read(self) -> SharedView | None:
        type(self).reading.set()
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            type(self).swallowed += 1
            return None
        finally:
            type(self).reading.clear()
        return await super().read()


@pytest.mark.redis
async def test_shutdown_ends_when_the_admin_poll_swallows_its_cancel(
    aiohttp_client: Any,
    tmp_path: Path,
    fake_replicas: ReplicaFactory,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    replicas = await fake_replicas(1)
    path = tmp_path / "replicas.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": r.name, "url": r.url} for r in replicas]}), "utf-8")
    settings = router_settings(replicas=path, redis_url=redis_server.url)
    client: TestClient[Any, Any] = await aiohttp_client(
        create_app(settings, load_fleet(path), registry=CollectorRegistry())
    )
    admin = client.app[ADMIN_KEY]
    await eventually(lambda: admin._generation is not None)
    admin.shared = SwallowingAdminState(url=redis_server.url)
    SwallowingAdminState.swallowed = 0
    # Stop while a poll's read is under way, so that the cancel lands inside it.
    await asyncio.wait_for(SwallowingAdminState.reading.wait(), 5.0)
    started = time.monotonic()
    await asyncio.wait_for(client.close(), 15.0)
    assert SwallowingAdminState.swallowed == 1
    # The poller saw its task being cancelled after the swallowed read and ended at once: no second cancel needed.
    assert time.monotonic() - started < 1.0
    pending = [t for t in asyncio.all_tasks() if t.get_name() == "kvrouter-admin-shared-state"]
    assert pending == []


async def swallow_forever(stop: asyncio.Event) -> None:
    """A loop whose every wait swallows cancels (only `stop` ends it): what `stop_task` must not wait on forever."""
    while not stop.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)


async def test_stop_task_gives_up_on_a_task_that_never_takes_the_cancel() -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(swallow_forever(stop))
    await asyncio.sleep(0.1)  # inside its loop (a task cancelled before its first step just ends)
    disconnected: list[bool] = []

    async def disconnect() -> None:
        disconnected.append(True)

    started = time.monotonic()
    ended = await stop_task(task, "test loop", disconnect, first_wait_s=0.2, last_wait_s=0.3)
    assert not ended and disconnected == [True]
    assert 0.5 <= time.monotonic() - started < 2.0
    stop.set()
    await asyncio.wait_for(task, 2.0)


async def test_a_loop_that_checks_cancel_requested_ends_after_a_swallowed_cancel() -> None:
    swallowed = asyncio.Event()

    async def poll() -> None:
        while True:
            try:
                await asyncio.sleep(0.2)  # the Redis call
            except asyncio.CancelledError:
                swallowed.set()
            if cancel_requested():
                raise asyncio.CancelledError
            await asyncio.sleep(10.0)  # the poll interval: never reached once cancelled

    task = asyncio.create_task(poll())
    await asyncio.sleep(0.05)
    assert await stop_task(task, "poll", first_wait_s=1.0, last_wait_s=1.0)
    assert swallowed.is_set() and task.cancelled()
