"""Disaggregated prefill/decode: whether a request is split, which replica prefills it and which one decodes it.

A fleet whose replicas.yaml gives some replicas `role: prefill` runs its long prompts in two legs, as vLLM's own
disaggregated proxy does: the prefill leg (the prompt with `max_tokens` 1 and `kv_transfer_params` asking for a
remote decode) on a prefill worker, then the decode leg (the request as the client sent it, carrying the
`kv_transfer_params` the prefill worker answered) on a decode worker, which pulls the prompt's KV instead of
computing it and streams the answer. Replicas of role `both` (the default) serve whole requests; `decode` ones take
decode legs and, under conditional disaggregation, requests whole.

`PdPlanner.plan` is pure (so `/debug/route` can show a plan without acting on it) and shared by the live proxy and
the replay:

* Which replica would serve the request whole: the fleet's policy (kv_aware) over the decode-capable replicas
  (`decode` and `both`), exactly as an aggregated fleet routes.
* `conditional` (the default): when that replica's uncached part of the prompt is at most
  `max_local_prefill_tokens` — a short prompt, or one mostly cached there (a follow-up turn finds the previous
  turn's prompt and answer on the decode worker that produced them) — the request runs there whole. The default
  threshold is derived, not tuned: the engine's pass budget (`kv_batch_tokens`), so a local prefill holds that
  replica's decode batch back for at most one pass; beyond it the split costs less than the stalls.
* Split: the prefill worker is chosen KV-aware (its prefix cache is what saves work): the fleet's policy over the
  `prefill` replicas. The decode worker is chosen on load (`DecodeRanker`): KV it can still give (a replica whose
  cache is nearly full preempts), then requests in flight per unit of weight; its prefix cache barely matters,
  since the prompt's KV arrives with the request.
* `always`: every request is split while a prefill worker is routable; `off`: never (prefill workers then serve
  whole requests too). No routable prefill worker, or no tokenizer (length unknown) under `conditional`: the
  request is split if a prefill worker is routable, else served whole.

The decode leg is committed with the `DecodeRanker` as its policy (kv_aware's calibration never hears a decode
leg's TTFT, which holds no prefill) and with no prompt tokens to compute; the prefill leg with the fleet's policy,
and without becoming the session's replica (the decode worker holds the conversation afterwards).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvrouter.policies.base import Candidate, CandidateScore, Decision, RouteRequest
from kvrouter.routing.adapters import serving
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.typedefs import DisaggMode

PlanReason = Literal["aggregated", "short", "split", "no_prefill_worker", "no_decode_worker", "off"]
"""Why a plan is what it is: the fleet has no prefill workers (`aggregated`), the uncached prefill is short enough
to run locally (`short`), it was split (`split`), no prefill worker is routable (`no_prefill_worker`: served whole
on a decode-capable replica), no decode-capable one is (`no_decode_worker`: a prefill worker serves it whole) or the
mode is `off`."""

KV_NEARLY_FULL = 0.9
"""A decode worker whose KV cache is this full is passed over while one with more room is routable: it would
preempt running requests to admit the new one."""


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    mode: DisaggMode = "conditional"
    max_local_prefill_tokens: int = 8192


@dataclass(frozen=True, slots=True)
class PdPlan:
    decode: Decision
    """Where the answer comes from: the decode leg of a split request, or the whole request."""
    prefill: Decision | None
    """The prefill leg; None: the request is not split."""
    reason: PlanReason
    local_uncached: int | None = None
    """Prompt tokens the best decode-capable replica would compute itself (None: the prompt length is unknown)."""

    @property
    def split(self) -> bool:
        return self.prefill is not None


class DecodeRanker:
    """The decode leg's policy: the replica with KV room first, then the fewest requests in flight per unit of
    weight, then the lightest KV use; ties rotate. It learns nothing from outcomes."""

    name = "decode_load"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        count = len(candidates)
        assert count, "select needs at least one candidate"
        scores = []
        ranked = []
        for position, candidate in enumerate(candidates):
            load = candidate.load
            usage = load.kv_usage if load.kv_usage is not None else 0.0
            full = 1.0 if usage >= KV_NEARLY_FULL else 0.0
            per_weight = load.in_flight / candidate.weight
            breakdown = {
                "kv_nearly_full": full,
                "in_flight": float(load.in_flight),
                "kv_usage": usage,
                "weight": candidate.weight,
            }
            score = full * 1e6 + per_weight
            scores.append(CandidateScore(candidate.replica, candidate.cached_tokens, score, breakdown))
            ranked.append((full, per_weight, usage, (position - self._turn) % count, candidate.replica))
        return Decision(min(ranked)[4], tuple(scores))

    def record(self, decision: Decision) -> None:
        self._turn += 1

    def first_token(self, decision: Decision, ttft_s: float, prompt_tokens: int) -> None:
        pass  # a decode leg's first token says nothing about prefill speed


def is_disaggregated(routes: Sequence[Route]) -> bool:
    """Whether any of `routes` is a prefill worker (only then are requests ever split)."""
    return any(route.role == "prefill" for route in routes)


class PdPlanner:
    def __init__(self, router: Router, settings: DisaggSettings, *, disaggregated: bool = True) -> None:
        self.router = router
        self.settings = settings
        self.disaggregated = disaggregated
        """Whether the fleet has prefill workers at all (set again when the fleet is reloaded)."""
        self.ranker = DecodeRanker()

    def plan(self, facts: RoutingFacts, routes: Sequence[Route]) -> PdPlan:
        """The plan for a request among `routes` (the routable replicas, non-empty). No side effects."""
        router = self.router
        routes = serving(routes, facts.lora) or list(routes)  # (none serving: decide says so)
        if not self.disaggregated:
            return PdPlan(router.decide(facts, routes), None, "aggregated")
        prefill = [route for route in routes if route.role == "prefill"]
        mode = self.settings.mode
        if mode == "off":
            return PdPlan(router.decide(facts, routes), None, "off")
        decode_capable = [route for route in routes if route.role != "prefill"]
        if not decode_capable:
            # Every decode-capable replica is down: a prefill worker serves the request whole (vLLM's prefill
            # instances answer plain requests), rather than failing it.
            return PdPlan(router.decide(facts, routes), None, "no_decode_worker")
        whole = router.decide(facts, decode_capable)
        local = self._local_uncached(facts, whole)
        if not prefill:
            return PdPlan(whole, None, "no_prefill_worker", local)
        if mode == "conditional" and local is not None and local <= self.settings.max_local_prefill_tokens:
            return PdPlan(whole, None, "short", local)
        request = RouteRequest(prompt_tokens=facts.prompt_tokens, max_tokens=facts.max_tokens)
        decode = self.ranker.select(request, router.candidates(facts, decode_capable))
        return PdPlan(decode, router.decide(facts, prefill), "split", local)

    def _local_uncached(self, facts: RoutingFacts, whole: Decision) -> int | None:
        prompt = facts.prompt_tokens
        if prompt is None:
            return None
        chosen = whole.score_of(whole.chosen)
        return max(0, prompt - (chosen.cached_tokens if chosen is not None else 0))

    def commit_prefill(self, plan: PdPlan, facts: RoutingFacts, route: Route, *, arrival: float | None) -> Routed:
        """The prefill leg of a split `plan`, on `route` (its chosen prefill worker)."""
        assert plan.prefill is not None, "only a split plan has a prefill leg"
        return self.router.commit(plan.prefill, facts, route, arrival=arrival, session=False)

    def commit_decode(self, plan: PdPlan, facts: RoutingFacts, route: Route, *, arrival: float | None) -> Routed:
        """The answer's leg on `route`: a split plan's decode leg (its KV arrives, nothing to compute), or the
        whole request."""
        if plan.prefill is None:
            return self.router.commit(plan.decode, facts, route, arrival=arrival)
        return self.router.commit(plan.decode, facts, route, arrival=arrival, policy=self.ranker, computes=0)


__all__ = ["KV_NEARLY_FULL", "DecodeRanker", "DisaggSettings", "PdPlan", "PdPlanner", "PlanReason", "is_disaggregated"]
