"""Apply normalised KV-event batches to the prefix index (pure, synchronous).

`BlockStored` gets kvrouter's own keys: the event's token ids cut into blocks and chained with
`kvrouter.blocks.chain_keys` from the parent's key, which the replica's engine-hash -> key map gives back. A
parent never seen (its event was lost, or came before this router started) is counted as `unknown_parent` and
skipped — guessing would poison every child. What vLLM isolates a cache by is honoured: the LoRA adapter
(`lora_name`) and the cache salt (the first block's extra key) start the chain from the same root material a
request with that adapter and salt gets. Blocks whose extra keys carry anything else (multimodal hashes) cannot
be reproduced from a request's text, so they are counted as `unsupported_extra_keys` and not indexed.
`BlockRemoved` maps engine hashes back to keys; `AllBlocksCleared` drops the (replica, DP rank).
Only full-attention KV groups are indexed (hybrid models publish one store per group; the others are counted as
`ignored_group`).

A store that reuses an engine hash for other tokens counts as "ok": the index treats the old block under that
hash as gone (see `index`). Ranks outside the replica's DP size never get here (`zmq_source` skips them as
`bad_rank`), nor do messages over `max_message_bytes` (`oversized`).

Every event ends in exactly one `(replica, type, status)` count, handed to `on_event` (the Prometheus counter in
the app) and kept in `counts` for tests and the debug endpoint. What was applied also goes, in the router's keys,
to every `EventListener` (`kvrouter.routing.lifecycle`; the learning overlays): `on_stored` with the keys of an indexed
store, `on_removed` with the keys of the removed blocks the index knew, `on_cleared` for `AllBlocksCleared`
(a restart or reset: the replica's cache is gone). `clock` stamps those calls.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from kvrouter.blocks import chain_keys
from kvrouter.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvrouter.index_writer import IndexWriter
from kvrouter.routing.lifecycle import EventListener, tell_cleared
from kvrouter.typedefs import BlockKey, ReplicaName

EventCount = Callable[[str, str, str], None]
"""(replica, event type, status) -> None; called once per event."""

_FULL_ATTENTION = (None, "full_attention")


class IndexIngest:
    def __init__(
        self,
        index: IndexWriter,
        *,
        block_sizes: Mapping[ReplicaName, int],
        seed: int = 0,
        on_event: EventCount | None = None,
        listeners: Sequence[EventListener] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.listeners = tuple(listeners)
        self.clock = clock
        self.block_sizes = dict(block_sizes)
        self.seed = seed
        self.on_event = on_event
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self._ignored_groups: dict[tuple[ReplicaName, int], set[int]] = {}

    def _count(self, replica: str, kind: str, status: str) -> None:
        self.counts[(replica, kind, status)] += 1
        if self.on_event is not None:
            self.on_event(replica, kind, status)

    def apply(self, batch: EventBatch) -> None:
        replica = ReplicaName(batch.replica)
        for event in batch.events:
            if isinstance(event, BlockStored):
                status = self._stored(replica, batch.dp_rank, event)
                self._count(replica, "BlockStored", status)
            elif isinstance(event, BlockRemoved):
                self._count(replica, "BlockRemoved", self._removed(replica, batch.dp_rank, event))
            elif isinstance(event, AllBlocksCleared):
                # A restart also voids the provisional marks of requests the dead engine took (`dp_rank=None`).
                self.index.clear(replica, dp_rank=None if event.restart else batch.dp_rank)
                tell_cleared(self.listeners, replica, self.clock())
                self._count(replica, "AllBlocksCleared", "restart" if event.restart else "ok")

    def _stored(self, replica: ReplicaName, rank: int, event: BlockStored) -> str:
        if event.spec_kind not in _FULL_ATTENTION:
            if event.group_idx is not None:
                self._ignored_groups.setdefault((replica, rank), set()).add(event.group_idx)
            return "ignored_group"
        block_size = self.block_sizes.get(replica, event.block_size)
        if event.block_size != block_size:
            return "block_size_mismatch"
        if not event.engine_hashes or len(event.token_ids) != len(event.engine_hashes) * block_size:
            return "bad_event"
        salt: str | None = None
        extra = event.extra_keys
        if extra is not None and any(extra):
            first = list(extra[0] or ())
            if event.lora_name is not None and first and first[0] == event.lora_name:
                first = first[1:]
            if any(extra[1:]) and not (event.lora_name is not None and _lora_only(extra[1:], event.lora_name)):
                return "unsupported_extra_keys"
            if event.parent is not None and first:
                return "unsupported_extra_keys"
            if len(first) == 1 and isinstance(first[0], str):
                salt = first[0]
            elif first:
                return "unsupported_extra_keys"
        try:
            if event.parent is None:
                keys = chain_keys(event.token_ids, block_size, seed=self.seed, lora=event.lora_name, cache_salt=salt)
            else:
                parent_key = self.index.key_of(replica, event.parent, dp_rank=rank)
                if parent_key is None:
                    return "unknown_parent"
                keys = chain_keys(event.token_ids, block_size, seed=self.seed, parent=parent_key)
        except OverflowError:
            return "bad_event"  # a token id outside 0 .. 2**32-1: no engine sends one
        self.index.store_keys(replica, event.engine_hashes, keys, event.tier, dp_rank=rank)
        if self.listeners:
            now = self.clock()
            for listener in self.listeners:
                listener.on_stored(replica, keys, now)
        return "ok"

    def _removed(self, replica: ReplicaName, rank: int, event: BlockRemoved) -> str:
        if event.group_idx is not None and event.group_idx in self._ignored_groups.get((replica, rank), ()):
            return "ignored_group"
        removed: list[BlockKey] = []
        if self.listeners:  # the keys, read before the index forgets them
            for engine_hash in event.engine_hashes:
                key = self.index.key_of(replica, engine_hash, dp_rank=rank)
                if key is not None:
                    removed.append(key)
        unknown = self.index.remove_blocks(replica, event.engine_hashes, event.tier, dp_rank=rank)
        if removed:
            now = self.clock()
            for listener in self.listeners:
                listener.on_removed(replica, removed, now)
        return "ok" if unknown == 0 else "unknown_block"


def _lora_only(extra: list[object], lora_name: str) -> bool:
    """True when every later block's extra keys are just the adapter name (vLLM repeats it on every block)."""
    return all(not keys or list(keys) == [lora_name] for keys in extra)  # type: ignore[call-overload]


__all__ = ["EventCount", "IndexIngest"]
