"""Herding under a stale shared view: deciding as if the peers' unseen decisions were already placed.

The problem. With shared load (`kvrouter.routing.sharing`) every router instance reads the same picture of the
fleet, but a peer's decision reaches it only a staleness `horizon_s` later. Requests that reach different
instances within that window are decided blind to each other, and, the picture being the same, a deterministic
argmin sends them all to the same replica. This is the herd effect of "How useful is old information?"
(Mitzenmacher, IEEE TPDS 11(1), 2000): with stale load, every chooser that takes the least loaded server herds onto
it, which can be worse than using no information; choices that differ between the choosers are not hurt so.

What `BlindGroup` does. It measures how blind this instance is: each decision opens a window of `horizon_s`, and
every peer dispatch reported inside it (a rise of a peer's in-flight count on a replica) was made before the
decision or after it but before this instance's report reached that peer: either way the two were decided blind
to each other. The counts, averaged over the last `window` decisions, give the expected number of peers in the
blind group (`expected_unseen`), measured in the arrival pattern the fleet really has — Poisson arrivals 50 ms
stale give a fraction of a peer, a trace whose requests arrive in same-millisecond bursts gives nearly the whole
burst — instead of assumed from a rate. The instance then decides as one router that saw the whole group in order
would: the peers ahead of it are placed first, as placeholders, by the policy itself (a placeholder is an average
request: the mean uncached prompt of this instance's own recent dispatches, arrivals being spread evenly; it
carries no cache affinity, so it lands by load), and its own request is decided on that picture. A placeholder
stands until a peer's report retires it (one per dispatch heard) or the horizon passes, so this instance's next
decisions in the same window see it too.

Its place in the group. Arrivals spread round-robin reach the instances in turn, so the j-th decision of the
instance ranked r (of K live instances, sorted by name: every instance ranks alike) follows j x (K - 1) + r peers;
capped by the group's size (the measured mean, rounded at random). Instances reading the same picture thus take
different places, as the issue's "distinct tie-breaking" but over every candidate the placeholders make
near-equal, not just exact ties. Without a rank (`ranked` False, or no peer known yet) the place is drawn uniformly
in the group, Mitzenmacher's randomised choice.

Staggered decisions. A place in the group still decides blind; bursts (requests arriving in the same instant,
spread over the instances: a trace whose timestamps are whole seconds, a client's fan-out, a batch job) need more:
only an order the instances can see makes the burst's decisions sequential, as one router's would be. So an
instance of rank r waits r horizons (`stagger_s`) before deciding: the instance ranked before it decided a horizon
earlier on its part of the same burst, and its report has arrived when this one decides; the one ranked after it
waits for this one's. A burst is then decided in rank order with every earlier decision seen, and the blind group
measures only the peers' decisions that still overlap (arrivals less than a horizon apart, not simultaneous): a
peer ranked after this instance decides after seeing it (while the steps are whole horizons), so its dispatches
are not counted blind. The
cost is the wait, at most `stagger_max_s` for the last rank (50 ms by default; past it the steps shrink alike; 0
turns it off), paid by every request on an instance of rank > 0: a few milliseconds at the staleness of Redis
pub/sub on one network. docs/scaling.md ("Staggered decisions") has what it gains and costs, held out and live.

Neutral where there is nothing to fix: with one instance, or instant sharing (nothing is ever reported within a
window that opened at the same instant), the group is empty and the decision is the policy's own, untouched. The
random draws are made when a decision is committed, so `select` gives the same answer until then (`/debug/route`
shows the next decision as it will be made); the random source is a parameter (seeded per instance in the
replay). A decision taken behind placeholders says so in its breakdown (`blind_group_ahead`,
`blind_placeholder_tokens`).

Knobs: `horizon_s` (the plane's staleness: the replay's share delay; live, twice the largest recent delay of the
instance's own report coming back through the channel, `retune`d as it is measured), `window` (decisions
averaged; 64), `max_group` (most placeholders one decision places; 32), `ranked`, `stagger_max_s` (the longest
wait before a decision; 0: no stagger; only ranked instances stagger).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvrouter.policies.base import Candidate, CandidateScore, Decision, Policy, ReplicaLoad, RouteRequest
from kvrouter.typedefs import ReplicaName

STAGGER_MAX_S = 0.05
"""The longest wait of a staggered decision, by default (docs/scaling.md)."""


@dataclass(frozen=True, slots=True)
class BlindGroupConfig:
    horizon_s: float
    window: int = 64
    max_group: int = 32
    ranked: bool = True
    """Take the place this instance's rank gives (when it knows its rank); False: always a random place."""
    stagger_max_s: float = STAGGER_MAX_S
    """The longest an instance waits before deciding (its rank times the horizon, capped); 0: it never waits."""

    def __post_init__(self) -> None:
        if self.horizon_s < 0:
            raise ValueError("horizon_s must not be negative")
        if not 0 <= self.stagger_max_s <= 1.0:
            raise ValueError("stagger_max_s must be between 0 and 1 second")
        if self.window < 1 or self.max_group < 0:
            raise ValueError("window must be at least 1 and max_group not negative")


@dataclass(slots=True)
class _Window:
    opened: float
    unseen: int = 0


@dataclass(frozen=True, slots=True)
class _Placeholder:
    placed: float
    replica: ReplicaName
    tokens: int


class BlindGroup:
    """One instance's estimate of the peers' decisions it could not see, and the decision that accounts for them."""

    def __init__(self, config: BlindGroupConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self._open: deque[_Window] = deque()
        self._live: deque[_Placeholder] = deque()
        self._unseen_mean = 0.0
        self._tokens_mean = 0.0
        self._closed = 0
        self._size_draw = rng.random()
        self._place_draw = rng.random()
        self._planned: tuple[Decision, list[ReplicaName]] | None = None
        self._rank: int | None = None
        self._instances = 1
        self.placed = 0
        """Placeholders placed, in all (the replay reports it)."""
        self.staggered = 0
        """Decisions that waited their rank's stagger."""
        self.stagger_seconds = 0.0
        """Seconds waited in all."""

    # -- what the instance hears ---------------------------------------------------------------------------------

    def peer_dispatched(self, count: int, now: float, *, ranked_after: bool = False) -> None:
        """Peers' reports just folded in show `count` more requests in flight (dispatches they made): each was
        unseen by the decisions of the last `horizon_s`, and stands for one placeholder, which it retires.
        `ranked_after`: the peer ranks after this instance. While the stagger's steps are whole horizons (not cut
        by the cap), such a peer waits a horizon longer than this instance and decides after seeing its decisions:
        its dispatches retire placeholders but are not counted blind (each instance's horizon is its own estimate,
        so a later peer's report can land inside this one's window without having been decided blind)."""
        self._close(now)
        if count <= 0:
            return
        if ranked_after and self._staggers_whole_horizons():
            for _ in range(min(count, len(self._live))):
                self._live.popleft()
            return
        # A joining peer's first report (or a hostile one) can show many at once: no window counts more than a
        # group's cap, so one report cannot skew the estimate beyond it.
        cap = self.config.max_group
        for window in self._open:
            if window.opened < now:
                window.unseen = min(cap, window.unseen + count)
        for _ in range(min(count, len(self._live))):
            self._live.popleft()

    def committed(self, decision: Decision, uncached_tokens: int, now: float) -> None:
        """This instance acted on `decision`: its window opens, and the placeholders placed ahead of it stay (until
        the peers' reports retire them or the horizon passes)."""
        self._close(now)
        self._open.append(_Window(now))
        weight = 1.0 / min(self._closed + 1, self.config.window)
        self._tokens_mean += (max(0, uncached_tokens) - self._tokens_mean) * weight
        planned = self._planned
        if planned is not None and planned[0] == decision:
            tokens = self.placeholder_tokens()
            self._live.extend(_Placeholder(now, replica, tokens) for replica in planned[1])
            self.placed += len(planned[1])
        self._planned = None
        self._size_draw = self.rng.random()
        self._place_draw = self.rng.random()

    def _close(self, now: float) -> None:
        horizon = self.config.horizon_s
        while self._open and now - self._open[0].opened > horizon:
            window = self._open.popleft()
            self._closed += 1
            weight = 1.0 / min(self._closed, self.config.window)
            self._unseen_mean += (window.unseen - self._unseen_mean) * weight
        while self._live and now - self._live[0].placed > horizon:
            self._live.popleft()

    # -- the estimate and the decision -----------------------------------------------------------------------------

    def expected_unseen(self, now: float) -> float:
        """Peers' decisions expected blind to this instance's next one (mean over recent decisions)."""
        self._close(now)
        return self._unseen_mean

    @property
    def measured_unseen(self) -> float:
        """The mean as of the last window closed (what the metrics show; no clock needed)."""
        return self._unseen_mean

    def placeholder_tokens(self) -> int:
        """The size given to a peer's unseen request: the mean uncached prompt of this instance's dispatches."""
        return round(self._tokens_mean)

    def ahead(self, now: float) -> int:
        """How many of the blind group go before the next decision: its size drawn around the expected one, the
        place uniform, but never before the placeholders already standing (placed ahead of this instance's
        earlier decisions in the window: the group's order does not go back)."""
        expected = min(self.expected_unseen(now), float(self.config.max_group))
        standing = len(self._live)
        if expected <= 0:
            return standing
        whole = math.floor(expected)
        size = whole + (1 if self._size_draw < expected - whole else 0)
        if size <= standing:
            return standing
        if self._rank is not None:
            # A place of its own: the group's members arrive round-robin over the instances, so this instance's
            # j-th decision in the window follows j rounds of the peers and those ranked before it.
            earlier = len(self._open)
            peers = self._instances - 1
            return max(standing, min(size, earlier * peers + self._rank))
        return standing + min(size - standing, math.floor(self._place_draw * (size - standing + 1)))

    @property
    def rank(self) -> tuple[int, int] | None:
        """(this instance's rank, live instances), once it knows them and takes ranked places; else None."""
        return None if self._rank is None else (self._rank, self._instances)

    def stagger_s(self) -> float:
        """How long this instance waits before its next decision: its rank (from 0) times the horizon, so that a
        burst spread over the instances is decided in rank order, each seeing the ones before it. The last rank
        waits at most `stagger_max_s` (past it every step shrinks alike: the order stays, the instances may see
        less of each other). 0 for the first instance, before the rank is known, and without ranked places."""
        if not self._rank:  # unknown (None), or the first
            return 0.0
        # Past the cap the steps shrink alike, so the last rank waits stagger_max_s and the order still holds.
        step = min(self.config.horizon_s, self.config.stagger_max_s / (self._instances - 1))
        return self._rank * step

    def _staggers_whole_horizons(self) -> bool:
        """The stagger is on and its steps are whole horizons: the cap does not cut them."""
        config = self.config
        if self._rank is None or config.stagger_max_s <= 0:
            return False
        return config.horizon_s * (self._instances - 1) <= config.stagger_max_s

    def waited(self, seconds: float) -> None:
        """A decision waited `seconds` (its stagger): counted for the metrics and the replay's report."""
        self.staggered += 1
        self.stagger_seconds += seconds

    def retune(self, horizon_s: float) -> None:
        """The plane's staleness was measured anew (kvrouter/routing/sharing.py: twice its largest recent echo)."""
        self.config = replace(self.config, horizon_s=horizon_s)

    def rank_among(self, rank: int, instances: int) -> None:
        """This instance is number `rank` (from 0) of `instances` sharing load: it then takes that place in the
        blind group instead of a random one, so instances reading the same view take different places."""
        self._rank = rank if instances > 1 and self.config.ranked else None
        self._instances = instances

    def select(self, policy: Policy, request: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        """The policy's decision for `request` with the peers' unseen requests ahead of it placed first. No side
        effects: the same call gives the same answer until the next `committed`."""
        ahead = self.ahead(now)
        if ahead == 0:
            return policy.select(request, candidates)
        tokens = self.placeholder_tokens()
        position = {candidate.replica: number for number, candidate in enumerate(candidates)}
        requests = [0] * len(candidates)
        added = [0] * len(candidates)

        def loaded(number: int) -> Candidate:
            """The candidate with the placeholders placed on it so far (built anew, not copied once per
            placeholder: a decision behind a dozen placeholders made ~60 copies of a candidate)."""
            candidate = candidates[number]
            if not requests[number]:
                return candidate
            return _with_load(candidate, _placed(candidate.load, requests[number], added[number]))

        for standing in self._live:
            number = position.get(standing.replica)
            if number is not None:
                requests[number] += 1
                added[number] += standing.tokens
        placeholder = RouteRequest(prompt_tokens=tokens)
        new: list[ReplicaName] = []
        if ahead > len(self._live):
            unseen = [_bare(loaded(number)) for number in range(len(candidates))]
            for _ in range(ahead - len(self._live)):
                chosen = policy.select(placeholder, unseen).chosen
                number = position[chosen]
                requests[number] += 1
                added[number] += tokens
                unseen[number] = _bare(loaded(number))
                new.append(chosen)
        loaded_all = [loaded(number) for number in range(len(candidates))]
        decision = policy.select(request, loaded_all)
        scores = tuple(
            _with_breakdown(
                score,
                {
                    **score.breakdown,
                    "blind_group_ahead": float(ahead),
                    "blind_placeholder_tokens": float(added[number]),
                },
            )
            if (number := position.get(score.replica)) is not None
            else score
            for score in decision.candidates
        )
        decision = Decision(decision.chosen, scores, without_hint=decision.without_hint)
        self._planned = (decision, new)
        return decision


# Copies made field by field: `dataclasses.replace` looks the fields up on every call (~4.4 µs against ~2.2 µs
# here), and a decision behind placeholders makes a dozen. tests/test_herding.py checks they keep every field.


def _placed(load: ReplicaLoad, requests: int, tokens: int) -> ReplicaLoad:
    """`load` with `requests` placeholders of `tokens` prefill tokens in all placed on it (peers' pending prefill)."""
    return ReplicaLoad(
        load.in_flight + requests,
        load.pending_prefill_tokens + tokens,
        load.decode_requests,
        load.engine_waiting,
        load.engine_running,
        load.kv_usage,
        load.peer_pending_prefill_tokens + tokens,
        load.placeholder_prefill_tokens + tokens,
    )


def _with_load(candidate: Candidate, load: ReplicaLoad) -> Candidate:
    return Candidate(
        candidate.replica,
        candidate.cached_tokens,
        load,
        candidate.weight,
        candidate.cpu_tokens,
        candidate.storage_tokens,
    )


def _bare(candidate: Candidate) -> Candidate:
    """`candidate` holding nothing of the prompt: a placeholder carries no cache affinity."""
    return Candidate(candidate.replica, 0, candidate.load, candidate.weight, 0, 0)


def _with_breakdown(score: CandidateScore, breakdown: dict[str, float]) -> CandidateScore:
    return CandidateScore(score.replica, score.cached_tokens, score.score, breakdown)


__all__ = ["STAGGER_MAX_S", "BlindGroup", "BlindGroupConfig"]
