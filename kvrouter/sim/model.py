"""The contract between an engine model and whatever drives it (the `kvrouter sim` server or trace replay).

An engine model is pure and clock-free: the driver adds requests and calls `step(now)`, which runs one
scheduler pass starting at `now` and returns its duration plus what happened in it; the driver advances its clock
(real or virtual) by that duration and delivers the results. Two implementations exist: the vLLM-v1-like engine
(`sim/engine.py`) and the Dynamo 1.6.1 mocker reproduction (`sim/mocker.py`).

Block identities are the engine's own: the driver supplies `block_hashes` (one per full prompt block, chained,
computed by `sim.hashing`) so a trace replay can skip materialising tokens; `token_ids` is present when the
request came with real tokens (the server) and is what BlockStored events carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

SchedulingPolicy = Literal["fcfs", "priority"]
"""vLLM's `--scheduling-policy` values the engine models implement (`kvrouter.sim.waiting`)."""
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_len: int
    block_hashes: Sequence[int]
    """Engine block hash of every full prompt block, prefix-chained."""
    max_tokens: int
    arrival: float
    token_ids: Sequence[int] | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    """The LoRA adapter serving the request (vLLM keys every block of it by the adapter name)."""
    lora_id: int | None = None
    output_token_ids: Sequence[int] | None = None
    """The tokens the request will generate, when the driver chose them (the server does); blocks filled during
    decode are hashed over them and BlockStored carries them. Without them such blocks get synthetic hashes."""
    kv_transferred: bool = False
    """The prompt's KV arrives from a prefill worker (a disaggregated decode leg; the driver charges the transfer
    before adding it): the engine admits it with every prompt token but the last counted as computed — its local
    prefix hits first, the rest as transferred — and caches the prompt's full blocks at once (vLLM's decode
    instance caches the blocks it pulled); its first pass computes the last prompt token and emits the first output
    token (vLLM recomputes that token on the decode side). Blocks for the whole prompt must be free, as for any
    admission. A preempted request has lost its transfer and recomputes its prompt."""
    priority: int = 0
    """vLLM's request `priority` (lower is served first, 0 the default); read only by an engine scheduling with
    the `priority` policy (`kvrouter.sim.waiting`)."""


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...] | None
    block_size: int
    cache_salt: str | None = None
    """Set when these blocks start at the prompt's first block and the request had a salt (vLLM puts it in that
    block's `extra_keys`)."""
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    pass


KvEvent = StoredBlocks | RemovedBlocks | CacheCleared


@dataclass(slots=True)
class StepResult:
    duration: float
    """Seconds the pass takes; its outputs become visible at `now + duration`."""
    first_tokens: list[str] = field(default_factory=list)
    """Requests whose prompt completed in this pass (they emit their first token at its end)."""
    tokens: list[str] = field(default_factory=list)
    """Requests that emitted one output token at the end of this pass (first tokens included)."""
    finished: list[str] = field(default_factory=list)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    """Prompt tokens served from cache, per request, as vLLM reports them (set when the request is admitted)."""
    events: list[KvEvent] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineGaugesSnapshot:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries: int
    """Cumulative prompt tokens queried against the prefix cache."""
    prefix_hits: int
    """Cumulative prompt tokens found in the prefix cache."""


class EngineModel(Protocol):
    block_size: int
    max_num_seqs: int
    """Requests the engine runs at once (vLLM's --max-num-seqs); more wait in its queue."""

    def add(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self, now: float) -> StepResult: ...

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use; False when blocks are in use (vLLM refuses then)."""
        ...

    def gauges(self) -> EngineGaugesSnapshot: ...
