"""The one write protocol of the prefix index: what every writer may do to it, and nothing else.

Writers: the KV-event ingest (`kvrouter/events/ingest.py`, embedded ZMQ and the relay), the Redis follower
(`kvrouter/redisplane/follower.py`), the app's forget-a-replica (`kvrouter/server/app.py`), the admin API's
replica removal (`kvrouter/admin/control.py`) and the replay's engine events (`kvrouter/replay/driver.py`). Each
types its dependency with `IndexWriter` (or a protocol that adds the reads it needs), never by `isinstance`.
`kvrouter.index.PrefixIndex` implements it; so does the relay's Redis-backed book (`kvrouter/redisplane/state.py`).

`key_of` is a read, but part of the protocol: a writer needs it to know what a removal takes away (the listeners
hear keys, the engine names hashes). A replica that leaves is `clear(replica)`: all its ranks and its
provisional marks. Provisional entries are not written through this protocol: the router adds them on commit
through its `PrefixLookup`, so the learning overlays wrapping the lookup see them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier


class IndexWriter(Protocol):
    def key_of(self, replica: ReplicaName, engine_hash: EngineBlockHash, *, dp_rank: int = 0) -> BlockKey | None:
        """kvrouter's key of the block the engine named `engine_hash`, if it was stored and understood."""
        ...

    def store_keys(
        self,
        replica: ReplicaName,
        engine_hashes: Sequence[EngineBlockHash],
        keys: Sequence[BlockKey],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> None:
        """`replica` (rank `dp_rank`) now holds `keys` in `tier`, under the engine's `engine_hashes`."""
        ...

    def remove_blocks(
        self, replica: ReplicaName, engine_hashes: Iterable[EngineBlockHash], tier: Tier = Tier.GPU, *, dp_rank: int = 0
    ) -> int:
        """The engine evicted these blocks from `tier`; returns how many hashes were unknown."""
        ...

    def clear(self, replica: ReplicaName, *, dp_rank: int | None = None) -> None:
        """The replica's blocks are gone: one DP rank's, or (no rank) every rank's and its provisional marks."""
        ...


class CountingIndexWriter(IndexWriter, Protocol):
    """A writer that can also say how many blocks a replica holds (the admin view, the forget warning)."""

    def blocks_of(self, replica: ReplicaName) -> int: ...


__all__ = ["CountingIndexWriter", "IndexWriter"]
