"""Shared load without Redis: `--workers` processes over Unix datagrams (kvrouter/server/local_loadplane.py).
Two planes in one process on real sockets, then `kvrouter --workers 2` in front of a slow replica process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.config import load_fleet
from kvrouter.routing.load import LoadBook
from kvrouter.routing.sharing import LoadReport, LoadShare, ReplicaCounts, ShareLimits
from kvrouter.server.app import ROUTER, create_app
from kvrouter.server.local_loadplane import LocalLoadPlane
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually, router_settings
from tests.faults_support import ReplicaProcess
from tests.redis_fixtures import free_port

A = ReplicaName("a")
REPO = Path(__file__).resolve().parents[1]


@contextlib.asynccontextmanager
async def running(plane: LocalLoadPlane) -> AsyncIterator[LocalLoadPlane]:
    task = asyncio.create_task(plane.run())
    try:
        await eventually(lambda: plane.stats.connected, what="bound")
        yield plane
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def plane(name: str, directory: Path, book: LoadBook) -> LocalLoadPlane:
    share = LoadShare(name, book, lambda: [A], limits=ShareLimits(expiry_s=0.5))
    return LocalLoadPlane(share, directory, interval_s=0.01, heartbeat_s=0.1)


async def test_two_processes_worth_of_planes_share_and_expire(share_dir: Path) -> None:
    book_x, book_y = LoadBook(), LoadBook()
    async with running(plane("y", share_dir, book_y)) as y:
        async with running(plane("x", share_dir, book_x)):
            ticket = book_x.begin(A, 400)
            await eventually(lambda: book_y.snapshot(A).in_flight == 1, what="shared")
            assert book_y.snapshot(A).pending_prefill_tokens == 400 and book_y.in_flight_total() == 0
            book_x.finish(ticket)
            await eventually(lambda: book_y.snapshot(A).in_flight == 0, what="released")
            # Garbage on y's socket is counted and changes nothing.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as hostile:
                hostile.sendto(b"\x00garbage", str(y.path))
            await eventually(lambda: y.share.problems["undecodable"] == 1, what="counted")
            assert y.share.peers() == ["x"]
            # A peer that died without cleaning up: its socket file stays, the next send removes it.
            stale = share_dir / "dead.sock"
            dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            dead.bind(str(stale))
            dead.close()
            book_x.begin(A, 1)
            await eventually(lambda: not stale.exists(), what="stale socket removed")
            await eventually(lambda: book_y.snapshot(A).in_flight == 1, what="shared again")
        # x is gone with a request still counted: y drops its load within the expiry.
        await eventually(lambda: y.share.peers() == [], within_s=3.0, what="expired")
        assert book_y.snapshot(A).in_flight == 0
    assert [name for name in os.listdir(share_dir) if name.endswith(".sock")] == []  # both removed their files


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
async def test_a_kv_aware_router_queues_its_peers_prefills_in_its_progress_record(
    tmp_path: Path, share_dir: Path, policy: str
) -> None:
    """The app wires the load share to the policy (kvrouter/server/app.py): a peer's report that rises reaches
    kv_aware's prefill-progress record; a policy without one is left out."""
    path = tmp_path / "replicas.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": "a", "url": "http://127.0.0.1:9"}]}), "utf-8")
    settings = router_settings(policy=policy, replicas=path, load_share_dir=share_dir)
    router = create_app(settings, load_fleet(path), registry=CollectorRegistry())[ROUTER]
    (share,) = [listener for listener in router.listeners if isinstance(listener, LoadShare)]
    report = msgspec.msgpack.encode(LoadReport(1, "peer", 1, [ReplicaCounts("a", 2, 700, 0)]))
    assert share.receive(report, 5.0)
    if policy == "round_robin":
        assert share.progress is None
        return
    assert share.progress is router.policy
    assert [tokens for _, tokens in router.policy._lanes[A].sent] == [700]  # type: ignore[attr-defined]
    assert not share.receive(b"\x00garbage", 5.1) and share.problems == {"undecodable": 1}


async def test_workers_without_redis_each_count_every_workers_requests(tmp_path: Path) -> None:
    replica = ReplicaProcess("r0", chunks=40, chunk_delay=0.25).start()
    port = free_port()
    fleet = tmp_path / "replicas.yaml"
    fleet.write_text(yaml.safe_dump({"replicas": [{"name": "r0", "url": replica.url}]}))
    command = [
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(fleet), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "2", "--health-interval", "60",
    ]  # fmt: skip
    log = (tmp_path / "router.log").open("wb")
    parent = await asyncio.create_subprocess_exec(*command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    body = {"model": "fake-model", "prompt": "hi", "stream": True, "max_tokens": 40}
    try:
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def scrape() -> dict[str, tuple[float, float, float]]:
                """Per worker (every scrape holds both, labelled: kvrouter/server/worker_metrics.py): its own
                requests in flight, its peers' and how many peers it counts."""
                async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                    text = await response.text()
                values: dict[tuple[str, str], float] = {}
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        key = (sample.labels.get("worker", ""), sample.name)
                        values[key] = values.get(key, 0.0) + sample.value
                workers = {worker for worker, _ in values if worker}
                assert values[("", "kvrouter_workers_scraped")] == len(workers)
                return {
                    worker: (
                        values.get((worker, "kvrouter_in_flight_requests"), 0.0),
                        values.get((worker, "kvrouter_load_share_peer_in_flight"), 0.0),
                        values.get((worker, "kvrouter_load_share_peers"), 0.0),
                    )
                    for worker in workers
                }

            for _ in range(600):
                with contextlib.suppress(aiohttp.ClientError, KeyError):
                    if [count for _, _, count in (await scrape()).values()] == [1.0, 1.0]:
                        break
                await asyncio.sleep(0.1)

            async def one() -> int:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                    await response.read()
                    return response.status

            streams = [asyncio.create_task(one()) for _ in range(6)]
            # Connections land on either worker; each worker counts all six requests, its own and its peer's.
            seen = []
            for _ in range(40):
                workers = await scrape()
                assert sorted(workers) == ["0", "1"], workers  # every scrape holds both workers' series
                seen.append(workers)
                if len([w for w in seen if all(o + p == 6 and c == 1 for o, p, c in w.values())]) >= 10:
                    break
                await asyncio.sleep(0.1)
            settled = [w for w in seen if all(o + p == 6 and c == 1 for o, p, c in w.values())]
            assert len(settled) >= 10, seen
            assert all(sum(own for own, _, _ in w.values()) == 6 for w in settled)  # the six, each counted once
            assert await asyncio.gather(*streams) == [200] * 6
    finally:
        if parent.returncode is None:
            os.kill(parent.pid, signal.SIGTERM)
            await asyncio.wait_for(parent.wait(), 60)
        replica.kill()
