"""Wire format of the event plane: stream entries and snapshots (msgpack via msgspec, typed at the edge).

An entry carries *kvrouter's* block keys next to the engine's hashes, computed once by the relay from the token
ids in ``BlockStored``. Routers therefore never rehash and never need token ids: an entry costs 16 bytes per
stored block (engine hash + key, packed little-endian u64 arrays) instead of ``4 * block_size`` bytes of token
ids, and N routers do not repeat the relay's hashing. The price is that relay and routers must agree on the
fleet's ``hash_seed`` — the meta hash records it and a follower refuses a mismatching replica.

Ops (msgpack arrays tagged by their first element): ``[0, rank, tier, hashes, keys]`` stored,
``[1, rank, tier, hashes]`` removed, ``[2, rank|nil]`` cleared (nil: every data-parallel rank).
A snapshot is a replica's complete state as ``Stored`` ops, one per (rank, tier), plus the entry it follows.

Decoding validates, so nothing past `EntryCodec` sees a value the index could choke on: ranks in
``[0, MAX_RANK)`` (the largest ``data_parallel_size`` the config allows), tiers known to `Tier`, packed arrays of
whole u64s with as many keys as hashes, non-negative sequence numbers. Anything else raises
``msgspec.ValidationError`` / ``msgspec.DecodeError`` (`DECODE_ERRORS`), which the follower and the relay count
and skip: Redis is a shared store, and one hostile or corrupt entry must never stop the event plane.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Annotated

import msgspec

SNAPSHOT_VERSION = 1
MAX_RANK = 1024
"""Data-parallel ranks are below this (`KvEventsConfig.data_parallel_size` is at most 1024)."""
MAX_TIER = 2
"""`kvrouter.typedefs.Tier.STORAGE`, the highest tier."""

Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANK)]
TierValue = Annotated[int, msgspec.Meta(ge=0, le=MAX_TIER)]
Seq = Annotated[int, msgspec.Meta(ge=0)]

DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
"""What a hostile entry or snapshot raises from `EntryCodec` (ValidationError covers the range checks)."""


def pack_u64(values: Iterable[int]) -> bytes:
    packed = array("Q", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_u64(data: bytes) -> list[int]:
    if len(data) % 8:
        raise ValueError(f"packed u64 array has {len(data)} bytes, not a multiple of 8")
    values = array("Q")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _check_packed(*arrays: bytes) -> None:
    for data in arrays:
        if len(data) % 8:
            raise ValueError(f"packed u64 array has {len(data)} bytes, not a multiple of 8")


class Stored(msgspec.Struct, array_like=True, frozen=True, tag=0):
    rank: Rank
    tier: TierValue
    hashes: bytes
    keys: bytes

    def __post_init__(self) -> None:
        _check_packed(self.hashes, self.keys)
        if len(self.hashes) != len(self.keys):
            raise ValueError("hashes and keys differ in length")

    @classmethod
    def of(cls, rank: int, tier: int, hashes: Sequence[int], keys: Sequence[int]) -> Stored:
        if len(hashes) != len(keys):
            raise ValueError("hashes and keys differ in length")
        return cls(rank, tier, pack_u64(hashes), pack_u64(keys))

    @property
    def count(self) -> int:
        return len(self.hashes) // 8


class Removed(msgspec.Struct, array_like=True, frozen=True, tag=1):
    rank: Rank
    tier: TierValue
    hashes: bytes

    def __post_init__(self) -> None:
        _check_packed(self.hashes)

    @classmethod
    def of(cls, rank: int, tier: int, hashes: Sequence[int]) -> Removed:
        return cls(rank, tier, pack_u64(hashes))

    @property
    def count(self) -> int:
        return len(self.hashes) // 8


class Cleared(msgspec.Struct, array_like=True, frozen=True, tag=2):
    rank: Rank | None = None

    @property
    def count(self) -> int:
        return 1


Op = Stored | Removed | Cleared


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One stream entry: the ops of one or more engine batches; `engine_seqs` is the last sequence number
    applied per data-parallel rank (where a restarted relay resumes)."""

    engine_seqs: dict[Rank, Seq]
    ops: list[Op]


class Snapshot(msgspec.Struct, array_like=True, frozen=True):
    """A replica's whole state right after entry ``<epoch>-<n>``."""

    version: int
    epoch: Seq
    n: Seq
    engine_seqs: dict[Rank, Seq]
    hash_seed: int
    blocks: list[Stored]


class EntryCodec:
    """Encoders and decoders, built once per writer or follower."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._entry = msgspec.msgpack.Decoder(Entry)
        self._snapshot = msgspec.msgpack.Decoder(Snapshot)

    def encode(self, value: Entry | Snapshot) -> bytes:
        return self._encoder.encode(value)

    def entry(self, data: bytes) -> Entry:
        return self._entry.decode(data)

    def snapshot(self, data: bytes) -> Snapshot:
        snapshot = self._snapshot.decode(data)
        if snapshot.version != SNAPSHOT_VERSION:
            raise msgspec.ValidationError(f"snapshot version {snapshot.version}, expected {SNAPSHOT_VERSION}")
        return snapshot
