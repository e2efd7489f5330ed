"""`kvrouter relay` as a real process: vLLM-style publishers -> relay -> redis-server -> a router's index.

The relay is killed (SIGKILL) mid-stream and started again; the engines keep publishing meanwhile, and their
replay sockets fill the gap, so the router ends with exactly the index a router fed directly would have. Then an
engine restarts (its sequence numbers start over) and the router drops that replica's old blocks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
import zmq.asyncio

from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import WireDecoder, split_frames
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.follower import FollowerKnobs, RedisFollower, connect_redis
from kvrouter.typedefs import ReplicaName
from tests.redis_fixtures import RedisServer, free_port, redis_server
from tests.redis_plane_support import FramePublisher, SyntheticEngine, fixture_frames, index_view
from tests.test_events_zmq import context  # a fixture: its own ZMQ context, destroyed at teardown

pytestmark = pytest.mark.redis
__all__ = ["context", "redis_server"]

REPO = Path(__file__).resolve().parents[1]
SYN = ReplicaName("syn")
REAL = ReplicaName("real")


class Reference:
    """What a router fed straight from the engines ends with: the same decoding and ingest, no Redis."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.ingest = IndexIngest(self.index, block_sizes={SYN: 16, REAL: 32})
        self.decoder = WireDecoder()
        self.seq: dict[str, int] = {}
        self.hashes: set[int] = set()

    def apply(self, replica: str, payload: bytes) -> None:
        seq = self.seq.get(replica, -1) + 1
        self.seq[replica] = seq
        batch, _ = self.decoder.decode_payload(replica, seq, payload)
        assert batch is not None
        for event in batch.events:
            self.hashes.update(getattr(event, "engine_hashes", ()))
        self.ingest.apply(batch)


class RelayProcess:
    def __init__(self, replicas_yaml: Path, redis_url: str, log_path: Path) -> None:
        self.metrics_port = free_port()
        self.command = [
            sys.executable,
            "-m",
            "kvrouter.cli",
            "relay",
            "--metrics-port",
            str(self.metrics_port),
            "--metrics-host",
            "127.0.0.1",
            "--replicas",
            str(replicas_yaml),
            "--redis-url",
            redis_url,
            "--flush-interval",
            "0.002",
            "--verify-interval",
            "0.2",
        ]
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None


@pytest.fixture
def relay_process(tmp_path: Path) -> Iterator[list[RelayProcess]]:
    made: list[RelayProcess] = []
    try:
        yield made
    finally:
        for relay in made:
            relay.kill()


async def wait_equal(
    router: PrefixIndex,
    reference: Reference,
    names: list[ReplicaName],
    timeout_s: float,
    nudge: Callable[[], None] | None = None,
) -> None:
    """Until the router matches the reference. `nudge` publishes one more message per engine now and then:
    a relay (re)subscribing learns of a gap only from the next message, as with vLLM."""
    deadline = time.monotonic() + timeout_s
    last_nudge = time.monotonic()
    while True:
        got = index_view(router, names, reference.hashes)
        expected = index_view(reference.index, names, reference.hashes)
        if got == expected:
            return
        if time.monotonic() > deadline:
            assert got == expected
        if nudge is not None and time.monotonic() - last_nudge > 0.5:
            nudge()
            last_nudge = time.monotonic()
        await asyncio.sleep(0.05)


async def test_relay_killed_and_restarted_mid_stream_loses_nothing(
    redis_server: RedisServer, relay_process: list[RelayProcess], context: zmq.asyncio.Context, tmp_path: Path
) -> None:
    # The captured frames first: without ../shared the test ends here, before it has opened or started anything.
    real = [split_frames(m) for m in fixture_frames("s1_basic_bs32")]
    real_payloads = [parts[2] for parts in real if parts is not None]
    syn_pub, real_pub = FramePublisher(context), FramePublisher(context)  # `context` destroys their sockets anyway
    replicas_yaml = tmp_path / "replicas.yaml"
    replicas_yaml.write_text(
        yaml.safe_dump(
            {
                "block_size": 16,
                "replicas": [
                    {
                        "name": name,
                        "url": "http://127.0.0.1:9",
                        "block_size": size,
                        "kv_events": {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint},
                    }
                    for name, size, pub in ((SYN, 16, syn_pub), (REAL, 32, real_pub))
                ],
            }
        )
    )
    relay = RelayProcess(replicas_yaml, redis_server.url, tmp_path / "relay.log")
    relay_process.append(relay)
    names = [SYN, REAL]
    index = PrefixIndex()
    follower = RedisFollower(
        lambda: connect_redis(redis_server.url, block_ms=100),
        names,
        index,
        hash_seed=0,
        clock=time.monotonic,
        knobs=FollowerKnobs(block_ms=100, backoff_initial_s=0.05, backoff_max_s=0.2),
    )
    reference = Reference()
    engines = [SyntheticEngine(11, capacity=250)]

    async def publish_syn(count: int) -> None:
        for _ in range(count):
            payload = engines[-1].step()
            syn_pub.publish(payload)
            reference.apply(SYN, payload)
            await asyncio.sleep(0.002)

    def publish_real(payloads: list[bytes]) -> None:
        for payload in payloads:
            real_pub.publish(payload)
            reference.apply(REAL, payload)

    def nudge() -> None:
        payload = engines[-1].step()
        syn_pub.publish(payload)
        reference.apply(SYN, payload)
        publish_real(real_payloads[-1:])  # storing the same blocks again changes nothing

    try:
        follower.start()
        relay.start()
        await asyncio.wait_for(follower.loaded.wait(), 15)
        # Published while the relay starts: what it misses is replayed once a later message reveals the gap.
        await publish_syn(100)
        publish_real(real_payloads[:10])
        await wait_equal(index, reference, names, 30, nudge)
        epoch = follower.replicas[SYN].position.epoch  # type: ignore[union-attr]

        await publish_syn(50)
        relay.kill()  # mid-stream: some of those batches were applied but never written
        await publish_syn(100)  # the relay is gone; the engines go on (and evict)
        publish_real(real_payloads[10:])
        relay.start()
        await wait_equal(index, reference, names, 30, nudge)
        assert follower.replicas[SYN].position.epoch == epoch  # type: ignore[union-attr]
        assert index.blocks_of(SYN) == 250
        real_blocks = index.blocks_of(REAL)
        assert real_blocks > 0

        # The engine restarts: its sequence numbers start over and its cache is empty. The relay's source sees
        # the number go back, the relay starts a new epoch, and the router drops the replica's old blocks.
        syn_pub.next_seq = 0
        syn_pub.buffer.clear()
        engines.append(SyntheticEngine(12, capacity=250))
        reference.index.clear(SYN)
        await publish_syn(20)
        await wait_equal(index, reference, names, 30, nudge)
        assert follower.replicas[SYN].position.epoch > epoch  # type: ignore[union-attr]
        assert 20 <= index.blocks_of(SYN) < 250
        assert index.blocks_of(REAL) == real_blocks
        url = f"http://127.0.0.1:{relay.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            metrics = await response.text()
        assert "kvrouter_relay_redis_up 1.0" in metrics
        assert 'kvrouter_relay_epochs_total{replica="syn"} 1.0' in metrics  # the restart, seen by this process
        assert 'status="restart",type="AllBlocksCleared"' in metrics
    finally:
        await follower.stop()
        await syn_pub.close()
        await real_pub.close()


def test_relay_cli_refuses_bad_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvrouter.cli import main

    missing = tmp_path / "missing.yaml"
    assert main(["relay", "--replicas", str(missing), "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    fleet = tmp_path / "replicas.yaml"
    fleet.write_text(yaml.safe_dump({"replicas": [{"name": "a", "url": "http://127.0.0.1:9"}]}))
    assert main(["relay", "--replicas", str(fleet), "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "no replica has kv_events" in capsys.readouterr().err
    assert main(["relay", "--replicas", str(fleet), "--redis-url", "redis://x:1/0", "--only", "b"]) == 2
    assert "no replica named b" in capsys.readouterr().err
