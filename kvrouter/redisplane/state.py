"""The relay's authoritative block state per replica (pure, synchronous).

`ReplicaState` keeps, per (data-parallel rank, tier), the engine hash -> kvrouter key map of one replica, and
records every change as an `entries.Op` waiting to be written to Redis. Its event methods have the same shape as
`PrefixIndex`'s (`store_keys`, `remove_blocks`, `clear`, `key_of`), and `RelayBook` dispatches them by replica,
so the very ingest code that feeds a router's index in embedded mode feeds the relay: decoding and key
computation exist once. A snapshot is built from the per-(rank, tier) dicts with C-level array copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvrouter.redisplane.entries import Cleared, Op, Removed, Stored, unpack_u64
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

_TIER_ORDER = tuple(Tier)


class ReplicaState:
    def __init__(self, replica: ReplicaName) -> None:
        self.replica = replica
        self._tables: dict[tuple[int, int], dict[int, int]] = {}
        self._pending: list[Op] = []
        self.pending_weight = 0
        """Blocks touched by the pending ops (what a follower will have to apply)."""
        self.cleared = False
        """Set by `clear`: the replica's history restarts, so the writer starts a new epoch."""

    # ---- the PrefixIndex-shaped event API ------------------------------------------------------------------

    def store_keys(
        self,
        replica: ReplicaName,
        engine_hashes: Sequence[EngineBlockHash],
        keys: Sequence[BlockKey],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> None:
        if len(engine_hashes) != len(keys):
            raise ValueError("engine_hashes and keys must have the same length")
        if not keys:
            return
        self._forget_reused(dp_rank, int(tier), engine_hashes, keys)
        self._tables.setdefault((dp_rank, int(tier)), {}).update(zip(engine_hashes, keys, strict=True))
        self._record(Stored.of(dp_rank, int(tier), engine_hashes, keys), len(keys))

    def _forget_reused(
        self, rank: int, tier: int, engine_hashes: Sequence[EngineBlockHash], keys: Sequence[BlockKey]
    ) -> None:
        """A hash stored again under another key names a new block: the old one under it is gone in every tier
        (the router's index does the same when it applies the Stored op), so a hash maps to one key per rank."""
        for (table_rank, table_tier), table in self._tables.items():
            if table_rank != rank or table_tier == tier or table.keys().isdisjoint(engine_hashes):
                continue
            for engine_hash, key in zip(engine_hashes, keys, strict=True):
                old = table.get(engine_hash)
                if old is not None and old != key:
                    del table[engine_hash]

    def remove_blocks(
        self,
        replica: ReplicaName,
        engine_hashes: Iterable[EngineBlockHash],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> int:
        """Forget evicted blocks; returns how many hashes were unknown (those are not written)."""
        table = self._tables.get((dp_rank, int(tier)), {})
        known: list[int] = []
        unknown = 0
        for engine_hash in engine_hashes:
            if table.pop(engine_hash, None) is None:
                unknown += 1
            else:
                known.append(engine_hash)
        if known:
            self._record(Removed.of(dp_rank, int(tier), known), len(known))
        return unknown

    def clear(self, replica: ReplicaName, *, dp_rank: int | None = None) -> None:
        if dp_rank is None:
            self._tables.clear()
        else:
            for rank_tier in [rt for rt in self._tables if rt[0] == dp_rank]:
                del self._tables[rank_tier]
        self._record(Cleared(dp_rank), 1)
        self.cleared = True

    def key_of(self, replica: ReplicaName, engine_hash: EngineBlockHash, *, dp_rank: int = 0) -> BlockKey | None:
        for tier in _TIER_ORDER:
            table = self._tables.get((dp_rank, int(tier)))
            if table is not None:
                key = table.get(engine_hash)
                if key is not None:
                    return BlockKey(key)
        return None

    # ---- the plane's side ----------------------------------------------------------------------------------

    def _record(self, op: Op, weight: int) -> None:
        self._pending.append(op)
        self.pending_weight += weight

    def take_pending(self) -> list[Op]:
        ops, self._pending = self._pending, []
        self.pending_weight = 0
        return ops

    def reset(self) -> None:
        """Empty state and nothing pending (a new epoch starts from here)."""
        self._tables.clear()
        self._pending = []
        self.pending_weight = 0

    def load(self, ops: Iterable[Op]) -> None:
        """Apply ops read back from Redis (a snapshot and the stream since) without recording them."""
        for op in ops:
            if isinstance(op, Stored):
                hashes, keys = unpack_u64(op.hashes), unpack_u64(op.keys)
                self._forget_reused(op.rank, op.tier, hashes, keys)  # type: ignore[arg-type]
                self._tables.setdefault((op.rank, op.tier), {}).update(zip(hashes, keys, strict=True))
            elif isinstance(op, Removed):
                table = self._tables.get((op.rank, op.tier), {})
                for engine_hash in unpack_u64(op.hashes):
                    table.pop(engine_hash, None)
            elif op.rank is None:
                self._tables.clear()
            else:
                for rank_tier in [rt for rt in self._tables if rt[0] == op.rank]:
                    del self._tables[rank_tier]

    def snapshot_blocks(self) -> list[Stored]:
        return [
            Stored.of(rank, tier, list(table.keys()), list(table.values()))
            for (rank, tier), table in sorted(self._tables.items())
            if table
        ]

    def blocks(self) -> dict[tuple[int, int], dict[int, int]]:
        """A copy of the state, (rank, tier) -> engine hash -> key; for tests and tools."""
        return {rank_tier: dict(table) for rank_tier, table in self._tables.items() if table}

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables.values())


class RelayBook:
    """Every replica one relay serves; the same event API as `PrefixIndex`, dispatched by replica."""

    def __init__(self, replicas: Iterable[ReplicaName]) -> None:
        self.states = {replica: ReplicaState(replica) for replica in replicas}

    def __getitem__(self, replica: ReplicaName) -> ReplicaState:
        return self.states[replica]

    def store_keys(
        self,
        replica: ReplicaName,
        engine_hashes: Sequence[EngineBlockHash],
        keys: Sequence[BlockKey],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> None:
        self.states[replica].store_keys(replica, engine_hashes, keys, tier, dp_rank=dp_rank)

    def remove_blocks(
        self,
        replica: ReplicaName,
        engine_hashes: Iterable[EngineBlockHash],
        tier: Tier = Tier.GPU,
        *,
        dp_rank: int = 0,
    ) -> int:
        return self.states[replica].remove_blocks(replica, engine_hashes, tier, dp_rank=dp_rank)

    def clear(self, replica: ReplicaName, *, dp_rank: int | None = None) -> None:
        self.states[replica].clear(replica, dp_rank=dp_rank)

    def key_of(self, replica: ReplicaName, engine_hash: EngineBlockHash, *, dp_rank: int = 0) -> BlockKey | None:
        return self.states[replica].key_of(replica, engine_hash, dp_rank=dp_rank)
