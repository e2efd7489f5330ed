"""Read one replica's state back from Redis: its snapshot plus the stream entries since, checked for gaps.

Both the router's follower (at start and after any doubt) and a restarting relay use this. The snapshot names
the entry it follows (``<epoch>-<n>``); the entries after it must continue that numbering without a hole. A hole
means the stream moved on underneath the read (two snapshots were written meanwhile, or the epoch changed), so
the read starts over; `attempts` bounds how often.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis

from kvrouter.redisplane.entries import EntryCodec, Op
from kvrouter.redisplane.layout import Position, ReplicaKeys


class CatchupError(Exception):
    """The replica's snapshot and stream never lined up within the attempts allowed."""


@dataclass(slots=True)
class Catchup:
    position: Position
    engine_seqs: dict[int, int]
    hash_seed: int
    ops: list[Op]
    """The snapshot's blocks first, then every op of the entries since, in order."""
    snapshot_blocks: int
    stream_entries: int
    stream_blocks: int
    """Blocks touched by the entries since the snapshot."""


async def read_replica(
    redis: Redis, keys: ReplicaKeys, codec: EntryCodec, *, attempts: int = 5, chunk: int = 2000
) -> Catchup | None:
    """The replica's state as Redis vouches for it, or None when Redis holds nothing for it."""
    for _ in range(attempts):
        if not await redis.exists(keys.meta):
            return None
        blob = await redis.get(keys.snapshot)
        if blob is None:
            continue
        snapshot = codec.snapshot(cast(bytes, blob))
        position = Position(snapshot.epoch, snapshot.n)
        ops: list[Op] = list(snapshot.blocks)
        engine_seqs = snapshot.engine_seqs
        entries_read = 0
        stream_blocks = 0
        complete = True
        while True:
            batch = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                await redis.xrange(keys.stream, min="(" + position.stream_id, count=chunk),
            )
            for stream_id, fields in batch:
                following = Position.parse(stream_id)
                if not following.follows(position):
                    complete = False
                    break
                entry = codec.entry(fields[b"e"])
                ops.extend(entry.ops)
                stream_blocks += sum(op.count for op in entry.ops)
                engine_seqs = entry.engine_seqs
                position = following
                entries_read += 1
            if not complete or len(batch) < chunk:
                break
        if complete:
            return Catchup(
                position,
                engine_seqs,
                snapshot.hash_seed,
                ops,
                sum(block.count for block in snapshot.blocks),
                entries_read,
                stream_blocks,
            )
    raise CatchupError(f"{keys.replica}: snapshot and stream did not line up in {attempts} attempts")
