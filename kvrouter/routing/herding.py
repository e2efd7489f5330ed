"""Herding under a stale shared view: deciding as if the peers' unseen decisions were already placed.

The problem. With shared load (`kvrouter.routing.sharing`) every router instance reads the same picture of the
fleet, but a peer's decision reaches it only a staleness `horizon_s` later. Requests that reach different
instances within that window are decided blind to each other, and, the picture being the same, a deterministic
argmin sends them all to the same replica. This is the herd effect of "How useful is old information?"
(Mitzenmacher, IEEE TPDS 11(1), 2000): with stale load, every chooser that takes the least loaded server herds onto
it, and doing so is worse than ignoring the information; choices that spread (a random pick among the few best)
are not hurt by staleness.

What `BlindGroup` does. It measures how blind this instance is: each decision opens a window of `horizon_s`, and
every peer dispatch reported inside it (a rise of a peer's in-flight count on a replica) was made before the
decision or after it, but before this instance's own report reached that peer: either way the two were decided
blind to each other. The counts, averaged over the last `window` decisions, give the expected size of the blind
group (`expected_unseen`): measured in the arrival pattern the fleet really has — Poisson arrivals at a share
delay of 50 ms give a fraction of a peer, a trace whose requests arrive in same-millisecond bursts gives nearly
the whole burst — instead of assumed from a rate. It then decides as one router that saw the whole group at once
would, in an order it cannot know: it draws its place in the group uniformly (the group's members are alike, so
every place is equally likely), has the policy place the peers ahead of it as average requests (their size is the
mean uncached prompt of this instance's own recent dispatches, arrivals being spread evenly over the instances;
they carry no cache affinity, so they land by load) and decides its own request on that picture. The instances
then spread over the places a coordinated router would have used, and a request with a strong cache hit keeps it
(the peers' placeholders load every replica about alike).

Neutral where there is nothing to fix: with one instance, or instant sharing (nothing is ever reported within a
window that opened at the same instant), the group is empty and the decision is the policy's own, untouched. The
random draws are made when a decision is committed, so `decide` stays free of side effects (`/debug/route` shows
the next decision as it will be made); the random source is a parameter (seeded per instance in the replay).
A decision taken behind placeholders says so in its breakdown (`blind_group_ahead`, `blind_placeholder_tokens`).

Knobs: `horizon_s` (the plane's staleness: the replay's share delay; live, the share interval plus one hop, taken
as two intervals), `window` (decisions averaged; 64), `max_group` (most placeholders one decision places; 32).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvrouter.policies.base import Candidate, Decision, Policy, RouteRequest


@dataclass(frozen=True, slots=True)
class BlindGroupConfig:
    horizon_s: float
    window: int = 64
    max_group: int = 32

    def __post_init__(self) -> None:
        if self.horizon_s < 0:
            raise ValueError("horizon_s must not be negative")
        if self.window < 1 or self.max_group < 0:
            raise ValueError("window must be at least 1 and max_group not negative")


@dataclass(slots=True)
class _Window:
    opened: float
    unseen: int = 0


class BlindGroup:
    """One instance's estimate of the peers' decisions it could not see, and the decision that accounts for them."""

    def __init__(self, config: BlindGroupConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self._open: deque[_Window] = deque()
        self._unseen_mean = 0.0
        self._tokens_mean = 0.0
        self._closed = 0
        self._size_draw = rng.random()
        self._place_draw = rng.random()
        self.placed = 0
        """Placeholders placed ahead of committed decisions, in all (a counter for the metrics and the replay)."""

    # -- what the instance hears ---------------------------------------------------------------------------------

    def peer_dispatched(self, count: int, now: float) -> None:
        """Peers' reports just folded in show `count` more requests in flight (dispatches they made)."""
        self._close(now)
        if count <= 0:
            return
        for window in self._open:
            if window.opened < now:
                window.unseen += count

    def committed(self, now: float, uncached_tokens: int, ahead: int) -> None:
        """This instance acted on a decision (`ahead` placeholders were placed before it): open its window."""
        self._close(now)
        self._open.append(_Window(now))
        weight = 1.0 / min(self._closed + 1, self.config.window)
        self._tokens_mean += (max(0, uncached_tokens) - self._tokens_mean) * weight
        self.placed += ahead
        self._size_draw = self.rng.random()
        self._place_draw = self.rng.random()

    def _close(self, now: float) -> None:
        horizon = self.config.horizon_s
        while self._open and now - self._open[0].opened > horizon:
            window = self._open.popleft()
            self._closed += 1
            weight = 1.0 / min(self._closed, self.config.window)
            self._unseen_mean += (window.unseen - self._unseen_mean) * weight

    # -- the estimate and the decision -----------------------------------------------------------------------------

    def expected_unseen(self, now: float) -> float:
        """Peers' decisions expected blind to this instance's next one (mean over recent decisions)."""
        self._close(now)
        return self._unseen_mean

    def placeholder_tokens(self) -> int:
        """The size given to a peer's unseen request: the mean uncached prompt of this instance's dispatches."""
        return round(self._tokens_mean)

    def ahead(self, now: float) -> int:
        """How many of the blind group are placed before the next decision (drawn at the last commit)."""
        expected = min(self.expected_unseen(now), float(self.config.max_group))
        if expected <= 0:
            return 0
        whole = math.floor(expected)
        size = whole + (1 if self._size_draw < expected - whole else 0)
        return min(size, math.floor(self._place_draw * (size + 1)))

    def select(self, policy: Policy, request: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        """The policy's decision for `request` with the peers' unseen requests ahead of it placed first. No side
        effects: the same call gives the same answer until the next `committed`."""
        ahead = self.ahead(now)
        if ahead == 0:
            return policy.select(request, candidates)
        tokens = self.placeholder_tokens()
        placeholder = RouteRequest(prompt_tokens=tokens)
        loaded = list(candidates)
        added = [0] * len(loaded)
        position = {candidate.replica: number for number, candidate in enumerate(loaded)}
        for _ in range(ahead):
            bare = [replace(c, cached_tokens=0, cpu_tokens=0, storage_tokens=0) for c in loaded]
            number = position[policy.select(placeholder, bare).chosen]
            load = loaded[number].load
            loaded[number] = replace(
                loaded[number],
                load=replace(
                    load,
                    in_flight=load.in_flight + 1,
                    pending_prefill_tokens=load.pending_prefill_tokens + tokens,
                    peer_pending_prefill_tokens=load.peer_pending_prefill_tokens + tokens,
                ),
            )
            added[number] += tokens
        decision = policy.select(request, loaded)
        scores = tuple(
            replace(
                score,
                breakdown={
                    **score.breakdown,
                    "blind_group_ahead": float(ahead),
                    "blind_placeholder_tokens": float(added[position[score.replica]]),
                },
            )
            if score.replica in position
            else score
            for score in decision.candidates
        )
        return Decision(decision.chosen, scores, without_hint=decision.without_hint)


__all__ = ["BlindGroup", "BlindGroupConfig"]
