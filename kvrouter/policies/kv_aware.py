"""KV-aware routing: send each request where its first token is expected soonest, counting what is cached there.

Algorithm. For every candidate replica the policy estimates this request's time to first token, in seconds, with
that replica's own costs (`ReplicaCosts`: prefill rate R, fixed pass cost p, pass time d per decoding request):

    queue_tokens = pending prefill tokens already routed there (+ unseen waiting requests, see below)
    uncached     = prompt tokens - cached tokens there (0 credit when the replica is a hot spot)
    work         = queue_tokens + uncached
    passes       = max(1, work / batch_tokens)
    short        = max(0, 1 - work / batch_tokens)     (the part of one pass short work leaves empty)
    ttft_s       = work / R + short * p + passes * d * decoding requests there      (the estimate)
    token_s      = 1 / R + d * decoding requests there / batch_tokens               (one more prompt token's cost)
    affinity_s   = (cache_weight - 1) * cached tokens credited * token_s
    session_s    = session_bonus * prompt tokens * token_s     (only on the replica a soft session hint names)
    score        = ttft_s - affinity_s - session_s

and picks the lowest score; exact ties go to the replica with fewer requests in flight (per unit of weight),
then rotate. The engines run prefills first-come-first-served in passes of at most `batch_tokens` prompt tokens,
every pass pays a fixed cost and also carries the replica's decoding requests, so a busy decoder stretches each
pass of the queue ahead. R is the throughput of full passes (their fixed cost included, as a prefill benchmark
measures it), so p (what a short request pays beyond its tokens: the pass in progress and its own) adds only to
work shorter than one pass. Cached tokens follow the engine's rule (whole blocks, at most prompt - 1), as the
router computed them from the prefix index.

Calibration (`calibrate`, on by default). R, p and d are learnt per replica from the TTFTs the router measures
(`kvrouter.routing.calibration`: a robust fit of this very estimate to each replica's last few hundred requests,
fed through `first_token`); the configured values are only the starting estimate (R x the replica's weight), used
until a replica has a couple of dozen observations. Off, the configured values are used as they are (pinned).
The engines' own /metrics add a lower bound on each replica's prefill rate (`set_engine_rate`, from
`kvrouter.routing.engine_rates`; `kv_engine_metrics`), used until the replica has its own fit.

Cache weight. A cached token is worth more than the prefill time it saves now: routing a request away from its
prefix computes that prefix a second time and stores a duplicate, which displaces as many tokens of other content
from the fleet's cache, and a cached token is on average read again `reuse` times before it is evicted. So a
credited token saves its prefill now plus `reuse` future prefills: cache_weight = 1 + reuse, where reuse is the
fleet's ratio of cached to computed prompt tokens over this policy's recent decisions (decayed over
`REUSE_HORIZON` decisions; 0 before the first). `cache_weight` set to a number pins it.

Prefill progress. The load book counts a request's prefill tokens as pending until its first token, so a replica
half-way through a 100k-token prompt would look as busy as one about to start it. The policy therefore keeps,
per replica, the requests sent there in order and watches the pending count fall at each decision (the engines
prefill first-come-first-served): the oldest request still pending is the one in progress, and the part of it
computed since it started — elapsed time x the replica's effective prefill rate, never all of it — is taken off
the queue. With shared load the requests are the whole fleet's: its own, recorded when it routes them, and every
peer instance's, heard as the rise of the peer's pending prefill tokens in its load reports (`peer_prefill`; sent
when heard, so a stale plane under-claims their progress, never over-claims it). Following only its own, an
instance of K took no progress off the K - 1 in 4 queues headed by a peer's request, and priced those replicas
as busier than one router would (docs/scaling.md, "Why four routers sharing at once were not one"). Without such
history (a peer whose dispatch was netted out of its report, a restart) the queue counts in full.

Offload tiers. A cached block the engine holds only in CPU memory or in storage (its KV events' `medium`; vLLM
serves the GPU prefix hit and has its KV connector load what follows) is not a GPU hit: loading it costs time,
less than computing it. Such a token is credited at `cpu_tier_credit` / `storage_tier_credit` of a GPU-cached one
(0.75 / 0.25 by default, the weights NVIDIA Dynamo's KV router gives host-memory and disk overlap: a copy from
host memory over PCIe saves most of a recompute, a read from disk is slower again and saves less; no trace here
has offloaded blocks to measure them on, so they are a starting point, not a fit). The rest, (1 - credit) x
tokens, counts as prefill work (`tier_load_tokens` in the breakdown, beside the GPU / CPU / storage split), and
calibration sees it as work too.

Session hints (`kvrouter.routing.sessions`, `session_mode` soft). The replica that served the request's session
last gets `session_s`: a bonus of `session_bonus` x what this request's whole prompt would cost to prefill there
(the request's own scale: a difference that small is within what the estimate cannot tell apart, so the
session's replica wins it and keeps the conversation's history in one cache; a replica cheaper by more still
wins). It is never given to a replica over the hot-spot cap, and never less than a nanosecond, so it wins exact
ties. The default 0.2 was chosen on the held-out Mooncake synthetic trace (docs/benchmarks.md, "Session
affinity hints"), not on the conversation trace the figures are reported on. The decision records what the
estimate alone would have chosen when the hint changed it (`Decision.without_hint`).

Hot-spot guard, per replica: a replica whose requests in flight exceed `hotspot_ratio` x the fleet's mean
(per unit of weight) plus `hotspot_slack` loses its cache credit for this request, so a popular prefix cannot pile
every request onto one replica; other replicas keep their credit and other requests still follow their prefixes.

`select` is pure (it reads the candidates, the clock and the policy's history); `record` advances the tie-break
rotation, the per-replica history and the reuse ratio; `first_token` feeds the calibration. The clock is a
parameter (the router's: monotonic live, virtual in replay).

Knobs (`Settings` fields, `KVROUTER_KV_*`), defaults in brackets; none comes from a particular engine:
- `kv_prefill_tokens_per_s` [10000]: starting estimate of a replica's prefill throughput, uncached tokens/s through
  full passes.
- `kv_decode_pass_s` [0.01]: starting estimate of the fixed cost of one engine pass.
- `kv_decode_s_per_request` [0.0005]: starting estimate of the extra pass time per decoding request.
- `kv_calibrate` [on]: learn the three above per replica; off pins them.
- `kv_engine_metrics` [on]: with calibration, each engine's /metrics bound its prefill rate from below until the
  replica has its own fit (read by the app's scrape loop, not by this policy).
- `kv_batch_tokens` [8192]: prompt tokens one engine pass computes (vLLM's max_num_batched_tokens default).
- `kv_cache_weight` [derived: 1 + reuse]: how much a cached token is worth in prefill time saved.
- `kv_waiting_request_tokens` [0]: prompt tokens assumed for each request the engine reports waiting beyond the
  ones this router is prefilling there (other routers' traffic; 0 = trust this router's own accounting).
- `kv_hotspot_ratio` [2.0] and `kv_hotspot_slack` [8]: the hot-spot load cap described above.
- `kv_session_bonus` [0.2]: the soft session hint's bonus, a share of the request's own prefill estimate.
- `kv_cpu_tier_credit` [0.75] and `kv_storage_tier_credit` [0.25]: the offload tiers' credit described above.
- `kv_tune` [off]: tune `cache_weight` online against measured TTFT (`kvrouter/routing/tuning.py`: 10% of decisions
  probe the weight x1.25 and x0.75), starting from the pinned weight or 1. Off by default: on the Mooncake trace
  it did not beat a fixed weight (docs/benchmarks.md, "Beyond kv_aware").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrouter.policies.base import Candidate, CandidateScore, Decision, ReplicaLoad, RouteRequest
from kvrouter.routing.calibration import CostCalibrator, Observation, ReplicaCosts, SharedObservation
from kvrouter.routing.tuning import WeightTuner
from kvrouter.typedefs import ReplicaName

_TIE_S = 1e-9
"""The least bonus a soft session hint carries: it wins exact ties even without a prompt length to scale by."""

REUSE_HORIZON = 2000
"""Decisions over which the reuse ratio's token sums decay (by 1/e): a memory of minutes of traffic."""


@dataclass(frozen=True, slots=True)
class KvAwareConfig:
    prefill_tokens_per_s: float = 10_000.0
    batch_tokens: int = 8192
    decode_pass_s: float = 0.01
    decode_s_per_request: float = 0.0005
    waiting_request_tokens: int = 0
    cache_weight: float | None = None
    """None: derived online as 1 + the fleet's reuse ratio."""
    hotspot_ratio: float = 2.0
    hotspot_slack: float = 8.0
    tune: bool = False
    calibrate: bool = True
    session_bonus: float = 0.2
    """Soft session hint: the hinted replica's score is lowered by this share of the request's own prefill there."""
    cpu_tier_credit: float = 0.75
    """Share of a cached token's prefill saved when the engine loads it from CPU memory (an offload tier)."""
    storage_tier_credit: float = 0.25
    """The same for a token loaded from storage (disk, a remote store)."""

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.batch_tokens <= 0:
            raise ValueError("prefill_tokens_per_s and batch_tokens must be positive")
        weight = 0.0 if self.cache_weight is None else self.cache_weight
        if min(self.decode_pass_s, self.decode_s_per_request, self.waiting_request_tokens, weight) < 0:
            raise ValueError("decode costs, waiting_request_tokens and cache_weight must not be negative")
        if self.hotspot_ratio <= 0 or self.hotspot_slack < 0:
            raise ValueError("hotspot_ratio must be positive and hotspot_slack not negative")
        if self.session_bonus < 0:
            raise ValueError("session_bonus must not be negative")
        if not (0 <= self.cpu_tier_credit <= 1 and 0 <= self.storage_tier_credit <= 1):
            raise ValueError("cpu_tier_credit and storage_tier_credit must be between 0 and 1")


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
        self.config = config = config or KvAwareConfig()
        self.clock = clock
        self._turn = 0
        self._lanes: dict[ReplicaName, _Lane] = {}
        start = ReplicaCosts(config.prefill_tokens_per_s, config.decode_pass_s, config.decode_s_per_request)
        self.start_costs = start
        self.calibration = CostCalibrator(start) if config.calibrate else None
        self.tuner = WeightTuner(1.0 if config.cache_weight is None else config.cache_weight) if config.tune else None
        self._reused = 0.0
        self._computed = 0.0
        self.shared_observations: deque[SharedObservation] | None = None
        """With shared load: the calibration observations made since the load share last took them (bounded: the
        newest `window`), for the peers' calibrators. None (the default): nobody takes them."""

    @classmethod
    def from_settings(cls, settings: Any, *, clock: Callable[[], float] = time.monotonic) -> KvAwarePolicy:
        """Build from `Settings` (its `kv_*` fields; any that are absent keep their defaults)."""
        defaults = KvAwareConfig()
        values = {
            name: getattr(settings, f"kv_{name}", getattr(defaults, name))
            for name in KvAwareConfig.__dataclass_fields__
        }
        return cls(KvAwareConfig(**values), clock=clock)

    def costs(self, replica: ReplicaName, weight: float = 1.0) -> ReplicaCosts:
        """The costs the policy prices `replica` with now (calibrated, or the pinned values x weight)."""
        if self.calibration is not None:
            return self.calibration.costs(replica, weight)
        start = self.start_costs
        return ReplicaCosts(
            start.prefill_tokens_per_s * weight,
            start.pass_s,
            start.decode_s_per_request,
            source="pinned",
            rate_source="pinned",
        )

    def set_engine_rate(self, replica: ReplicaName, rate: float | None) -> None:
        """The replica's prefill rate lower bound from its engine's /metrics (ignored when the costs are pinned)."""
        if self.calibration is not None:
            self.calibration.set_engine_rate(replica, rate)

    def engine_rates(self) -> dict[str, float]:
        """The engine-side lower bounds in use, per replica (for the metrics)."""
        return {} if self.calibration is None else {str(r): v for r, v in self.calibration.engine_rates().items()}

    def priced_costs(self, replicas: Iterable[tuple[str, float]]) -> dict[str, ReplicaCosts]:
        """The costs of each (replica, weight) now (for the metrics)."""
        return {name: self.costs(ReplicaName(name), weight) for name, weight in replicas}

    @property
    def reuse(self) -> float:
        """Cached prompt tokens per computed one over recent decisions (the derived cache weight's reason)."""
        return self._reused / self._computed if self._computed > 0 else 0.0

    @property
    def cache_weight(self) -> float:
        pinned = self.config.cache_weight
        return 1.0 + self.reuse if pinned is None else pinned

    def _cap(self, candidates: Sequence[Candidate]) -> float:
        mean = sum(c.load.in_flight / c.weight for c in candidates) / len(candidates)
        return self.config.hotspot_ratio * mean + self.config.hotspot_slack

    def score(
        self, request: RouteRequest, candidate: Candidate, cap: float, now: float, weight: float | None = None
    ) -> CandidateScore:
        config = self.config
        cache_weight = self.cache_weight if weight is None else weight
        costs = self.costs(candidate.replica, candidate.weight)
        rate = costs.prefill_tokens_per_s
        load = candidate.load
        prompt = request.prompt_tokens or 0
        relative_load = load.in_flight / candidate.weight
        hot = relative_load > cap
        credit: float = 0 if hot else min(candidate.cached_tokens, prompt)
        # Blocks in an offload tier are cached but not free: loading them costs the part of their prefill the
        # tier's credit does not save, counted as that many tokens of work.
        tier_load = 0.0
        if not hot and (candidate.cpu_tokens or candidate.storage_tokens):
            tier_load = (1.0 - config.cpu_tier_credit) * candidate.cpu_tokens
            tier_load += (1.0 - config.storage_tier_credit) * candidate.storage_tokens
            credit -= tier_load
        uncached = prompt - credit
        decode_pass_s = costs.decode_s_per_request * load.decode_requests
        token_s = 1.0 / rate + decode_pass_s / config.batch_tokens
        done = self._in_progress(candidate.replica, load, now, token_s)
        queue = load.pending_prefill_tokens - done
        if config.waiting_request_tokens and load.engine_waiting is not None:
            prefilling_here = load.in_flight - load.decode_requests
            queue += max(0, load.engine_waiting - prefilling_here) * config.waiting_request_tokens
        work = queue + uncached
        prefill_s = work / rate
        passes = max(1.0, work / config.batch_tokens)
        short = max(0.0, 1.0 - work / config.batch_tokens)
        decode_s = short * costs.pass_s + passes * decode_pass_s
        ttft_s = prefill_s + decode_s
        affinity_s = (cache_weight - 1.0) * credit * token_s
        session_s = 0.0
        if request.session_replica == candidate.replica and not hot:
            session_s = config.session_bonus * prompt * token_s + _TIE_S
        score = ttft_s - affinity_s - session_s
        breakdown = {
            "cached_tokens": float(candidate.cached_tokens),
            "cache_credit_tokens": float(credit),
            "gpu_cached_tokens": float(candidate.cached_tokens - candidate.cpu_tokens - candidate.storage_tokens),
            "cpu_cached_tokens": float(candidate.cpu_tokens),
            "storage_cached_tokens": float(candidate.storage_tokens),
            "tier_load_tokens": tier_load,
            "uncached_tokens": float(uncached),
            "pending_prefill_tokens": float(load.pending_prefill_tokens),
            "peer_pending_prefill_tokens": float(load.peer_pending_prefill_tokens),
            "prefill_in_progress_tokens": done,
            "queued_prefill_tokens": float(queue),
            "prefill_s": prefill_s,
            "passes": passes,
            "decode_pass_s": decode_pass_s,
            "decode_s": decode_s,
            "ttft_estimate_s": ttft_s,
            "affinity_s": affinity_s,
            "session_bonus_s": session_s,
            "in_flight": float(load.in_flight),
            "decode_requests": float(load.decode_requests),
            "load_cap": cap,
            "hot_spot": 1.0 if hot else 0.0,
            "weight": candidate.weight,
            "prompt_tokens": float(prompt),
            "cache_weight": cache_weight,
            "prefill_tokens_per_s": rate,
            "pass_fixed_s": costs.pass_s,
            "decode_s_per_request": costs.decode_s_per_request,
            "calibration_samples": float(costs.samples),
        }
        return CandidateScore(candidate.replica, candidate.cached_tokens, score, breakdown)

    def _in_progress(self, replica: ReplicaName, load: ReplicaLoad, now: float, token_s: float) -> float:
        """Pending prefill tokens of the request in progress already computed (an estimate from the lane)."""
        lane = self._lanes.get(replica)
        # The lane follows the fleet's requests there (this router's and, through `peer_prefill`, its peers'); the
        # blind group's placeholders stand for requests it has not heard of, behind those it holds.
        pending = load.pending_prefill_tokens - load.placeholder_prefill_tokens
        if lane is None or pending <= 0:
            return 0.0
        return min(lane.in_progress(pending, now, 1.0 / token_s), float(pending))

    def peer_prefill(self, replica: ReplicaName, tokens: int, pending: int, now: float) -> None:
        """A peer's load report on `replica` was folded in (`kvrouter.routing.sharing.PeerPrefillSink`). When its
        pending prefill rose by `tokens` (its dispatches there), they queue behind what the lane holds, as if sent
        `now`, and the lane takes the look at the replica's queue (the fleet's `pending`) that its own decision
        would have taken: the lane then sees the queue at every dispatch in the fleet, as one router routing every
        request would (looking at first tokens as well was no better on the held-out trace: docs/scaling.md)."""
        if tokens <= 0:
            return
        lane = self._lanes.get(replica)
        if lane is None:
            lane = self._lanes[replica] = _Lane(head_since=now, observed=now)
        lane.sent.append((now, tokens))
        lane.total += tokens
        lane.observe(pending, now)

    def queued_prefill_tokens(self, replica: ReplicaName, load: ReplicaLoad, weight: float = 1.0) -> float:
        """Prefill tokens still to compute on `replica` now: its pending prefill less the estimated progress of
        the request in progress (what the router queue's saturation rule reads)."""
        costs = self.costs(replica, weight)
        token_s = 1.0 / costs.prefill_tokens_per_s + costs.decode_s_per_request * load.decode_requests / (
            self.config.batch_tokens
        )
        return load.pending_prefill_tokens - self._in_progress(replica, load, self.clock(), token_s)

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
        chosen = min(ranked)[3]
        without_hint = None
        if request.session_replica == chosen:
            # What the estimate alone would pick: the same ranking with the hint's bonus given back.
            bonus = {s.replica: s.breakdown["session_bonus_s"] for s in scores}
            alone = min((entry[0] + bonus[entry[3]], *entry[1:]) for entry in ranked)[3]
            without_hint = alone if alone != chosen else None
        return Decision(chosen, tuple(scores), without_hint=without_hint)

    def observe_ttft(self, used_weight: float, ttft_s: float, prompt_tokens: int) -> None:
        """A request this policy routed with cache weight `used_weight` (its breakdown's) got its first token."""
        if self.tuner is not None:
            self.tuner.observe(used_weight, ttft_s, prompt_tokens)

    def first_token(self, decision: Decision, ttft_s: float, prompt_tokens: int) -> None:
        chosen = decision.score_of(decision.chosen)
        if chosen is None or "cache_weight" not in chosen.breakdown:
            return
        breakdown = chosen.breakdown
        self.observe_ttft(breakdown["cache_weight"], ttft_s, prompt_tokens)
        if self.calibration is not None:
            # The work the engine does before this first token: the queue ahead and what it computes of this prompt
            # (the index's prediction, whatever credit the hot-spot guard withheld).
            work = breakdown["queued_prefill_tokens"] + max(0.0, breakdown["prompt_tokens"] - chosen.cached_tokens)
            work += breakdown.get("tier_load_tokens", 0.0)  # loading offloaded blocks, in tokens of prefill
            # Placeholders for peers' unseen requests (kvrouter/routing/herding.py) are a guess, not an observation:
            # the fit learns from the queue that was known, or its own guesses would feed back into it.
            work -= breakdown.get("blind_placeholder_tokens", 0.0)
            batch = self.config.batch_tokens
            observation = Observation(
                work, max(0.0, 1.0 - work / batch), max(1.0, work / batch), breakdown["decode_requests"], ttft_s
            )
            weight = breakdown.get("weight", 1.0)
            self.calibration.observe(decision.chosen, observation, weight)
            if self.shared_observations is not None:
                self.shared_observations.append(SharedObservation(decision.chosen, observation, weight))

    # -- PeerCalibrationSink (kvrouter/routing/sharing.py): the router instances of one fleet fit one history ----

    def share_observations(self) -> None:
        """Start keeping this instance's calibration observations for the peers (`take_observations`)."""
        if self.calibration is not None and self.shared_observations is None:
            self.shared_observations = deque(maxlen=self.calibration.config.window)

    def take_observations(self) -> list[SharedObservation]:
        """The observations made since the last call (they go into the next load report)."""
        taken = self.shared_observations
        if not taken:
            return []
        observations = list(taken)
        taken.clear()
        return observations

    def peer_observations(self, peer: str, observations: Sequence[SharedObservation]) -> None:
        """A peer instance's observations (checked by the load share): fitted as this instance's own are."""
        if self.calibration is None:
            return
        for shared in observations:
            self.calibration.observe(shared.replica, shared.observation, shared.weight, source=peer)

    def forget_peer(self, peer: str) -> None:
        """The peer's reports stopped: its observations leave the fits."""
        if self.calibration is not None:
            self.calibration.forget_source(peer)

    def record(self, decision: Decision) -> None:
        self._turn += 1
        now = self.clock()
        for scored in decision.candidates:
            lane = self._lanes.get(scored.replica)
            if lane is None:
                lane = self._lanes[scored.replica] = _Lane(head_since=now, observed=now)
            breakdown = scored.breakdown
            # The blind group's placeholders (kvrouter/routing/herding.py) are guesses, not requests the lane holds.
            pending = breakdown.get("pending_prefill_tokens", 0.0) - breakdown.get("blind_placeholder_tokens", 0.0)
            lane.observe(int(pending), now)
            if scored.replica == decision.chosen:
                # What the load book counts for it: the prompt minus what is cached there.
                prompt = int(scored.breakdown.get("prompt_tokens", 0.0))
                tokens = prompt - scored.cached_tokens
                if tokens > 0:
                    lane.sent.append((now, tokens))
                    lane.total += tokens
                decay = 1.0 - 1.0 / REUSE_HORIZON
                self._reused = self._reused * decay + min(scored.cached_tokens, prompt)
                self._computed = self._computed * decay + max(0, tokens)
