"""What a replayed engine's /metrics would show of its prefills, for kv_aware's engine source (`--engine-metrics`).

vLLM observes per request, when it finishes, the time from its first scheduling to its first token
(`vllm:request_prefill_time_seconds`) and the prompt tokens it computed (`vllm:request_prefill_kv_computed_tokens`);
the router reads their cumulative sums and counts (`kvrouter.routing.engine_rates`). `PrefillTotals` keeps the same
totals per replayed engine: a request is scheduled at the start of the pass that first admits it (the pass that
reports its cached tokens), its prefill ends with the pass that gives its first token, and it enters the totals
when it finishes. Warm-ups and the prefill legs of a disaggregated fleet are not counted (the totals cover the
trace's own requests). Pure; the replay passes the virtual clock's readings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrouter.routing.engine_rates import EngineTotals
from kvrouter.typedefs import ReplicaName


@dataclass(slots=True)
class PrefillTotals:
    _admitted: dict[str, tuple[ReplicaName, float, int]] = field(default_factory=dict)
    """Request id -> (engine, time scheduled, prompt tokens it computes)."""
    _prefilled: dict[str, tuple[ReplicaName, float, int]] = field(default_factory=dict)
    """Request id -> (engine, prefill seconds, prompt tokens computed), until it finishes."""
    _totals: dict[ReplicaName, tuple[float, int, int]] = field(default_factory=dict)

    def admitted(self, engine: ReplicaName, request_id: str, now: float, computed_tokens: int) -> None:
        """The pass starting `now` admits the request (a preempted request's later admissions change nothing)."""
        self._admitted.setdefault(request_id, (engine, now, max(0, computed_tokens)))

    def first_token(self, request_id: str, now: float) -> None:
        admitted = self._admitted.pop(request_id, None)
        if admitted is not None:
            engine, scheduled, tokens = admitted
            self._prefilled[request_id] = (engine, now - scheduled, tokens)

    def finished(self, request_id: str) -> None:
        """The request is done: vLLM observes its prefill histograms now."""
        self._admitted.pop(request_id, None)
        prefilled = self._prefilled.pop(request_id, None)
        if prefilled is None:
            return
        engine, prefill_s, tokens = prefilled
        seconds, requests, computed = self._totals.get(engine, (0.0, 0, 0))
        self._totals[engine] = (seconds + prefill_s, requests + 1, computed + tokens)

    def totals(self, engine: ReplicaName) -> EngineTotals:
        seconds, requests, computed = self._totals.get(engine, (0.0, 0, 0))
        return EngineTotals(seconds, float(requests), float(computed))


__all__ = ["PrefillTotals"]
