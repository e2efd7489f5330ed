"""Hostile Redis entries (issue 15): one replica's bad data in Redis never stops a router or a relay.

Each test writes into the ``bad`` replica's keys on a real redis-server while the relay core and a router's
follower run over ``good`` and ``bad`` (tests/redis_plane_support.py `TwoReplicaPlane`). Before the fix one
undecodable stream entry ended the follower's loop silently (every replica stopped, /ready stayed 200) and a
foreign entry above the relay's ids left the relay retrying the same refused XADD forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
from redis.asyncio import Redis

from kvrouter.index import PrefixIndex
from kvrouter.redisplane.follower import FollowerKnobs
from kvrouter.redisplane.layout import Position
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually
from tests.redis_fixtures import RedisServer, redis_server
from tests.redis_plane_support import TwoReplicaPlane

pytestmark = pytest.mark.redis
__all__ = ["redis_server"]

GOOD, BAD = TwoReplicaPlane.GOOD, TwoReplicaPlane.BAD
encode = msgspec.msgpack.encode


@pytest.fixture
async def plane(redis_server: RedisServer) -> AsyncIterator[TwoReplicaPlane]:
    plane = TwoReplicaPlane(redis_server.url)
    await plane.start()
    await plane.write(GOOD)
    await plane.write(BAD)
    await eventually(lambda: plane.agrees(GOOD) and plane.agrees(BAD), what="first load")
    try:
        yield plane
    finally:
        await plane.close()


def next_id(plane: TwoReplicaPlane, replica: ReplicaName, step: int = 1) -> str:
    position = plane.relay.writers[replica].position
    assert position is not None
    return Position(position.epoch, position.n + step).stream_id


Inject = Callable[[TwoReplicaPlane, Redis], Awaitable[object]]


async def undecodable(plane: TwoReplicaPlane, raw: Redis) -> object:
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"e": b"\xc1not msgpack"}, id=next_id(plane, BAD))


async def missing_field(plane: TwoReplicaPlane, raw: Redis) -> object:
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"x": b"1"}, id=next_id(plane, BAD))


async def wrong_types(plane: TwoReplicaPlane, raw: Redis) -> object:
    entry = encode([{"0": "a"}, [[0, "rank", 0, b"", b""]]])
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"e": entry}, id=next_id(plane, BAD))


async def huge_rank(plane: TwoReplicaPlane, raw: Redis) -> object:
    entry = encode([{0: 1}, [[0, 10**9, 0, b"\0" * 8, b"\0" * 8]]])
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"e": entry}, id=next_id(plane, BAD))


async def huge_value(plane: TwoReplicaPlane, raw: Redis) -> object:
    entry = encode([{0: 1}, [[0, 0, 0, b"\1" * (4 << 20), b"\2" * (4 << 20 - 3)]]])
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"e": entry}, id=next_id(plane, BAD))


async def unknown_fields(plane: TwoReplicaPlane, raw: Redis) -> object:
    entry = encode([{0: 1}, [[7, 0, 0]], "extra"])
    fields = {"e": entry, "who": b"someone else"}
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, fields, id=next_id(plane, BAD))  # type: ignore[arg-type]


async def gap(plane: TwoReplicaPlane, raw: Redis) -> object:
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"e": b"\x90"}, id=next_id(plane, BAD, 2))


async def foreign_epoch(plane: TwoReplicaPlane, raw: Redis) -> object:
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"e": b"\x90"})  # "*": a new, larger epoch


async def snapshot_garbage(plane: TwoReplicaPlane, raw: Redis) -> object:
    await raw.set(plane.relay.writers[BAD].keys.snapshot, b"\xdegarbage")
    return await raw.xadd(plane.relay.writers[BAD].keys.stream, {"e": b"\x90"}, id=next_id(plane, BAD, 2))


async def stream_wrong_type(plane: TwoReplicaPlane, raw: Redis) -> object:
    keys = plane.relay.writers[BAD].keys
    await raw.delete(keys.stream)
    return await raw.set(keys.stream, b"not a stream")


async def meta_garbage(plane: TwoReplicaPlane, raw: Redis) -> object:
    return await raw.hset(plane.relay.writers[BAD].keys.meta, mapping={"epoch": "x", "n": "-"})


HOSTILE: dict[str, Inject] = {
    "undecodable": undecodable,
    "missing_field": missing_field,
    "wrong_types": wrong_types,
    "huge_rank": huge_rank,
    "huge_value": huge_value,
    "unknown_fields": unknown_fields,
    "gap": gap,
    "foreign_epoch": foreign_epoch,
    "snapshot_garbage": snapshot_garbage,
    "stream_wrong_type": stream_wrong_type,
    "meta_garbage": meta_garbage,
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_hostile_data_of_one_replica_never_stops_the_others(plane: TwoReplicaPlane, kind: str) -> None:
    """The follower keeps applying ``good``'s entries, counts the bad data, stays ready; once the relay (idle
    check, then its next write) replaces ``bad``'s keys from its own state, the router holds ``bad`` exactly."""
    await HOSTILE[kind](plane, plane.raw)
    for _ in range(3):
        await plane.write(GOOD)
        await eventually(lambda: plane.agrees(GOOD), what="good replica flowing past the bad one")
    task = plane.follower._task
    assert task is not None and not task.done()
    assert plane.follower.is_ready()

    # The relay notices (its idle check or a refused append) and rebuilds `bad` under a new epoch.
    epoch = plane.relay.writers[BAD].position.epoch  # type: ignore[union-attr]
    for _ in range(50):
        await plane.relay.verify()
        await plane.write(BAD, steps=1)
        if plane.relay.writers[BAD].position.epoch > epoch:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.05)
    await plane.write(BAD)
    await eventually(lambda: plane.agrees(BAD), what="bad replica resynced from the relay's rebuilt state")
    await plane.write(GOOD)
    await eventually(lambda: plane.agrees(GOOD))
    assert sum(plane.problems(BAD).values()) >= 1, f"{kind}: the bad data was never counted"
    assert not plane.problems(GOOD)


async def test_undecodable_entry_is_skipped_then_a_newer_snapshot_reloads_the_replica(
    plane: TwoReplicaPlane,
) -> None:
    """Garbage that takes the relay's place in the numbering (as if the relay itself had written it: the relay
    carries on after it, so no new epoch comes): the follower skips the entry, counts it, keeps the replica's
    blocks, and reloads the replica from the snapshot once a newer one covers the entry."""
    writer = plane.relay.writers[BAD]
    await plane.write(BAD, steps=1)
    keys = writer.keys
    position = writer.position
    assert position is not None
    await plane.raw.xadd(keys.stream, {"e": b"\xc1"}, id=Position(position.epoch, position.n + 1).stream_id)
    writer.position = Position(position.epoch, position.n + 1)  # the relay carries on after it, as if its own
    await plane.raw.hset(keys.meta, mapping={"n": position.n + 1})
    await plane.write(BAD, steps=3)
    await eventually(lambda: plane.problems(BAD).get("undecodable", 0) >= 1, what="the entry counted")
    assert plane.follower.replicas[BAD].tainted
    await plane.write(BAD, steps=400)  # enough blocks touched for the relay to write a snapshot
    await eventually(lambda: not plane.follower.replicas[BAD].tainted, what="reload after the newer snapshot")
    await eventually(lambda: plane.agrees(BAD))
    assert plane.agrees(GOOD)


@pytest.mark.parametrize("streams_per_read", [None, 1], ids=["one-xread", "xread-per-replica"])
async def test_an_op_the_index_refuses_resyncs_that_replica_alone(
    redis_server: RedisServer, streams_per_read: int | None
) -> None:
    """A per-replica failure (here the index raising for ``bad``) is caught, counted ``apply_failed``, the
    replica quarantined and retried with back-off; ``good`` keeps flowing, and ``bad`` loads once it can. With one
    XREAD task per replica (Redis Cluster) as with one for all."""

    class Refusing(PrefixIndex):
        refuse: set[str] = set()

        def store_keys(self, replica, *args, **kwargs):  # type: ignore[no-untyped-def]
            if replica in self.refuse:
                raise KeyError("index refused")
            return super().store_keys(replica, *args, **kwargs)

    sink = Refusing()
    knobs = FollowerKnobs(
        block_ms=100, backoff_initial_s=0.05, backoff_max_s=0.2, resync_initial_s=0.1, resync_max_s=0.5,
        streams_per_read=streams_per_read,
    )  # fmt: skip
    plane = TwoReplicaPlane(redis_server.url, sink=sink, follower_knobs=knobs)
    try:
        await plane.start()
        sink.refuse = {BAD}
        await plane.write(BAD)
        await plane.write(GOOD)
        await eventually(lambda: plane.problems(BAD).get("apply_failed", 0) >= 1)
        await eventually(lambda: plane.follower.health().quarantined[BAD])
        for _ in range(3):
            await plane.write(GOOD)
            await eventually(lambda: plane.agrees(GOOD))
        assert plane.follower.is_ready()
        sink.refuse = set()
        await eventually(lambda: plane.agrees(BAD), what="bad loads once the index accepts it again")
        assert not plane.follower.health().quarantined[BAD]
    finally:
        await plane.close()


class Fatal(BaseException):
    """Escapes every ``except Exception``: the follower's task ends with it."""


async def test_follower_loop_that_dies_is_not_ready_and_restarts(redis_server: RedisServer) -> None:
    """The follower's task ends (a BaseException from the index, standing in for any death): its readiness check
    says not ready, the task is restarted with back-off, and following resumes."""

    class Dying(PrefixIndex):
        die = False

        def store_keys(self, replica, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.die:
                self.die = False
                raise Fatal
            return super().store_keys(replica, *args, **kwargs)

    sink = Dying()
    plane = TwoReplicaPlane(redis_server.url, sink=sink)
    try:
        await plane.start()
        task = plane.follower._task
        assert task is not None
        sink.die = True
        await plane.write(GOOD)
        await eventually(lambda: task.done(), what="the task died")
        assert not plane.follower.is_ready()
        await eventually(lambda: plane.follower.is_ready(), what="the follower restarted")
        assert plane.follower.loop_restarts == 1 and plane.follower._task is not task
        await plane.write(GOOD)
        await eventually(lambda: plane.agrees(GOOD))
    finally:
        await plane.close()


async def test_unexpected_error_in_the_loop_is_counted_and_not_ready_until_a_session_is_up(
    redis_server: RedisServer,
) -> None:
    plane = TwoReplicaPlane(redis_server.url)
    connect = plane.follower.connect
    calls = 0

    def flaky() -> Redis:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise RuntimeError("a bug")
        return connect()

    plane.follower.connect = flaky
    plane.follower.knobs = type(plane.follower.knobs)(block_ms=100, backoff_initial_s=0.2, startup_grace_s=0.0)
    try:
        await plane.start(loaded=False)
        await eventually(lambda: plane.follower.session_errors["internal"] >= 1)
        assert not plane.follower.is_ready()
        await eventually(lambda: plane.follower.is_ready(), what="ready once a session is up")
        await plane.write(GOOD)
        await eventually(lambda: plane.agrees(GOOD))
    finally:
        await plane.close()
