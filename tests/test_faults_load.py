"""1,000 concurrent streaming clients through one router process: every stream completes, memory stays bounded,
and the router's in-flight accounting is back to zero afterwards.

The router runs as its own process (`kvrouter --replicas ...`), so its resident set size is its own; two fake
replicas run as processes too. The client side holds all 1,000 streams open at once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.conftest import stop_process
from tests.faults_support import ROOT, ReplicaProcess, _free_ports, _wait_http, rss_mb

CLIENTS = 1000
STREAM = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "stream": True}


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[str, int]]:
    replicas = [ReplicaProcess(f"r{n}", chunks=10, chunk_delay=0.1).start() for n in range(2)]
    fleet = {"replicas": [{"name": r.name, "url": r.url} for r in replicas]}
    (tmp_path / "replicas.yaml").write_text(yaml.safe_dump(fleet))
    port = _free_ports(1)
    argv = [
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(tmp_path / "replicas.yaml"), "--host", "127.0.0.1",
        "--port", str(port), "--policy", "least_loaded", "--log-level", "warning",
    ]  # fmt: skip
    with (tmp_path / "router.log").open("wb") as log:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", process, 60, "router")
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        stop_process(process)
        for replica in replicas:
            replica.kill()


async def one_stream(session: aiohttp.ClientSession, url: str) -> str:
    async with session.post(url + "/v1/chat/completions", json=STREAM) as response:
        if response.status != 200:
            return f"status {response.status}"
        received = b""
        async for chunk in response.content.iter_any():
            received += chunk
        return "ok" if received.rstrip().endswith(b"data: [DONE]") else "incomplete"


async def test_a_thousand_concurrent_streams_through_one_router(router: tuple[str, int]) -> None:
    url, pid = router
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # Warm up: connections, code paths and allocator arenas the steady state will use anyway.
        await asyncio.gather(*(one_stream(session, url) for _ in range(100)))
        before = rss_mb(pid)
        peak = before
        began = time.perf_counter()
        tasks = [asyncio.create_task(one_stream(session, url)) for _ in range(CLIENTS)]
        in_flight_seen = 0
        while not all(task.done() for task in tasks):
            peak = max(peak, rss_mb(pid))
            async with session.get(url + "/health") as health:
                body = await health.json()
                in_flight_seen = max(in_flight_seen, sum(r["in_flight"] for r in body["replicas"].values()))
            await asyncio.sleep(0.2)
        outcomes = [task.result() for task in tasks]
        elapsed = time.perf_counter() - began
        async with session.get(url + "/health") as health:
            after_in_flight = sum(r["in_flight"] for r in (await health.json())["replicas"].values())
    failures = [o for o in outcomes if o != "ok"]
    print(f"{CLIENTS} streams in {elapsed:.1f} s; rss {before:.1f} -> {peak:.1f} MB; in flight {in_flight_seen}")
    assert failures == [], failures[:5]
    assert in_flight_seen >= CLIENTS * 0.8, "the streams were meant to overlap"
    assert after_in_flight == 0
    assert peak - before < 150, f"router RSS grew {peak - before:.1f} MB for {CLIENTS} streams"
