"""Session affinity hints: the replica that served a session's previous request, as a hint for its next one.

Agents and chat clients send a session key (header `x-session-id`, or the OpenAI `user` field; which one is
`session_key_from`, read at the edge by `kvrouter.server.session_keys`). The router remembers, per key, the
replica its last request went to (`SessionTable`), and the next request of the session carries that replica as a
hint (`session_mode`):

* `soft` (default): a preference, not a rule. The policy gives the hinted replica a bonus in its own currency, so
  the hint wins ties and small cost differences and never overrides a clearly cheaper replica. kv_aware's bonus is
  `kv_session_bonus` x the request's own estimated prefill there (`kvrouter.policies.kv_aware`); round_robin and
  least_loaded have no cost to weigh and ignore it.
* `sticky`: the session's replica whenever it is routable (healthy, not drained, not already tried by this
  request); the policy chooses only a session's first request, or when its replica is gone. Kept to measure
  against `soft`: a fixed replica per session piles sessions up on a replica however long its queue grows.
* `off`: no table, no hint.

The table is an LRU of at most `session_max` keys (an idle session's entry goes first) and forgets a key idle for
`session_ttl_s` (by then its replica has likely evicted what the session left there); a replica that leaves the
fleet, or whose cache is gone, takes its sessions with it (`forget`). Pure and synchronous: the clock is a
parameter of every call. `hinted_decisions` and `changed_decisions` count decisions that had a hint and
decisions the hint changed (the policy alone would have chosen another replica), for the metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvrouter.typedefs import ReplicaName, SessionMode

SESSION_MODES: tuple[SessionMode, ...] = ("off", "soft", "sticky")


@dataclass(slots=True)
class _Entry:
    replica: ReplicaName
    seen: float


class SessionTable:
    def __init__(self, *, mode: SessionMode = "soft", max_sessions: int = 65_536, ttl_s: float = 600.0) -> None:
        if mode not in SESSION_MODES:
            raise ValueError(f"session mode must be one of {', '.join(SESSION_MODES)}, got {mode!r}")
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError("max_sessions and ttl_s must be positive")
        self.mode = mode
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.hinted_decisions = 0
        """Decisions committed with a live hint (the session's replica was a candidate)."""
        self.changed_decisions = 0
        """Of those, the ones where the policy alone would have chosen another replica."""
        self.evicted = 0
        """Sessions dropped to stay within `max_sessions`."""

    def replica_of(self, key: str | None, now: float) -> ReplicaName | None:
        """The replica that served `key`'s last request, unless the session has been idle `ttl_s` (read-only)."""
        if key is None:
            return None
        entry = self._entries.get(key)
        if entry is None or now - entry.seen >= self.ttl_s:
            return None
        return entry.replica

    def remember(self, key: str, replica: ReplicaName, now: float) -> None:
        """`key`'s request went to `replica` at `now`."""
        entries = self._entries
        entry = entries.get(key)
        if entry is None:
            entries[key] = _Entry(replica, now)
            self._expire(now)
            while len(entries) > self.max_sessions:
                entries.popitem(last=False)
                self.evicted += 1
        else:
            entry.replica, entry.seen = replica, now
            entries.move_to_end(key)

    def _expire(self, now: float) -> None:
        # The least recently seen come first: stop at the first one still fresh (amortised O(1) per insert).
        entries = self._entries
        while entries:
            oldest = next(iter(entries.values()))
            if now - oldest.seen < self.ttl_s:
                break
            entries.popitem(last=False)

    def count(self, *, hinted: bool, changed: bool) -> None:
        """A committed decision: whether it had a hint, and whether the hint changed it."""
        self.hinted_decisions += hinted
        self.changed_decisions += changed

    def forget(self, replica: ReplicaName) -> None:
        """`replica` left the fleet or lost its cache: its sessions are free to go anywhere."""
        for key in [key for key, entry in self._entries.items() if entry.replica == replica]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["SESSION_MODES", "SessionMode", "SessionTable"]
