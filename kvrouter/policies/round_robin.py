"""Round-robin: spread requests evenly, ignoring caches and load — the baseline KV-aware routing is measured
against.

Smooth weighted round-robin (the nginx algorithm): every replica's running credit grows by its weight on each
pick, the replica with the most credit wins and pays back the total weight. With equal weights this is plain
alternation; a replica with `weight: 2` gets every other request among three equal-sized slots, evenly
interleaved rather than in bursts. `select` computes the pick from the credits without touching them (dry-run
safe); `record` applies it. Credits are kept per replica name, so a replica leaving and rejoining the candidate
list (breaker, drain) does not disturb the others. Knobs: the replicas' `weight` only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrouter.policies.base import Candidate, CandidateScore, Decision, RouteRequest
from kvrouter.typedefs import ReplicaName


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._credit: dict[ReplicaName, float] = {}

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        scores = []
        best: CandidateScore | None = None
        for candidate in candidates:
            credit = self._credit.get(candidate.replica, 0.0) + candidate.weight
            score = CandidateScore(
                candidate.replica,
                candidate.cached_tokens,
                -credit,
                {"credit": credit, "weight": candidate.weight, "in_flight": float(candidate.load.in_flight)},
            )
            scores.append(score)
            if best is None or score.score < best.score:
                best = score
        assert best is not None, "select needs at least one candidate"
        return Decision(best.replica, tuple(scores))

    def record(self, decision: Decision) -> None:
        total = 0.0
        for score in decision.candidates:
            weight = score.breakdown.get("weight", 1.0)
            self._credit[score.replica] = self._credit.get(score.replica, 0.0) + weight
            total += weight
        self._credit[decision.chosen] = self._credit.get(decision.chosen, 0.0) - total

    def first_token(self, decision: Decision, ttft_s: float, prompt_tokens: int) -> None:
        pass  # nothing to learn from outcomes
