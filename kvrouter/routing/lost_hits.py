"""Predicted hits the engine evicts before it uses them: the prefill they were to save goes back on the queue.

The load book counts a routed request's prefill as its prompt less the prefix the router predicted cached on the
chosen replica, until its first token. The prediction is right when it is made, but an engine short of KV memory
admits requests first-come-first-served, and a request queued behind a large prompt can wait many seconds; if the
blocks it was to reuse belong to a request that finishes meanwhile, they join the engine's free list and the
allocations of the requests ahead evict them. The engine then computes the whole prompt, and the router goes on
pricing that replica as if it had only the small uncached tail to do — an idle-looking replica with tens of
thousands of tokens queued, onto which the next requests herd. Seen live and in the replay on the Mooncake
conversation trace (docs/benchmarks.md, "Several routers"): a 77,799-token prompt predicted 74,240 cached waited
23.9 s behind a 112,941-token one, was served 512 from cache, and the small requests routed to its replica in the
next seconds waited 22-23 s each, where one router had sent two of the three elsewhere (~1 s).

`LostHitWatch` hears both paths (a `RequestListener` and an `EventListener`, `kvrouter.routing.lifecycle`): each
committed request with a predicted hit is watched on its replica until its first token; when the event path
applies a removal on that replica that takes one of the request's predicted blocks, the hit is cut back to the
blocks before the first one removed (a prefix hit stops at its first missing block) and the tokens lost are added to
the request's pending prefill (`LoadBook.add_prefill`), so the replica's queue, its price and what the load plane
shares all carry them. A block removed and stored again before the request is admitted would be hit after all:
the watch counts it lost (it over-counts the queue for the rest of that request's wait, never under-counts it).
Cost: nothing per request beyond a dict entry; per removal event on a replica with watched requests, one set
intersection per watched request (each request's key set is built on the first removal that could touch it).

Setting: `kv_lost_hits` (kvrouter/config.py), off by default (docs/benchmarks.md has why). Counted in `lost_requests`
and `lost_tokens` (`kvrouter_kv_lost_hits_total`, `kvrouter_kv_lost_hit_tokens_total`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrouter.routing.lifecycle import Routed
from kvrouter.typedefs import BlockKey, ReplicaName


@dataclass(slots=True, eq=False)
class _Watched:
    routed: Routed
    blocks: int
    """Predicted cached blocks still believed there (a prefix of `routed.keys`)."""
    keyset: frozenset[BlockKey] | None = field(default=None)


class LostHitWatch:
    """Gives a routed request's lost prefix hit back to its replica's pending prefill (see the module docstring)."""

    def __init__(self) -> None:
        self._watched: dict[ReplicaName, dict[int, _Watched]] = {}
        self.lost_requests = 0
        """Predicted hits cut back before their request's first token (a request cut twice counts twice)."""
        self.lost_tokens = 0
        """Prefill tokens given back to the load book in all."""

    # -- RequestListener -----------------------------------------------------------------------------------------

    def on_commit(self, routed: Routed) -> None:
        if routed.leg == "decode" or routed.block_size <= 0:
            return
        blocks = min(routed.predicted_cached // routed.block_size, len(routed.keys))
        if blocks > 0:
            self._watched.setdefault(routed.replica, {})[id(routed)] = _Watched(routed, blocks)

    def on_first_token(self, routed: Routed, now: float) -> None:
        self._drop(routed)

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        return None

    def on_finish(self, routed: Routed, now: float) -> None:
        self._drop(routed)

    def _drop(self, routed: Routed) -> None:
        watched = self._watched.get(routed.replica)
        if watched is not None and watched.pop(id(routed), None) is not None and not watched:
            del self._watched[routed.replica]

    # -- EventListener -------------------------------------------------------------------------------------------

    def on_stored(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        return None

    def on_removed(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        watched = self._watched.get(replica)
        if not watched or not keys:
            return
        removed = frozenset(keys)
        for key in list(watched):
            entry = watched[key]
            routed = entry.routed
            if entry.keyset is None:
                entry.keyset = frozenset(routed.keys[: entry.blocks])
            if entry.keyset.isdisjoint(removed):
                continue
            first = next(i for i in range(entry.blocks) if routed.keys[i] in removed)
            lost = (entry.blocks - first) * routed.block_size
            entry.blocks = first
            entry.keyset = None
            self._give_back(routed, lost)
            if first == 0:
                del watched[key]
        if not watched:
            self._watched.pop(replica, None)

    def on_cleared(self, replica: ReplicaName, now: float) -> None:
        """Every cached block of the replica is gone: every watched request there computes its whole prompt."""
        watched = self._watched.pop(replica, None)
        for entry in (watched or {}).values():
            self._give_back(entry.routed, entry.blocks * entry.routed.block_size)

    def _give_back(self, routed: Routed, lost: int) -> None:
        """`lost` predicted-cached tokens are to be computed after all (never more than the prompt)."""
        added = routed.load.add_prefill(routed.ticket, min(lost, routed.prompt_tokens - routed.ticket.prefill_tokens))
        if added > 0:
            self.lost_requests += 1
            self.lost_tokens += added

    @property
    def watched(self) -> int:
        """Requests watched now (the metrics' gauge)."""
        return sum(len(entries) for entries in self._watched.values())


__all__ = ["LostHitWatch"]
