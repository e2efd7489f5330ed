"""The one small interface every routing policy implements.

A policy is a pure scorer: it receives the request's routing facts (`RouteRequest`) and one `Candidate` per
healthy, routable replica (how many prompt tokens kvrouter believes are cached there and the replica's load), and
returns a `Decision` with a per-candidate breakdown. `select` never changes state, so `/debug/route` can call it
as a dry run; state a policy keeps (the round-robin cursor) moves only in `record`, which the router calls once
the decision is acted on, and `first_token` tells it a request's measured time to first token (the lifecycle,
`kvrouter.routing.lifecycle.Routed`, calls it live and in replay alike). The index lookup and load accounting happen
outside, in the same objects for the live router and for virtual-time replay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrouter.typedefs import ReplicaName


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What is known of a replica's load at decision time.

    The router's own accounting is always present; the engine's view (scraped from vLLM /metrics, summed over
    its `engine` series) is None until the first successful scrape.
    """

    in_flight: int = 0
    """Requests the router has sent there and not yet finished."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens of routed requests that have not produced a first token yet."""
    decode_requests: int = 0
    """Routed requests past their first token and still generating."""
    engine_waiting: int | None = None
    engine_running: int | None = None
    kv_usage: float | None = None
    """Fraction of the engine's KV cache in use, 0..1."""
    peer_pending_prefill_tokens: int = 0
    """The part of `pending_prefill_tokens` other router instances reported (shared load); 0 without sharing."""
    placeholder_prefill_tokens: int = 0
    """The part of `pending_prefill_tokens` that stands for peers' decisions not heard yet (placeholders of
    `kvrouter.routing.herding`, also counted in `peer_pending_prefill_tokens`): guesses, no request behind them."""


@dataclass(frozen=True, slots=True)
class Candidate:
    replica: ReplicaName
    cached_tokens: int
    """Prompt tokens kvrouter believes the engine will serve from cache (engine rule applied)."""
    load: ReplicaLoad
    weight: float = 1.0
    cpu_tokens: int = 0
    """The part of `cached_tokens` the engine loads from CPU memory (an offload tier), not from GPU."""
    storage_tokens: int = 0
    """The part it loads from storage (disk, remote store)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_tokens: int | None
    """Exact prompt length in tokens, or None when no tokenizer is configured."""
    max_tokens: int | None = None
    session_replica: ReplicaName | None = None
    """The replica that served this request's session last, as a soft hint (`kvrouter.routing.sessions`): a
    policy that weighs costs may prefer it where costs are close; one that does not ignores it."""


@dataclass(frozen=True, slots=True)
class CandidateScore:
    replica: ReplicaName
    cached_tokens: int
    score: float
    """Lower is better."""
    breakdown: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: ReplicaName
    candidates: tuple[CandidateScore, ...]
    without_hint: ReplicaName | None = None
    """What the policy alone would have chosen, when a session hint changed the choice (None: it did not)."""

    def score_of(self, replica: ReplicaName) -> CandidateScore | None:
        for candidate in self.candidates:
            if candidate.replica == replica:
                return candidate
        return None


class Policy(Protocol):
    name: str

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of `candidates` (never empty). Must not change any state."""
        ...

    def record(self, decision: Decision) -> None:
        """The decision was acted upon; move whatever state the policy keeps."""
        ...

    def first_token(self, decision: Decision, ttft_s: float, prompt_tokens: int) -> None:
        """A request routed by `decision` got its first token `ttft_s` after it arrived (the router measured it).
        A policy that learns from outcomes (kv_aware with `kv_tune`) does so here; the others ignore it."""
        ...
