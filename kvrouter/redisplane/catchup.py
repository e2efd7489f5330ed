"""Read one replica's state back from Redis: its snapshot plus the stream entries since, checked for gaps.

Both the router's follower (at start and after any doubt) and a restarting relay use this. The snapshot names
the entry it follows (``<epoch>-<n>``); the entries after it must continue that numbering without a hole. A hole
means the stream moved on underneath the read (two snapshots were written meanwhile, or the epoch changed), so
the read starts over; `attempts` bounds how often.

Hostile data. A snapshot that does not decode raises `CorruptReplica` (reason ``snapshot``); so does a stream
entry without its ``e`` field or one that does not decode, unless ``skip_bad_entries`` is set (the router's
follower): then the entry is skipped and counted in `Catchup.skipped`, and the follower reloads once a newer
snapshot covers it. A relay reading its own state back wants all or nothing, and starts a new epoch instead.
Redis errors on a key of the wrong type (``WRONGTYPE``) pass through as `redis.exceptions.ResponseError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis

from kvrouter.redisplane.entries import DECODE_ERRORS, Entry, EntryCodec, Op
from kvrouter.redisplane.layout import MAX_EPOCH, Position, ReplicaKeys


class CatchupError(Exception):
    """The replica's snapshot and stream never lined up within the attempts allowed."""

    reason = "gap"


class CorruptReplica(CatchupError):
    """What Redis holds for the replica does not decode (`reason`: ``snapshot`` or ``entry``)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


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
    snapshot_id: str = ""
    """The snapshot's stream id (``<epoch>-<n>``) as loaded."""
    skipped: int = 0
    """Entries that did not decode and were skipped (only with ``skip_bad_entries``)."""


def decode_entry(codec: EntryCodec, fields: object) -> Entry:
    """A stream entry's fields (``{b"e": blob}``) decoded; raises one of `DECODE_ERRORS`, KeyError or TypeError."""
    return codec.entry(cast(dict[bytes, bytes], fields)[b"e"])


ENTRY_ERRORS = (*DECODE_ERRORS, KeyError, TypeError)
"""What `decode_entry` raises for an entry that is not ours: bad msgpack, bad values, no ``e`` field."""


async def read_replica(
    redis: Redis,
    keys: ReplicaKeys,
    codec: EntryCodec,
    *,
    attempts: int = 5,
    chunk: int = 2000,
    skip_bad_entries: bool = False,
) -> Catchup | None:
    """The replica's state as Redis vouches for it, or None when Redis holds nothing for it."""
    mismatched = False
    for _ in range(attempts):
        if not await redis.exists(keys.meta):
            return None
        meta_epoch = int(cast(bytes, await redis.hget(keys.meta, "epoch") or b"-1"))  # ValueError: bad meta
        blob = await redis.get(keys.snapshot)
        if blob is None:
            continue
        try:
            snapshot = codec.snapshot(cast(bytes, blob))
        except DECODE_ERRORS as error:
            raise CorruptReplica(f"{keys.replica}: the snapshot does not decode: {error}", "snapshot") from None
        if snapshot.epoch != meta_epoch or snapshot.epoch >= MAX_EPOCH:
            # The scripts write both at once: a mismatch is a new epoch between the two reads, or garbage.
            mismatched = True
            continue
        position = Position(snapshot.epoch, snapshot.n)
        skipped = 0
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
                position = following
                entries_read += 1
                try:
                    entry = decode_entry(codec, fields)
                except ENTRY_ERRORS as error:
                    if not skip_bad_entries:
                        message = f"{keys.replica}: entry {following.stream_id} does not decode: {error!r}"
                        raise CorruptReplica(message, "entry") from None
                    skipped += 1
                    continue
                ops.extend(entry.ops)
                stream_blocks += sum(op.count for op in entry.ops)
                engine_seqs = entry.engine_seqs
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
                f"{snapshot.epoch}-{snapshot.n}",
                skipped,
            )
    if mismatched:
        raise CorruptReplica(f"{keys.replica}: the snapshot's epoch does not match the meta hash", "snapshot")
    raise CatchupError(f"{keys.replica}: snapshot and stream did not line up in {attempts} attempts")
