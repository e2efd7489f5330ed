"""A relay restarted while its engine is idle catches up at once from the engine's replay socket.

The relay reads the last engine sequence numbers back from Redis and resumes its ZMQ source from them
(`ZmqEventSource.resume_from`): the source asks the replay socket for everything since, as soon as it subscribes,
so no further engine message is needed. When the replay buffer no longer reaches back that far, the lost events
may have removed blocks: the replica's DP rank is cleared and rebuilt from what the buffer still holds, under a
new epoch, and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvrouter.config import FleetConfig, KvEventsConfig
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import AllBlocksCleared, EventBatch, WireDecoder
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.follower import FollowerKnobs, RedisFollower, connect_redis
from kvrouter.relay import Relay, RelayCollector, RelayKnobs, serve_relay
from kvrouter.typedefs import ReplicaName
from tests.redis_fixtures import RedisServer, redis_server
from tests.redis_plane_support import FramePublisher, SyntheticEngine, index_view
from tests.test_events_zmq import FakeEngine, free_port, payload, wait_for

__all__ = ["redis_server"]

SYN = ReplicaName("syn")


# ---- the source on its own ---------------------------------------------------------------------------------------


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    yield ctx
    ctx.destroy(linger=0)


async def _source_with_buffer(
    context: zmq.asyncio.Context, buffered: range, *, resume_after: int
) -> tuple[FakeEngine, ZmqEventSource, list[EventBatch], asyncio.Task[None]]:
    """An engine holding `buffered` in its replay buffer and publishing nothing; a source resumed after
    `resume_after`, started."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine(context, bind_pub=True, pub=pub, replay=replay)
    for seq in buffered:
        await engine.publish(seq, payload([100 + seq]), send=False)
    seen: list[EventBatch] = []
    config = KvEventsConfig(endpoint=pub, replay_endpoint=replay)
    source = ZmqEventSource("r", config, seen.append, context=context, replay_timeout_s=2.0, recheck_s=0.3)
    source.resume_from({0: resume_after})
    return engine, source, seen, asyncio.create_task(source.run())


async def _stop(task: asyncio.Task[None], engine: FakeEngine) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await engine.close()


async def test_a_resumed_source_replays_an_idle_engine_at_once_and_drops_live_copies(
    context: zmq.asyncio.Context,
) -> None:
    engine, source, seen, task = await _source_with_buffer(context, range(0, 15), resume_after=9)
    try:
        await wait_for(lambda: len(seen) >= 5, 3.0)
        assert [b.seq for b in seen] == [10, 11, 12, 13, 14]
        assert engine.replay_requests[0] == 10 and source.replayed == 5 and source.lost == 0
        # The second look, once the subscription has surely reached the publisher, finds nothing new.
        await wait_for(lambda: len(engine.replay_requests) >= 2, 3.0)
        assert engine.replay_requests[1] == 15
        # Live copies of replayed messages (queued in the SUB socket during the replay) are not a restart.
        for seq in (13, 14):
            await engine.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), engine.buffer[seq]])
        await engine.publish(15, payload([115]))
        await wait_for(lambda: any(b.seq == 15 for b in seen), 3.0)
        assert [b.seq for b in seen] == [10, 11, 12, 13, 14, 15]
        assert source.duplicates == 2 and source.restarts == 0
        # Once live has passed the replayed range, a seq going back is an engine restart again.
        engine.buffer.clear()
        await engine.publish(0, payload([1]))
        await wait_for(lambda: source.restarts == 1, 3.0)
    finally:
        await _stop(task, engine)


async def test_a_resume_past_the_replay_buffer_clears_the_rank_and_counts_the_loss(
    context: zmq.asyncio.Context,
) -> None:
    engine, source, seen, task = await _source_with_buffer(context, range(14, 18), resume_after=9)
    try:
        await wait_for(lambda: len(seen) >= 5, 3.0)
        cleared, *rest = seen
        assert isinstance(cleared.events[0], AllBlocksCleared) and not cleared.events[0].restart
        assert cleared.seq == 13 and cleared.dp_rank == 0
        assert [b.seq for b in rest] == [14, 15, 16, 17]
        assert source.lost == 4 and source.lost_clears == 1
    finally:
        await _stop(task, engine)


# ---- the relay, killed and restarted over real Redis --------------------------------------------------------------


class Reference:
    """A router fed straight from the engine."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.ingest = IndexIngest(self.index, block_sizes={SYN: 16})
        self.decoder = WireDecoder()
        self.seq = -1
        self.hashes: set[int] = set()

    def apply(self, data: bytes) -> None:
        self.seq += 1
        batch, _ = self.decoder.decode_payload(SYN, self.seq, data)
        assert batch is not None
        for event in batch.events:
            self.hashes.update(getattr(event, "engine_hashes", ()))
        self.ingest.apply(batch)


class RelayRun:
    """One relay 'process' in this event loop; `kill` cancels it without the final flush a SIGTERM gets."""

    def __init__(self, redis_url: str, fleet: FleetConfig, context: zmq.asyncio.Context) -> None:
        self.redis = connect_redis(redis_url, socket_timeout_s=5.0)
        self.relay = Relay(
            self.redis,
            fleet,
            [SYN],
            clock_ms=lambda: time.time_ns() // 1_000_000,
            knobs=RelayKnobs(flush_interval_s=0.002, verify_interval_s=0.2),
        )
        self.task = asyncio.create_task(serve_relay(self.relay, fleet, context=context))

    async def source(self) -> ZmqEventSource:
        await wait_for(lambda: SYN in self.relay.sources, 5.0)
        return self.relay.sources[SYN]

    async def kill(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.redis.aclose()


class Scene:
    def __init__(self, redis_url: str, context: zmq.asyncio.Context, publisher: FramePublisher) -> None:
        self.redis_url = redis_url
        self.context = context
        self.publisher = publisher
        self.engine = SyntheticEngine(21, capacity=120)
        self.reference = Reference()
        self.fleet = FleetConfig.model_validate(
            {
                "block_size": 16,
                "replicas": [
                    {
                        "name": SYN,
                        "url": "http://127.0.0.1:9",
                        "kv_events": {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint},
                    }
                ],
            }
        )
        self.index = PrefixIndex()
        self.follower = RedisFollower(
            lambda: connect_redis(redis_url, block_ms=100),
            [SYN],
            self.index,
            hash_seed=0,
            clock=time.monotonic,
            knobs=FollowerKnobs(block_ms=100, backoff_initial_s=0.05, backoff_max_s=0.2),
        )

    def publish(self, count: int) -> None:
        for _ in range(count):
            data = self.engine.step()
            self.publisher.publish(data)
            self.reference.apply(data)

    async def start_relay(self) -> RelayRun:
        return RelayRun(self.redis_url, self.fleet, self.context)

    async def first_run(self, relay: RelayRun, batches: int) -> None:
        """Publish until the relay's subscription is live (PUB drops what it sends before), then `batches` more,
        and wait until the router has them all."""
        source = await relay.source()
        for _ in range(200):
            self.publish(1)
            await asyncio.sleep(0.02)
            if source.delivered:
                break
        self.publish(batches)
        await self.wait_router(self.reference.index, 10.0)

    async def wait_router(self, expected: PrefixIndex, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while True:
            got = index_view(self.index, [SYN], self.reference.hashes)
            want = index_view(expected, [SYN], self.reference.hashes)
            if got == want:
                return
            if time.monotonic() > deadline:
                assert got == want
            await asyncio.sleep(0.02)

    def epoch(self) -> int:
        position = self.follower.replicas[SYN].position
        assert position is not None
        return position.epoch


@pytest.fixture
async def scene(redis_server: RedisServer) -> AsyncIterator[tuple[Scene, FramePublisher]]:
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    publisher = FramePublisher(context, buffer=40)
    made = Scene(redis_server.url, context, publisher)
    made.follower.start()
    try:
        yield made, publisher
    finally:
        await made.follower.stop()
        await publisher.close()
        context.destroy(linger=0)


@pytest.mark.redis
async def test_relay_restarted_while_the_engine_is_idle_catches_up_without_a_new_event(
    scene: tuple[Scene, FramePublisher],
) -> None:
    world, publisher = scene
    relay = await world.start_relay()
    await asyncio.wait_for(world.follower.loaded.wait(), 10)
    await world.first_run(relay, 60)
    epoch = world.epoch()

    world.publish(10)
    await relay.kill()  # mid-stream: some of those may be applied but never written
    world.publish(25)  # the engine goes on (and evicts), then goes idle; all of it is still in its buffer
    published = publisher.next_seq

    started = time.monotonic()
    relay = await world.start_relay()
    try:
        await world.wait_router(world.reference.index, 3.0)
        caught_up_s = time.monotonic() - started
        source = await relay.source()
        assert publisher.next_seq == published  # nothing new was published to reveal the gap
        assert source.replayed >= 25 and source.lost == 0 and source.lost_clears == 0
        assert world.epoch() == epoch  # nothing lost, so no rebuild
        assert world.index.blocks_of(SYN) == 120
        assert caught_up_s < 3.0
    finally:
        await relay.kill()


@pytest.mark.redis
async def test_relay_restarted_past_the_replay_buffer_clears_the_replica_and_rebuilds(
    scene: tuple[Scene, FramePublisher],
) -> None:
    world, publisher = scene
    relay = await world.start_relay()
    await asyncio.wait_for(world.follower.loaded.wait(), 10)
    await world.first_run(relay, 60)
    epoch = world.epoch()
    await relay.kill()

    world.publish(100)  # more than the 40 batches the engine's replay buffer keeps; evictions among the lost
    # What the relay can know now: a cleared rank, rebuilt from the batches the buffer still holds.
    rebuilt = PrefixIndex()
    ingest = IndexIngest(rebuilt, block_sizes={SYN: 16})
    decoder = WireDecoder()
    for seq, data in publisher.buffer:
        batch, _ = decoder.decode_payload(SYN, seq, data)
        assert batch is not None
        ingest.apply(batch)
    assert 0 < rebuilt.blocks_of(SYN) < world.reference.index.blocks_of(SYN)

    relay = await world.start_relay()
    try:
        await world.wait_router(rebuilt, 3.0)
        source = await relay.source()
        assert source.lost > 0 and source.lost_clears == 1
        assert world.epoch() > epoch  # every router drops the replica's old blocks and reloads
        # Nothing the engine no longer holds is left: every key the router has, the engine has too.
        for engine_hash in world.reference.hashes:
            key = world.index.key_of(SYN, engine_hash)  # type: ignore[arg-type]
            if key is not None:
                assert world.reference.index.key_of(SYN, engine_hash) == key  # type: ignore[arg-type]
        registry = CollectorRegistry()
        registry.register(RelayCollector(relay.relay))
        assert registry.get_sample_value("kvrouter_relay_lost_clears_total", {"replica": SYN}) == 1.0
    finally:
        await relay.kill()
