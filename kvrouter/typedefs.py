"""Small shared types.

Two kinds of block hash exist and must never be confused: the engine's own hash (`EngineBlockHash`, whatever
vLLM computed with its seed and algorithm, only ever used as an opaque handle to map events back) and kvrouter's
own key (`BlockKey`, chained xxh3_64 over the token ids, computed identically for requests and for events).
"""

from __future__ import annotations

import enum
from typing import Literal, NewType

BlockKey = NewType("BlockKey", int)
"""kvrouter's chained prefix key for one full block of tokens (xxh3_64, unsigned 64-bit)."""

EngineBlockHash = NewType("EngineBlockHash", int)
"""The engine's block hash as published in KV events (uint64; bytes hashes are folded to int at decode)."""

ReplicaName = NewType("ReplicaName", str)

SessionMode = Literal["off", "soft", "sticky"]

ReplicaRole = Literal["both", "prefill", "decode"]
"""What a replica does in a disaggregated fleet (`kvrouter.routing.disagg`): whole requests, prefill legs only, or
decode legs (and, under conditional disaggregation, short requests whole)."""

DisaggMode = Literal["conditional", "always", "off"]
"""When a fleet with prefill workers splits a request into a prefill leg and a decode leg."""
"""How a session's last replica weighs on its next request (`kvrouter.routing.sessions`)."""


class Tier(enum.IntEnum):
    """Where a cached block lives on a replica; lower is faster to reuse."""

    GPU = 0
    CPU = 1
    STORAGE = 2

    @classmethod
    def from_medium(cls, medium: str | None) -> Tier:
        if medium is None:
            return cls.GPU
        upper = medium.upper()
        if upper in ("CPU", "CPU_TIER"):
            return cls.CPU
        if upper in ("DISK", "STORAGE", "SSD", "LOCAL_DISK"):
            return cls.STORAGE
        return cls.GPU
