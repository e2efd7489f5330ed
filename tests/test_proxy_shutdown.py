"""`kvrouter` as a process: it serves, and on SIGTERM stops accepting but lets in-flight streams finish."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ReplicaFactory
from tests.fake_replica import FakeReplica
from tests.redis_fixtures import free_port

REPO = Path(__file__).resolve().parents[1]


async def start_router(tmp_path: Path, replicas: list[FakeReplica], *flags: str) -> tuple[Process, str]:
    config = tmp_path / "replicas.yaml"
    config.write_text("replicas:\n" + "".join(f"  - {{name: {r.name}, url: '{r.url}'}}\n" for r in replicas))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1",
        "--port", str(port), "--policy", "round_robin", *flags,
        cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            if process.returncode is not None:
                stderr = await process.stderr.read() if process.stderr else b""
                raise AssertionError(stderr.decode() or "router exited")
            try:
                async with session.get(f"{url}/health") as response:
                    if response.status == 200:
                        return process, url
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("router did not start")


@pytest.fixture
async def processes() -> AsyncIterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_sigterm_lets_in_flight_streams_finish(
    tmp_path: Path, fake_replicas: ReplicaFactory, processes: list[Process]
) -> None:
    replicas = await fake_replicas(1, chunks=5, chunk_delay=0.2)
    process, url = await start_router(tmp_path, replicas, "--shutdown-grace", "10")
    processes.append(process)
    body = {"prompt": "x", "stream": True}
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as response:
        assert response.headers["x-kvrouter-replica"] == "r0"
        await response.content.readany()
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as fresh:
                await fresh.get(f"{url}/health")
        rest = await response.read()
    assert rest.endswith(b"data: [DONE]\n\n") and b"r0-4" in rest
    assert await asyncio.wait_for(process.wait(), timeout=5.0) == 0


async def test_sigterm_cuts_streams_after_the_grace_period(
    tmp_path: Path, fake_replicas: ReplicaFactory, processes: list[Process]
) -> None:
    hold = asyncio.Event()
    replicas = await fake_replicas(1, hold=hold)
    process, url = await start_router(tmp_path, replicas, "--shutdown-grace", "0.5")
    processes.append(process)
    body = {"prompt": "x", "stream": True}
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as response:
        await response.content.readany()
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    assert await asyncio.wait_for(process.wait(), timeout=5.0) == 0
    assert time.monotonic() - sent < 3
    await asyncio.sleep(0.1)
    assert len(replicas[0].cancelled) == 1  # the engine was told to stop too
