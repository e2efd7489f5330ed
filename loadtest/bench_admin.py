"""Benchmark of the admin API: how long a live reload takes, and how long a drain takes to reach another instance.

    python loadtest/bench_admin.py [--repeat 7] [--replicas 100]

Reload: a router (the real app on a real socket, embedded KV-event mode) started with a 2-replica replicas.yaml;
the file grows to `--replicas` replicas (each with a KV-event endpoint, so every added replica also gets its ZMQ
subscription) and `POST /admin/reload` is timed end to end, against the baseline of reloading an unchanged file
in the same run. Shared drain: two routers on one redis-server (started here on a free 127.0.0.1 port, removed
at the end); the time from `POST /admin/replicas/r0/drain` on one to the drain flag being set on the other.
Prints medians of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from kvrouter.config import Settings, load_fleet
from kvrouter.server.app import REPLICAS, create_app

TOKEN = "bench"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def write_fleet(path: Path, count: int) -> None:
    replicas = [
        {
            "name": f"r{i}",
            "url": f"http://127.0.0.1:{20000 + i}",
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{30000 + i}"},
        }
        for i in range(count)
    ]
    path.write_text(yaml.safe_dump({"replicas": replicas}), encoding="utf-8")


def settings(path: Path, **extra: object) -> Settings:
    return Settings(replicas=path, admin_token=TOKEN, health_interval_s=60, metrics_interval_s=60, **extra)


async def reload_time(directory: Path, grow_to: int) -> float:
    path = directory / f"reload-{grow_to}-{time.monotonic_ns()}.yaml"
    write_fleet(path, 2)
    app = create_app(settings(path), load_fleet(path), registry=CollectorRegistry())
    async with TestClient(TestServer(app)) as client:
        write_fleet(path, grow_to)
        started = time.perf_counter()
        response = await client.post("/admin/reload", headers=AUTH)
        await response.read()
        elapsed = time.perf_counter() - started
        assert response.status == 200, await response.text()
        assert len(client.app[REPLICAS].replicas) == grow_to
    return elapsed


async def shared_drain_times(directory: Path, redis_url: str, repeat: int) -> list[float]:
    path = directory / "shared.yaml"
    write_fleet(path, 2)
    apps = [
        create_app(settings(path, redis_url=redis_url), load_fleet(path), registry=CollectorRegistry())
        for _ in range(2)
    ]
    times = []
    async with TestClient(TestServer(apps[0])) as first, TestClient(TestServer(apps[1])) as second:
        await asyncio.sleep(1.5)
        for trial in range(repeat):
            draining = trial % 2 == 0
            started = time.perf_counter()
            await first.post(f"/admin/replicas/r0/{'drain' if draining else 'undrain'}", headers=AUTH)
            for _ in range(1000):
                if ("r0" in second.app[REPLICAS].draining) == draining:
                    break
                await asyncio.sleep(0.002)
            times.append(time.perf_counter() - started)
    return times


def start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.02)
    return process, f"redis://127.0.0.1:{port}/0"


async def main(repeat: int, replicas: int) -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvrouter-bench-admin-"))
    redis, redis_url = start_redis(directory)
    try:
        unchanged = statistics.median([await reload_time(directory, 2) for _ in range(repeat)])
        grown = statistics.median([await reload_time(directory, replicas) for _ in range(repeat)])
        shared = statistics.median(await shared_drain_times(directory, redis_url, repeat))
    finally:
        redis.terminate()
        redis.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)
    print(f"reload, unchanged 2-replica file (baseline): median {unchanged * 1000:.1f} ms")
    print(f"reload, 2 -> {replicas} replicas: median {grown * 1000:.1f} ms ({grown / unchanged:.1f}x baseline)")
    print(f"shared drain, one instance to the other through Redis: median {shared * 1000:.0f} ms (poll interval 1 s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--replicas", type=int, default=100)
    arguments = parser.parse_args()
    logging.disable(logging.WARNING)
    asyncio.run(main(arguments.repeat, arguments.replicas))
    sys.exit(0)
