"""The Redis event plane end to end on a real redis-server: relay core -> Redis -> router followers -> index."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable

import pytest
from redis.asyncio import Redis

from kvrouter.config import FleetConfig, KvEventsConfig, ReplicaConfig
from kvrouter.events.wire import WireDecoder, decode_seq, split_frames
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.follower import FollowerKnobs, RedisFollower, connect_redis
from kvrouter.redisplane.writer import WriterKnobs
from kvrouter.relay import Relay, RelayKnobs
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually
from tests.redis_fixtures import RedisServer, redis_server, redis_server_persistent
from tests.redis_plane_support import SyntheticEngine, fixture_frames, index_view

pytestmark = pytest.mark.redis
__all__ = ["redis_server", "redis_server_persistent"]

REAL = ReplicaName("real")
SYN1 = ReplicaName("syn1")
SYN2 = ReplicaName("syn2")
FAST_RELAY = RelayKnobs(
    flush_interval_s=0.0,
    verify_interval_s=0.1,
    backoff_initial_s=0.05,
    backoff_max_s=0.2,
    writer=WriterKnobs(snapshot_min_blocks=64),
)
FAST_FOLLOWER = FollowerKnobs(block_ms=100, backoff_initial_s=0.05, backoff_max_s=0.2, startup_grace_s=5.0)


def make_fleet(hash_seed: int = 0) -> FleetConfig:
    def replica(name: str, block_size: int) -> ReplicaConfig:
        return ReplicaConfig(
            name=name,
            url="http://127.0.0.1:9",  # type: ignore[arg-type]
            kv_events=KvEventsConfig(endpoint="tcp://127.0.0.1:9"),
            block_size=block_size,
        )

    return FleetConfig(replicas=[replica(REAL, 32), replica(SYN1, 16), replica(SYN2, 16)], hash_seed=hash_seed)


def clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Feeder:
    """Decodes engine payloads like the ZMQ source does and hands them to the relay; remembers every hash."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.decoder = WireDecoder()
        self.seq: dict[str, int] = {}
        self.hashes: set[int] = set()

    def payload(self, replica: str, payload: bytes, seq: int | None = None) -> None:
        seq = self.seq.get(replica, -1) + 1 if seq is None else seq
        self.seq[replica] = seq
        batch, problems = self.decoder.decode_payload(replica, seq, payload)
        assert batch is not None and not problems
        for event in batch.events:
            self.hashes.update(getattr(event, "engine_hashes", ()))
        self.relay.accept(batch)

    def real_frames(self, run: str = "s1_basic_bs32") -> None:
        for message in fixture_frames(run):
            parts = split_frames(message)
            assert parts is not None
            self.payload(REAL, parts[2], decode_seq(parts[1]))


def relay_view(relay: Relay, hashes: Iterable[int]) -> dict[str, object]:
    """What every router must end up with: the relay's authoritative state in `index_view`'s shape."""
    view: dict[str, object] = {"counts": {r: len(s) for r, s in relay.book.states.items() if len(s)}}
    hash_list = list(hashes)
    for replica, state in relay.book.states.items():
        view[replica] = {h: state.key_of(replica, h) for h in hash_list}  # type: ignore[arg-type]
    return view


class Router:
    """One router instance's event side: its own index and follower task."""

    def __init__(self, url: str, names: list[ReplicaName], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = PrefixIndex()
        self.follower = RedisFollower(
            lambda: connect_redis(url, block_ms=FAST_FOLLOWER.block_ms),
            names,
            self.index,
            hash_seed=0,
            clock=clock,
            knobs=FAST_FOLLOWER,
        )
        self.follower.start()

    def view(self, hashes: Iterable[int]) -> dict[str, object]:
        return index_view(self.index, self.follower.replicas, hashes)

    async def stop(self) -> None:
        await self.follower.stop()


def caught_up(router: Router, relay: Relay) -> bool:
    return relay.settled() and all(
        router.follower.replicas[name].position == writer.position for name, writer in relay.writers.items()
    )


@contextlib.asynccontextmanager
async def running(*routers: Router, relay_task: asyncio.Task[None] | None = None) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for router in routers:
            await router.stop()
        if relay_task is not None:
            relay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay_task


async def new_relay(server: RedisServer, fleet: FleetConfig | None = None) -> tuple[Relay, Redis]:
    redis = connect_redis(server.url, socket_timeout_s=5.0)
    fleet = fleet or make_fleet()
    relay = Relay(redis, fleet, [r.replica for r in fleet.replicas], clock_ms=clock_ms, knobs=FAST_RELAY)
    await relay.open()
    await relay.flush()
    return relay, redis


async def test_routers_end_identical_and_a_late_router_matches(redis_server: RedisServer) -> None:
    relay, redis = await new_relay(redis_server)
    names = list(relay.writers)
    first, second = Router(redis_server.url, names), Router(redis_server.url, names)
    feeder = Feeder(relay)
    engines = {SYN1: SyntheticEngine(1, capacity=300), SYN2: SyntheticEngine(2, capacity=300)}
    third: Router | None = None
    async with running(first, second):
        await asyncio.wait_for(first.follower.loaded.wait(), 5)
        feeder.real_frames()
        for step in range(400):
            for name, engine in engines.items():
                feeder.payload(name, engine.step())
            if step % 7 == 0:
                await relay.flush()
            if step == 200:
                third = Router(redis_server.url, names)
        await relay.flush()
        assert third is not None
        async with running(third):
            for router in (first, second, third):
                await eventually(lambda router=router: caught_up(router, relay))  # type: ignore[misc]
            expected = relay_view(relay, feeder.hashes)
            assert first.view(feeder.hashes) == expected
            assert second.view(feeder.hashes) == expected
            assert third.view(feeder.hashes) == expected
            assert len(relay.book[SYN1]) == 300
            assert all(w.stats.snapshots > 2 for n, w in relay.writers.items() if n != REAL)
            # The stream stays bounded: trimmed at each snapshot to the snapshot before.
            assert await redis.xlen(relay.writers[SYN1].keys.stream) < 400
    await redis.aclose()


async def test_replica_restart_seen_through_redis_clears_it_everywhere(redis_server: RedisServer) -> None:
    relay, redis = await new_relay(redis_server)
    names = list(relay.writers)
    routers = [Router(redis_server.url, names), Router(redis_server.url, names)]
    feeder = Feeder(relay)
    engine = SyntheticEngine(3)
    async with running(*routers):
        for _ in range(50):
            feeder.payload(SYN1, engine.step())
            feeder.payload(SYN2, SyntheticEngine(4).step())
        await relay.flush()
        before = relay.writers[SYN1].position
        for router in routers:
            await eventually(lambda router=router: caught_up(router, relay))  # type: ignore[misc]
            assert router.index.blocks_of(SYN1) > 0
        old_hashes = set(feeder.hashes)
        feeder.payload(SYN1, engine.step(clear=True))  # AllBlocksCleared then a new chain
        await relay.flush()
        after = relay.writers[SYN1].position
        assert before is not None and after is not None and after.epoch > before.epoch
        for router in routers:
            await eventually(lambda router=router: caught_up(router, relay))  # type: ignore[misc]
            assert router.index.blocks_of(SYN1) == len(relay.book[SYN1]) <= 8
            assert all(router.index.key_of(SYN1, h) is None for h in old_hashes)  # type: ignore[arg-type]
            assert router.index.blocks_of(SYN2) > 0  # other replicas untouched
            assert router.view(feeder.hashes) == relay_view(relay, feeder.hashes)
    await redis.aclose()


async def test_redis_restarted_empty_relay_rebuilds_and_routers_follow(redis_server: RedisServer) -> None:
    relay, redis = await new_relay(redis_server)
    names = list(relay.writers)
    routers = [Router(redis_server.url, names), Router(redis_server.url, names)]
    feeder = Feeder(relay)
    engine = SyntheticEngine(5)
    relay_task = asyncio.create_task(relay.run())
    async with running(*routers, relay_task=relay_task):
        for _ in range(60):
            feeder.payload(SYN1, engine.step())
        await eventually(lambda: all(caught_up(r, relay) for r in routers))
        epoch = relay.writers[SYN1].position.epoch  # type: ignore[union-attr]
        redis_server.kill()
        for _ in range(30):  # the engine goes on while Redis is away
            feeder.payload(SYN1, engine.step())
        await eventually(lambda: not routers[0].follower.connected, what="the follower seeing Redis gone")
        redis_server.restart(keep_data=False)
        writer = relay.writers[SYN1]
        await eventually(lambda: writer.position is not None and writer.position.epoch > epoch)
        for _ in range(10):
            feeder.payload(SYN1, engine.step())
        await eventually(lambda: all(caught_up(r, relay) for r in routers))
        for router in routers:
            assert router.follower.connected
            assert router.view(feeder.hashes) == relay_view(relay, feeder.hashes)
    await redis.aclose()


async def test_redis_restarted_empty_without_relay_routers_drop_unvouched_blocks(redis_server: RedisServer) -> None:
    relay, redis = await new_relay(redis_server)
    names = list(relay.writers)
    router = Router(redis_server.url, names)
    feeder = Feeder(relay)
    async with running(router):
        feeder.real_frames()
        await relay.flush()
        await eventually(lambda: caught_up(router, relay))
        assert router.index.blocks_of(REAL) > 0
        redis_server.restart(keep_data=False)
        # Nothing in Redis vouches for those blocks any more, and no relay is there to rebuild them.
        await eventually(lambda: router.follower.connected and router.index.blocks_of(REAL) == 0)
        assert not router.follower.replicas[REAL].vouched
    await redis.aclose()


async def test_redis_restarted_with_its_data_everyone_resumes(redis_server_persistent: RedisServer) -> None:
    server = redis_server_persistent
    relay, redis = await new_relay(server)
    names = list(relay.writers)
    router = Router(server.url, names)
    feeder = Feeder(relay)
    engine = SyntheticEngine(6)
    relay_task = asyncio.create_task(relay.run())
    async with running(router, relay_task=relay_task):
        for _ in range(40):
            feeder.payload(SYN1, engine.step())
        await eventually(lambda: caught_up(router, relay))
        reloads = router.follower.replicas[SYN1].reloads
        epochs = relay.writers[SYN1].stats.epochs
        server.restart(keep_data=True)
        for _ in range(20):
            feeder.payload(SYN1, engine.step())
        await eventually(lambda: caught_up(router, relay) and router.follower.connected)
        assert relay.writers[SYN1].stats.epochs == epochs  # nothing was lost: no rebuild
        assert router.follower.replicas[SYN1].reloads == reloads  # resumed from its position
        assert router.view(feeder.hashes) == relay_view(relay, feeder.hashes)
    await redis.aclose()


async def test_router_starts_without_redis_serves_after_grace_and_loads_when_redis_comes(
    redis_server: RedisServer,
) -> None:
    relay, redis = await new_relay(redis_server)
    feeder = Feeder(relay)
    feeder.real_frames()
    await relay.flush()
    redis_server.kill()
    now = [0.0]
    router = Router(redis_server.url, list(relay.writers), clock=lambda: now[0])
    relay_task = asyncio.create_task(relay.run())
    async with running(router, relay_task=relay_task):
        await eventually(lambda: router.follower.failures >= 1, what="a failed connection to Redis")
        assert not router.follower.is_ready()
        now[0] = FAST_FOLLOWER.startup_grace_s + 1  # past the grace: route on load alone
        assert router.follower.is_ready() and not router.follower.loaded.is_set()
        redis_server.start()  # came back with nothing (no persistence); the relay rebuilds on its next check
        await eventually(lambda: caught_up(router, relay))
        assert router.follower.loaded.is_set()
        assert router.view(feeder.hashes) == relay_view(relay, feeder.hashes)
    await redis.aclose()


async def test_relay_restart_reads_its_state_back_and_resumes_the_engine_sequence(redis_server: RedisServer) -> None:
    relay, redis = await new_relay(redis_server)
    feeder = Feeder(relay)
    engine = SyntheticEngine(7)
    for _ in range(120):
        feeder.payload(SYN1, engine.step())
    await relay.flush()
    expected = relay_view(relay, feeder.hashes)
    position = relay.writers[SYN1].position
    again, redis2 = await new_relay(redis_server)
    assert again.engine_seqs[SYN1] == {0: 119}
    assert relay_view(again, feeder.hashes) == expected
    assert again.writers[SYN1].position == position  # no new epoch: routers need not reload
    await redis.aclose()
    await redis2.aclose()


async def test_redis_away_too_long_router_forgets_event_blocks_then_reloads(
    redis_server_persistent: RedisServer,
) -> None:
    server = redis_server_persistent
    relay, redis = await new_relay(server)
    now = [0.0]
    router = Router(server.url, list(relay.writers), clock=lambda: now[0])
    feeder = Feeder(relay)
    async with running(router):
        feeder.real_frames()
        await relay.flush()
        await eventually(lambda: caught_up(router, relay))
        blocks = router.index.blocks_of(REAL)
        assert blocks > 0
        server.kill()
        await eventually(lambda: router.follower.failures >= 1)
        assert router.index.blocks_of(REAL) == blocks  # a short outage: the last vouched blocks stay
        now[0] += FAST_FOLLOWER.forget_after_s + 1
        failures = router.follower.failures
        await eventually(lambda: router.follower.failures > failures)
        assert router.index.blocks_of(REAL) == 0  # too long: routing falls back to load and provisional entries
        server.start()  # back with its data: the router reloads what Redis vouches for
        await eventually(lambda: router.follower.connected and router.index.blocks_of(REAL) == blocks)
    await redis.aclose()
