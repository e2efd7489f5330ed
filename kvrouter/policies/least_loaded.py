"""Least-loaded: send each request to the replica with the fewest requests in flight, relative to its weight.

The score is `in_flight / weight`, where `in_flight` is what this router has sent and not yet seen finish (the
`LoadBook` count, exact and immediate). Ties — an idle fleet, most of the time at low load — rotate through the
tied replicas instead of always landing on the first one, so an idle fleet still shares work (the rotation is
a turn counter that only `record` advances; `select` is dry-run safe). When the engines' own gauges have been
scraped, waiting requests break the remaining ties: another router instance's traffic shows there.
Knobs: the replicas' `weight` only. Caches are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrouter.policies.base import Candidate, CandidateScore, Decision, RouteRequest


class LeastLoadedPolicy:
    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        count = len(candidates)
        scores = []
        ranked = []
        for position, candidate in enumerate(candidates):
            load = candidate.load
            score = load.in_flight / candidate.weight
            waiting = float(load.engine_waiting) if load.engine_waiting is not None else 0.0
            breakdown = {"in_flight": float(load.in_flight), "weight": candidate.weight, "engine_waiting": waiting}
            scores.append(CandidateScore(candidate.replica, candidate.cached_tokens, score, breakdown))
            ranked.append((score, waiting, (position - self._turn) % count, candidate.replica))
        assert ranked, "select needs at least one candidate"
        return Decision(min(ranked)[3], tuple(scores))

    def record(self, decision: Decision) -> None:
        self._turn += 1

    def first_token(self, decision: Decision, ttft_s: float, prompt_tokens: int) -> None:
        pass  # nothing to learn from outcomes
