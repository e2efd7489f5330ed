"""What happens to a request after the policy decides, written once for the live proxy and the replay.

`Router.commit` returns a `Routed` handle; the caller (the proxy, the replay driver) reports only what it saw:

- `first_token(now)`: the engine produced the request's first token. The load book moves its prompt from
  pending prefill to decoding, the policy hears the TTFT the router measured (kv_aware's weight tuner learns from
  it, `kv_tune`), and every `RequestListener` is told.
- `served(cached_tokens, now)`: the engine reported how many prompt tokens it served from its prefix cache
  (`usage.prompt_tokens_details.cached_tokens` live, `StepResult.cached_tokens` in replay; None when it did not
  say). Listeners compare it with the router's prediction (the feedback overlay, `kv_feedback`).
- `finish(now)`: the request ended, whatever the reason. Idempotent and safe on every exit path: the load ticket
  is released exactly once; a first token or a report that comes after it is ignored.

The learning overlays are fed through two small protocols, never by looking at their types: a `RequestListener`
hears the four steps above; an `EventListener` hears what the KV-event path applied (blocks stored, blocks
removed, a replica cleared — an engine restart or reset, or a replica gone from the fleet). The event path (the
embedded ZMQ ingest, the Redis follower, the replay's engine events) calls them after the index; the overlays are
built in one place (`kvrouter.routing.overlays.build_overlays`). Pure and synchronous; `now` is the caller's clock.

Non-streaming requests are exact too: vLLM sends such an answer whole at the end, so the proxy fetches it as a
stream and assembles the JSON the replica would have sent (`kvrouter.server.assembly`), and reports `first_token`
at the stream's first chunk. Only requests whose answer a stream cannot reproduce (n > 1, logprobs, tools, ...),
the first one per replica (which teaches the router the replica's answer layout) and all of them with
`assemble_non_streaming` off are reported at the answer's end (`kvrouter replay --whole-answers` shows what that
costs kv_aware).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvrouter.policies.base import Decision, Policy
from kvrouter.routing.load import LoadBook, Ticket
from kvrouter.typedefs import BlockKey, ReplicaName

Leg = Literal["whole", "prefill", "decode"]
"""What a `Routed` carries: a whole request, or one leg of a disaggregated one (`kvrouter.routing.disagg`)."""


class RequestListener(Protocol):
    """Hears each routed request's life: every method at most once per request, `on_finish` last."""

    def on_commit(self, routed: Routed) -> None: ...

    def on_first_token(self, routed: Routed, now: float) -> None: ...

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None: ...

    def on_finish(self, routed: Routed, now: float) -> None: ...


class EventListener(Protocol):
    """Hears what the KV-event path applied to the index, in the router's keys."""

    def on_stored(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None: ...

    def on_removed(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None: ...

    def on_cleared(self, replica: ReplicaName, now: float) -> None:
        """The replica's cache is gone (engine restart or reset, replica removed or unreachable)."""
        ...


def tell_cleared(listeners: Sequence[EventListener], replica: ReplicaName, now: float) -> None:
    for listener in listeners:
        listener.on_cleared(replica, now)


@dataclass(slots=True, eq=False)
class Routed:
    """One request committed to one replica; see the module docstring for the three calls it takes."""

    decision: Decision
    replica: ReplicaName
    block_size: int
    keys: Sequence[BlockKey]
    """The prompt's block keys at the replica's block size (empty without a tokenizer)."""
    prompt_tokens: int
    predicted_cached: int
    """Prompt tokens the router believed cached on the chosen replica."""
    arrival: float
    """When the request arrived (the TTFT the policy hears is measured from here)."""
    ticket: Ticket
    load: LoadBook
    policy: Policy
    listeners: Sequence[RequestListener] = ()
    first_token_at: float | None = None
    cached_tokens: int | None = None
    """What the engine reported serving from cache, once `served` was called with a number."""
    finished_at: float | None = None
    generated_tokens: int | None = None
    """Tokens the engine generated, where its usage report said (set by the caller before `finish`)."""
    leg: Leg = "whole"
    """A decode leg's engine takes the prompt's KV by transfer and reports none of it as cached (vLLM counts only
    its local prefix hits), so `served` ignores its report: it says nothing of the router's prediction."""
    _served: bool = field(default=False, repr=False)

    @property
    def cache_weight(self) -> float | None:
        """The cache weight the decision used (kv_aware's breakdown), if the policy has one."""
        chosen = self.decision.score_of(self.replica)
        return None if chosen is None else chosen.breakdown.get("cache_weight")

    def first_token(self, now: float) -> None:
        if self.first_token_at is not None or self.finished_at is not None:
            return
        self.first_token_at = now
        self.load.first_token(self.ticket)
        self.policy.first_token(self.decision, now - self.arrival, self.prompt_tokens)
        for listener in self.listeners:
            listener.on_first_token(self, now)

    def served(self, cached_tokens: int | None, now: float) -> None:
        if self._served or self.finished_at is not None or self.leg == "decode":
            return
        self._served = True
        if cached_tokens is None:
            return
        self.cached_tokens = cached_tokens
        for listener in self.listeners:
            listener.on_served(self, cached_tokens, now)

    def finish(self, now: float) -> None:
        if self.finished_at is not None:
            return
        self.finished_at = now
        self.load.finish(self.ticket)
        for listener in self.listeners:
            listener.on_finish(self, now)


__all__ = ["EventListener", "Leg", "RequestListener", "Routed", "tell_cleared"]
