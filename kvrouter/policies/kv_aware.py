"""KV-aware routing: send each request where its first token is expected soonest, counting what is cached there.

Algorithm. For every candidate replica the policy estimates this request's time to first token, in seconds:

    queue_tokens = pending prefill tokens already routed there (+ unseen waiting requests, see below)
    uncached     = prompt tokens - cached tokens there (0 credit when the replica is a hot spot)
    prefill_s    = (queue_tokens + uncached) / (prefill_tokens_per_s * weight)
    passes       = max(1, (queue_tokens + uncached) / batch_tokens)
    decode_s     = passes * (decode_pass_s + decode_s_per_request * decoding requests there)
    ttft_s       = prefill_s + decode_s                                       (the estimate)
    affinity_s   = (cache_weight - 1) * cached tokens credited / (prefill_tokens_per_s * weight)
    score        = ttft_s - affinity_s

and picks the lowest score; exact ties go to the replica with fewer requests in flight (per unit of weight),
then rotate. The engines run prefills first-come-first-served in passes of at most `batch_tokens` prompt tokens,
and every pass also carries the replica's decoding requests, so a busy decoder stretches each pass of the
queue ahead: that is the decode term. Cached tokens follow the engine's rule (whole blocks, at most
prompt - 1), as the router computed them from the prefix index. The affinity term values a cached token above
the prefill time it saves now: keeping a conversation where its cache is saves the work again on its next turn
and keeps one copy of a prefix in the fleet instead of several, so more of the fleet's memory holds distinct
prefixes. On the Mooncake conversation trace a weight of 4 instead of 1 raises the fleet's hit rate from ~15.7%
to ~17.7% of prompt tokens (a pooled 4M-token cache would reach 18.5%) and cuts TTFT p99 by 3% at x2.5 and 11%
at x3.0 (docs/benchmarks.md).

Prefill progress. The load book counts a request's prefill tokens as pending until its first token, so a replica
half-way through a 100k-token prompt would look as busy as one about to start it. The policy therefore keeps,
per replica, the requests it sent there in order and watches the pending count fall at each decision (the
engines prefill first-come-first-served): the oldest request still pending is the one in progress, and the part
of it computed since it started — elapsed time x the replica's effective prefill rate, never all of it — is
taken off the queue. Without such history (another router's traffic, a restart) the queue counts in full.

Hot-spot guard, per replica: a replica whose requests in flight exceed `hotspot_ratio` x the fleet's mean
(per unit of weight) plus `hotspot_slack` loses its cache credit for this request, so a popular prefix cannot pile
every request onto one replica; other replicas keep their credit and other requests still follow their prefixes.

`select` is pure (it reads the candidates, the clock and the policy's history); `record` advances the tie-break
rotation and the per-replica history. The clock is a parameter (the router's: monotonic live, virtual in replay).

Knobs (`Settings` fields, `KVROUTER_KV_*`), defaults in brackets:
- `kv_prefill_tokens_per_s` [48000]: a replica's prefill throughput, prompt tokens per second.
- `kv_batch_tokens` [8192]: prompt tokens one engine pass computes (vLLM's max_num_batched_tokens).
- `kv_decode_pass_s` [0.012]: fixed cost a pass pays when the replica is decoding anything.
- `kv_decode_s_per_request` [0.001]: extra pass time per decoding request there.
- `kv_cache_weight` [4.0]: how much a cached token is worth in prefill time saved (1 = exactly its time now).
- `kv_waiting_request_tokens` [0]: prompt tokens assumed for each request the engine reports waiting beyond the
  ones this router is prefilling there (other routers' traffic; 0 = trust this router's own accounting).
- `kv_hotspot_ratio` [2.0] and `kv_hotspot_slack` [8]: the hot-spot load cap described above.
- `kv_tune` [off]: tune `cache_weight` online against measured TTFT (`kvrouter/routing/tuning.py`: 10% of decisions
  probe the weight x1.25 and x0.75); each request's TTFT, as the router measured it, comes back through
  `first_token` (from `kvrouter.routing.lifecycle.Routed`, live and in replay alike). Off by default: on the
  Mooncake trace it did not beat the fixed weight (docs/benchmarks.md, "Beyond kv_aware").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrouter.policies.base import Candidate, CandidateScore, Decision, RouteRequest
from kvrouter.routing.tuning import WeightTuner
from kvrouter.typedefs import ReplicaName


@dataclass(frozen=True, slots=True)
class KvAwareConfig:
    prefill_tokens_per_s: float = 48_000.0
    batch_tokens: int = 8192
    decode_pass_s: float = 0.012
    decode_s_per_request: float = 0.001
    waiting_request_tokens: int = 0
    cache_weight: float = 4.0
    hotspot_ratio: float = 2.0
    hotspot_slack: float = 8.0
    tune: bool = False

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.batch_tokens <= 0:
            raise ValueError("prefill_tokens_per_s and batch_tokens must be positive")
        if min(self.decode_pass_s, self.decode_s_per_request, self.waiting_request_tokens, self.cache_weight) < 0:
            raise ValueError("decode costs and waiting_request_tokens must not be negative")
        if self.hotspot_ratio <= 0 or self.hotspot_slack < 0:
            raise ValueError("hotspot_ratio must be positive and hotspot_slack not negative")


@dataclass(slots=True)
class _Lane:
    """What this policy sent to one replica and has not yet seen reach its first token, oldest first."""

    sent: deque[tuple[float, int]] = field(default_factory=deque)
    """(time sent, prefill tokens) per request."""
    total: int = 0
    head_since: float = 0.0
    """Earliest time the oldest pending request can have started its prefill."""
    observed: float = 0.0

    def observe(self, pending: int, now: float) -> None:
        """The load book says `pending` tokens are left: requests at the front beyond that are done."""
        sent = self.sent
        popped = False
        while sent and self.total - sent[0][1] >= pending:
            self.total -= sent.popleft()[1]
            popped = True
        if popped:
            # The next one started when its predecessor finished: between the last look and now.
            self.head_since = (self.observed + now) / 2
        self.observed = now

    def in_progress(self, pending: int, now: float, rate: float) -> float:
        """Tokens of the oldest request still pending computed by now (an estimate; read-only)."""
        total = self.total
        head_since = self.head_since
        for sent_at, tokens in self.sent:
            if total - tokens < pending:
                started = max(sent_at, head_since)
                return min(max(0.0, now - started) * rate, tokens * 0.95)
            total -= tokens
            head_since = (self.observed + now) / 2
        return 0.0


class KvAwarePolicy:
    name = "kv_aware"

    def __init__(self, config: KvAwareConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or KvAwareConfig()
        self.clock = clock
        self._turn = 0
        self._lanes: dict[ReplicaName, _Lane] = {}
        self.tuner = WeightTuner(self.config.cache_weight) if self.config.tune else None

    @classmethod
    def from_settings(cls, settings: Any, *, clock: Callable[[], float] = time.monotonic) -> KvAwarePolicy:
        """Build from `Settings` (its `kv_*` fields; any that are absent keep their defaults)."""
        defaults = KvAwareConfig()
        values = {
            name: getattr(settings, f"kv_{name}", getattr(defaults, name))
            for name in KvAwareConfig.__dataclass_fields__
        }
        return cls(KvAwareConfig(**values), clock=clock)

    def _cap(self, candidates: Sequence[Candidate]) -> float:
        mean = sum(c.load.in_flight / c.weight for c in candidates) / len(candidates)
        return self.config.hotspot_ratio * mean + self.config.hotspot_slack

    def score(
        self, request: RouteRequest, candidate: Candidate, cap: float, now: float, weight: float | None = None
    ) -> CandidateScore:
        config = self.config
        cache_weight = config.cache_weight if weight is None else weight
        load = candidate.load
        prompt = request.prompt_tokens or 0
        relative_load = load.in_flight / candidate.weight
        hot = relative_load > cap
        credit = 0 if hot else min(candidate.cached_tokens, prompt)
        uncached = prompt - credit
        busy = load.decode_requests > 0
        pass_s = config.decode_pass_s + config.decode_s_per_request * load.decode_requests if busy else 0.0
        lane = self._lanes.get(candidate.replica)
        done = 0.0
        # The lane follows this router's own requests: other instances' pending prefill (shared load) is queue.
        own_pending = load.pending_prefill_tokens - load.peer_pending_prefill_tokens
        if lane is not None and own_pending > 0:
            rate = config.batch_tokens / (config.batch_tokens / config.prefill_tokens_per_s + pass_s)
            done = min(lane.in_progress(own_pending, now, rate * candidate.weight), float(own_pending))
        queue = load.pending_prefill_tokens - done
        if config.waiting_request_tokens and load.engine_waiting is not None:
            prefilling_here = load.in_flight - load.decode_requests
            queue += max(0, load.engine_waiting - prefilling_here) * config.waiting_request_tokens
        work = queue + uncached
        prefill_s = work / (config.prefill_tokens_per_s * candidate.weight)
        passes = max(1.0, work / config.batch_tokens)
        decode_s = passes * pass_s
        ttft_s = prefill_s + decode_s
        affinity_s = (cache_weight - 1.0) * credit / (config.prefill_tokens_per_s * candidate.weight)
        score = ttft_s - affinity_s
        breakdown = {
            "cached_tokens": float(candidate.cached_tokens),
            "cache_credit_tokens": float(credit),
            "uncached_tokens": float(uncached),
            "pending_prefill_tokens": float(load.pending_prefill_tokens),
            "peer_pending_prefill_tokens": float(load.peer_pending_prefill_tokens),
            "prefill_in_progress_tokens": done,
            "queued_prefill_tokens": float(queue),
            "prefill_s": prefill_s,
            "passes": passes,
            "decode_pass_s": pass_s,
            "decode_s": decode_s,
            "ttft_estimate_s": ttft_s,
            "affinity_s": affinity_s,
            "in_flight": float(load.in_flight),
            "decode_requests": float(load.decode_requests),
            "load_cap": cap,
            "hot_spot": 1.0 if hot else 0.0,
            "weight": candidate.weight,
            "prompt_tokens": float(prompt),
            "cache_weight": cache_weight,
        }
        return CandidateScore(candidate.replica, candidate.cached_tokens, score, breakdown)

    def select(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        assert candidates, "select needs at least one candidate"
        cap = self._cap(candidates)
        now = self.clock()
        count = len(candidates)
        weight = None if self.tuner is None else self.tuner.weight_for(self._turn)
        scores = []
        ranked = []
        for position, candidate in enumerate(candidates):
            scored = self.score(request, candidate, cap, now, weight)
            scores.append(scored)
            relative_load = candidate.load.in_flight / candidate.weight
            ranked.append((scored.score, relative_load, (position - self._turn) % count, candidate.replica))
        return Decision(min(ranked)[3], tuple(scores))

    def observe_ttft(self, used_weight: float, ttft_s: float, prompt_tokens: int) -> None:
        """A request this policy routed with cache weight `used_weight` (its breakdown's) got its first token."""
        if self.tuner is not None:
            self.tuner.observe(used_weight, ttft_s, prompt_tokens)

    def first_token(self, decision: Decision, ttft_s: float, prompt_tokens: int) -> None:
        chosen = decision.score_of(decision.chosen)
        if chosen is not None and "cache_weight" in chosen.breakdown:
            self.observe_ttft(chosen.breakdown["cache_weight"], ttft_s, prompt_tokens)

    def record(self, decision: Decision) -> None:
        self._turn += 1
        now = self.clock()
        for scored in decision.candidates:
            lane = self._lanes.get(scored.replica)
            if lane is None:
                lane = self._lanes[scored.replica] = _Lane(head_since=now, observed=now)
            breakdown = scored.breakdown
            pending = breakdown.get("pending_prefill_tokens", 0.0) - breakdown.get("peer_pending_prefill_tokens", 0.0)
            lane.observe(int(pending), now)
            if scored.replica == decision.chosen:
                # What the load book counts for it: the prompt minus what is cached there.
                tokens = int(scored.breakdown.get("prompt_tokens", 0.0)) - scored.cached_tokens
                if tokens > 0:
                    lane.sent.append((now, tokens))
                    lane.total += tokens
