"""Fuzzing the Redis event plane's entries (issue 15).

Decode level, in process: `EntryCodec` either refuses a value with one of `DECODE_ERRORS` or returns an entry
every op of which the index can take (ranks, tiers, whole u64 arrays, as many keys as hashes). CI runs
KVROUTER_FUZZ_REDIS_DECODE cases (default 10,000: random msgpack trees, byte flips and splices of valid entries)
plus KVROUTER_FUZZ_REDIS_HYPOTHESIS hypothesis examples (default 1,000) over arbitrary bytes and msgpack values.

Against a real redis-server: hypothesis writes lists of adversarial entries (garbage bytes, wrong shapes, right
ids and wrong ids, missing fields, huge values, snapshot and key-type vandalism) into one replica's keys while a
second replica's stream carries good entries. Properties: the follower's task never dies and stays ready, the
good replica's blocks all arrive in the index, the bad replica's trouble is counted, and once the vandalism stops
the bad replica is resynced to exactly the relay's state. KVROUTER_FUZZ_REDIS_EXAMPLES examples (default 5, each
40 to 100 entries: a few hundred hostile entries per CI run).
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.redisplane.entries import DECODE_ERRORS, MAX_RANK, MAX_TIER, Entry, EntryCodec, Stored
from kvrouter.redisplane.layout import Position
from tests.conftest import eventually
from tests.redis_fixtures import RedisServer
from tests.redis_plane_support import TwoReplicaPlane

DECODE_CASES = int(os.environ.get("KVROUTER_FUZZ_REDIS_DECODE", "10000"))
HYPOTHESIS_CASES = int(os.environ.get("KVROUTER_FUZZ_REDIS_HYPOTHESIS", "1000"))
REDIS_EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_REDIS_EXAMPLES", "5"))
GOOD, BAD = TwoReplicaPlane.GOOD, TwoReplicaPlane.BAD

encode = msgspec.msgpack.encode


def check_usable(entry: Entry) -> None:
    """What the follower relies on after a successful decode."""
    for rank, seq in entry.engine_seqs.items():
        assert 0 <= rank < MAX_RANK and seq >= 0
    for op in entry.ops:
        assert op.rank is None or 0 <= op.rank < MAX_RANK
        if isinstance(op, Stored):
            assert 0 <= op.tier <= MAX_TIER
            assert len(op.hashes) == len(op.keys) and len(op.hashes) % 8 == 0
        elif hasattr(op, "hashes"):
            assert 0 <= op.tier <= MAX_TIER and len(op.hashes) % 8 == 0


def decode_or_refuse(codec: EntryCodec, blob: bytes) -> bool:
    try:
        entry = codec.entry(blob)
    except DECODE_ERRORS:
        return False
    check_usable(entry)
    return True


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, 1, -1, 2, 3, MAX_RANK - 1, MAX_RANK, 2**63 - 1, -(2**63), 2**64 - 1])
    if kind == 1:
        return rng.randbytes(rng.choice([0, 7, 8, 16, 17, 24]))
    if kind == 2:
        return rng.choice(["", "e", "x" * 40])
    if kind == 3:
        return rng.choice([None, True, False, 1.5])
    if kind == 4:
        return rng.randrange(-5, 5)
    if kind == 5:
        return rng.randbytes(8)
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    if kind == 7:
        return {random_value(rng, 3): random_value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return [rng.randrange(3), *(random_value(rng, depth + 1) for _ in range(rng.randrange(5)))]


def valid_blob(rng: random.Random, codec: EntryCodec) -> bytes:
    count = rng.randrange(4)
    ops: list[Any] = [
        Stored.of(rng.randrange(4), rng.randrange(3), [rng.getrandbits(64) for _ in range(count)],
                  [rng.getrandbits(64) for _ in range(count)])
    ]  # fmt: skip
    return codec.encode(Entry({0: rng.randrange(1000)}, ops))


def mutated(rng: random.Random, blob: bytes) -> bytes:
    data = bytearray(blob)
    for _ in range(rng.randrange(1, 4)):
        choice = rng.randrange(3)
        if choice == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 1 and data:
            del data[rng.randrange(len(data)) :]
        else:
            data[rng.randrange(len(data) + 1) : 0] = rng.randbytes(rng.randrange(1, 5))
    return bytes(data)


def test_decode_refuses_or_returns_usable_entries_random_cases() -> None:
    rng = random.Random(15)
    codec = EntryCodec()
    accepted = 0
    for case in range(DECODE_CASES):
        kind = case % 3
        if kind == 0:
            blob = encode(random_value(rng))
        elif kind == 1:
            blob = mutated(rng, valid_blob(rng, codec))
        else:
            blob = encode([random_value(rng), [random_value(rng, 1) for _ in range(rng.randrange(3))]])
        accepted += decode_or_refuse(codec, blob)
    assert 0 < accepted < DECODE_CASES  # both sides of the edge were exercised


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.binary(max_size=24)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.integers(-2, 2000), children, max_size=3),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=HYPOTHESIS_CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=64), msgpack_values.map(encode)))
def test_decode_refuses_or_returns_usable_entries_hypothesis(blob: bytes) -> None:
    decode_or_refuse(EntryCodec(), blob)


# ---- against a real Redis -------------------------------------------------------------------------------------

VANDALISM = ("garbage", "shape", "next_id_garbage", "skip_id", "auto_id", "no_field", "huge", "snapshot", "type")
hostile_lists = st.lists(
    st.tuples(st.sampled_from(VANDALISM), st.binary(max_size=32), msgpack_values), min_size=40, max_size=100
)


async def vandalise(plane: TwoReplicaPlane, kind: str, blob: bytes, value: Any) -> None:
    keys = plane.relay.writers[BAD].keys
    raw = plane.raw
    position = plane.relay.writers[BAD].position or Position(1, 0)
    top = await raw.xrevrange(keys.stream, count=1) if await raw.type(keys.stream) == b"stream" else []
    after = Position.parse(top[0][0]) if top else position
    next_id = Position(after.epoch, after.n + 1).stream_id
    if kind == "garbage":
        await raw.xadd(keys.stream, {"e": blob}, id=next_id)
    elif kind == "shape":
        await raw.xadd(keys.stream, {"e": encode(value)}, id=next_id)
    elif kind == "next_id_garbage":
        await raw.xadd(keys.stream, {"e": encode([{0: 1}, [value]])}, id=next_id)
    elif kind == "skip_id":
        await raw.xadd(keys.stream, {"e": blob}, id=Position(after.epoch, after.n + 3).stream_id)
    elif kind == "auto_id":
        await raw.xadd(keys.stream, {"e": blob})
    elif kind == "no_field":
        await raw.xadd(keys.stream, {"z": blob}, id=next_id)
    elif kind == "huge":
        await raw.xadd(keys.stream, {"e": blob * 4096 + encode(value)}, id=next_id)
    elif kind == "snapshot":
        await raw.set(keys.snapshot, blob)
    else:
        await raw.delete(keys.stream)
        await raw.hset(keys.stream, "e", blob)


async def scenario(url: str, hostile: list[tuple[str, bytes, Any]]) -> None:
    plane = TwoReplicaPlane(url)
    try:
        await plane.start()
        for i, (kind, blob, value) in enumerate(hostile):
            try:
                await vandalise(plane, kind, blob, value)
            except Exception as error:  # Redis refused the vandalism itself (e.g. an id below the top)
                assert "ERR" in str(error) or "WRONGTYPE" in str(error), error
            await plane.write(GOOD, steps=1)
            if i % 7 == 0:
                await plane.write(BAD, steps=1)  # the relay meets the vandalism in its appends
            task = plane.follower._task
            assert task is not None and not task.done(), "the follower died"
        await eventually(lambda: plane.agrees(GOOD), within_s=30, what="every good block arrived")
        assert plane.follower.is_ready()
        # The vandalism stops: the relay's idle check and next writes repair the bad replica.
        for _ in range(100):
            await plane.relay.verify()
            await plane.write(BAD, steps=1)
            if plane.agrees(BAD) and not plane.follower.health().quarantined[BAD]:
                break
            await asyncio.sleep(0.05)
        await eventually(lambda: plane.agrees(BAD), within_s=30, what="the bad replica resynced")
        assert sum(plane.problems(BAD).values()) >= 1 or plane.follower.replicas[BAD].reloads >= 2
        assert not plane.problems(GOOD)
    finally:
        await plane.close()


@pytest.mark.redis
def test_hostile_entries_in_one_stream_never_stop_the_other(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    tried: list[int] = []
    try:

        @settings(
            max_examples=REDIS_EXAMPLES,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(hostile_lists)
        def run(hostile: list[tuple[str, bytes, Any]]) -> None:
            asyncio.run(scenario(server.url, hostile))
            asyncio.run(flush(server.url))
            tried.append(len(hostile))

        run()
        print(f"hostile Redis entries: {sum(tried)} in {len(tried)} examples")
    finally:
        server.kill()


async def flush(url: str) -> None:
    from kvrouter.redisplane.follower import connect_redis

    redis = connect_redis(url, socket_timeout_s=5.0)
    await redis.flushall()
    await redis.aclose()
