"""Redis key names and stream ids for the event plane.

Every key of one replica carries the hash tag ``{<replica>}``, so all of them live in one hash slot: the atomic
updates (a Lua script per append, per snapshot, per epoch change) stay inside one slot on a single Redis, under
Sentinel and on Redis Cluster alike, and a Cluster spreads replicas over its shards.

Per replica (prefix ``kvrouter`` by default):

* ``kvrouter:{r}:events`` — a Stream of normalised event entries. Ids are explicit: ``<epoch>-<n>``, where
  ``epoch`` goes up whenever the replica's state restarts (engine restart, Redis lost data) and ``n`` counts
  entries within the epoch from 0. A follower therefore knows from an id alone whether it missed anything.
* ``kvrouter:{r}:snapshot`` — the replica's whole state at one stream id (see `entries.Snapshot`).
* ``kvrouter:{r}:meta`` — a Hash: ``epoch``, ``n`` (last entry), ``engine_seq`` (last vLLM sequence number
  written, where a restarted relay resumes), ``snapshot_id``, ``hash_seed``, ``updated_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrouter.typedefs import ReplicaName

DEFAULT_PREFIX = "kvrouter"
MAX_EPOCH = 1 << 53
"""Epochs are wall-clock milliseconds (~1.8e12 today); a larger one in Redis is garbage, never followed or built on
(a follower positioned there would never see the relay's real entries again)."""


@dataclass(frozen=True, slots=True)
class ReplicaKeys:
    replica: ReplicaName
    stream: str
    snapshot: str
    meta: str


def replica_keys(replica: ReplicaName, prefix: str = DEFAULT_PREFIX) -> ReplicaKeys:
    if "{" in replica or "}" in replica:
        raise ValueError(f"replica name {replica!r} must not contain braces (they are Redis hash tags)")
    tag = f"{prefix}:{{{replica}}}"
    return ReplicaKeys(replica, f"{tag}:events", f"{tag}:snapshot", f"{tag}:meta")


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """A point in one replica's history: entry `n` of `epoch` (the stream id ``<epoch>-<n>``)."""

    epoch: int
    n: int

    @property
    def stream_id(self) -> str:
        return f"{self.epoch}-{self.n}"

    @classmethod
    def parse(cls, stream_id: str | bytes) -> Position:
        text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
        epoch, _, n = text.partition("-")
        return cls(int(epoch), int(n))

    def follows(self, previous: Position) -> bool:
        """Whether this entry comes right after `previous` with nothing missed in between."""
        return self.epoch == previous.epoch and self.n == previous.n + 1
