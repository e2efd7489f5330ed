"""`kvrouter --workers 2 --redis-url ...`: two router processes listening on one port, each following Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvrouter.events.wire import WireDecoder
from kvrouter.redisplane.follower import connect_redis
from kvrouter.relay import Relay
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually
from tests.redis_fixtures import RedisServer, free_port, redis_server
from tests.redis_plane_support import SyntheticEngine, synthetic_fleet

pytestmark = pytest.mark.redis
__all__ = ["redis_server"]

REPO = Path(__file__).resolve().parents[1]
SYN = ReplicaName("syn")


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(part) for part in text.split()]


def listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def workers_listening(parent: int, port: int) -> set[int]:
    listening = listening_inodes(port)
    owners = set()
    for child in children(parent):
        try:
            if socket_inodes(child) & listening:
                owners.add(child)
        except OSError:
            continue
    return owners


async def test_two_workers_share_the_port_each_follow_redis_and_one_is_restarted(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    fleet = synthetic_fleet(SYN)
    relay = Relay(connect_redis(redis_server.url), fleet, [SYN], clock_ms=lambda: time.time_ns() // 10**6)
    await relay.open()
    decoder, engine = WireDecoder(), SyntheticEngine(31)
    for seq in range(30):
        batch, _ = decoder.decode_payload(SYN, seq, engine.step())
        assert batch is not None
        relay.accept(batch)
    await relay.flush()
    await relay.redis.aclose()

    replicas_yaml = tmp_path / "replicas.yaml"
    replicas_yaml.write_text(yaml.safe_dump(fleet.model_dump(mode="json")))
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "kvrouter.cli",
        "--replicas",
        str(replicas_yaml),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "2",
        "--redis-url",
        redis_server.url,
        "--health-interval",
        "60",
    ]
    log = (tmp_path / "router.log").open("wb")
    parent = await asyncio.create_subprocess_exec(*command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        await eventually(lambda: len(workers_listening(parent.pid, port)) == 2, within_s=30.0, poll_s=0.1)
        first = workers_listening(parent.pid, port)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:

            async def loaded_everywhere() -> bool:
                # A scrape holds every worker's metrics, labelled (kvrouter/server/worker_metrics.py): both must
                # report a loaded index.
                async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                    text = await response.text()
                return all(f'kvrouter_redis_events_loaded{{worker="{n}"}} 1.0' in text for n in (0, 1))

            deadline = time.monotonic() + 30
            while not await loaded_everywhere():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)

            victim = sorted(first)[0]
            os.kill(victim, signal.SIGKILL)
            async with session.get(f"http://127.0.0.1:{port}/ready") as response:
                assert response.status == 200  # the other worker keeps serving
            await eventually(
                lambda: len(workers_listening(parent.pid, port)) == 2 and victim not in children(parent.pid),
                within_s=30.0,
                poll_s=0.1,
            )
        parent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(parent.wait(), 30) == 0
    finally:
        if parent.returncode is None:
            for child in children(parent.pid):
                os.kill(child, signal.SIGKILL)
            parent.kill()
            await parent.wait()
