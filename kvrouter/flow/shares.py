"""Headroom for light tenants: a tenant taking more than its share of the fleet cannot fill the others' part of it.

The router queue holds a request while every replica has `hold_passes` passes of prefill queued: the fleet's
prefill budget, `hold_passes` x `kv_batch_tokens` per routable replica. Fair sharing inside the queue (VTC,
`kvrouter.flow.queue`) orders the waiters, but a waiter goes only when the budget has room, and the budget is
first come first served: a tenant that sends far more than its share (a noisy neighbour) keeps it full, so the
other tenants' requests — which on their own would have found the fleet with room — wait in the router for
dispatch slots, most of which go to one another (measured: a regular tenant's slowest requests waited 1–2 s
while the neighbour itself took only a third of the dispatches in between). Reordering the queue cannot help
them; keeping room for them can.

So the budget is divided among the active tenants (a request in flight or waiting) by weight, and:
- a tenant is **heavy** while what it sends — prompt tokens of its arrivals, divided by its weight, decayed with
  `HORIZON_S` — is above its weighted share of what the active tenants send (a rate over tens of seconds: a light
  tenant's burst does not make it heavy). Demand, not service: service would follow the holding back itself (a
  heavy tenant held back is served less and would turn light, a light one served at once would turn heavy), and
  on the conversation trace that flipping held a regular tenant with heavy bursts for 12 s at x1.5;
- each light tenant's share of the budget less its own queued prefill (the uncached prompt tokens of its
  dispatched requests without a first token) is held in reserve for it;
- a heavy tenant's request is dispatched only while the fleet's room (the budget less what every replica has
  queued) exceeds that reserve; light tenants dispatch whenever the fleet has room, as without the book.

It is work-conserving for the light tenants and bounded for the heavy one: what it holds back is at most the
light tenants' unused shares, and as soon as they use them (or go idle, leaving the active set) the heavy tenant
fills the fleet again. With one active tenant nothing changes (`eligible` returns None).

The request path asks `admits` for one tenant while nothing is queued, and that answer costs O(1), not a scan of
every active tenant: the sums the scan would take (weights, and what each sent times its weight) are kept as
running totals with a bound on their rounding, and a tenant clearly light, or clearly heavy with the room above
every other tenant's share, is answered from them; a near tie, where the scan's own rounding could decide, is
left to the scan (`eligible`), so the decisions are the scan's exactly.

Pure and synchronous: a `RequestListener` of the router (first tokens, finishes), told of each arrival and
dispatch by the caller (`arrived`, `routed`), which knows the request's flow; `now` is the caller's clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvrouter.flow.classes import FlowClass
from kvrouter.routing.lifecycle import Routed

_UNIT = 2.0**-53
"""A float's relative rounding error."""
_MARGIN = 1e-9
"""Relative distance from a tie under which `admits` defers to the scan: far above the rounding of sums over up to
a million tenants (their error is below n x `_UNIT` relative, all terms being positive)."""
_DRIFT = 1e5
"""The running totals are summed afresh once what they have been through (the magnitudes of every step) passes
this many times their value: their accumulated rounding then stays under 1e5 x 4 x `_UNIT` ~ 4e-11 relative."""

HORIZON_S = 30.0
"""Time constant of the recent demand that says who is heavy. Chosen on the held-out Mooncake synthetic trace with
a noisy neighbour (docs/benchmarks.md, "Noisy neighbour"): 10 s let a regular tenant's bursts make it heavy (its
p99 at x1.5 went from 2.4 to 3.6 s); 30 s and 120 s were level (mean of the regular tenants' p99 at x1.25 and
x1.5: 1,939 and 1,961 ms)."""


@dataclass(slots=True)
class _InFlight:
    tenant: str
    prefill: float
    """Uncached prompt tokens still to compute (0 once the first token came)."""


class TenantShares:
    def __init__(self, horizon_s: float = HORIZON_S) -> None:
        self.horizon_s = horizon_s
        self._in_flight: dict[int, _InFlight] = {}
        self.queued_prefill: dict[str, float] = {}
        """Per tenant: uncached prompt tokens of its dispatched requests without a first token."""
        self.running: dict[str, int] = {}
        """Per tenant: dispatched requests not finished."""
        self.weights: dict[str, float] = {}
        """The weight of each tenant with requests running."""
        self.sent: dict[str, float] = {}
        """Per tenant: prompt tokens sent / weight, decayed with `horizon_s`, kept scaled by e^((now - base) / h)."""
        self._base = 0.0
        # Running sums over the tenants in `weights` (what `eligible` adds up), and the magnitudes they moved by.
        self._weight_total = 0.0
        self._sent_total = 0.0
        """Sum of sent x weight."""
        self._weight_drift = 0.0
        self._sent_drift = 0.0

    # -- what the caller tells it ----------------------------------------------------------------------------

    def arrived(self, flow: FlowClass, prompt_tokens: int, now: float) -> None:
        """A request of `flow` with `prompt_tokens` arrived (whether it goes straight through or waits)."""
        if prompt_tokens > 0:
            scaled = prompt_tokens / flow.weight * self._scale(now)
            before = self.sent.get(flow.tenant, 0.0)
            after = self.sent[flow.tenant] = before + scaled
            weight = self.weights.get(flow.tenant)
            if weight is not None:
                self._add_sent((after - before) * weight, after * weight)

    def routed(self, routed: Routed, flow: FlowClass) -> None:
        """A request of `flow` was dispatched as `routed` (straight through or from the queue)."""
        tenant = flow.tenant
        prefill = float(max(0, routed.prompt_tokens - routed.predicted_cached))
        self._in_flight[id(routed)] = _InFlight(tenant, prefill)
        self.queued_prefill[tenant] = self.queued_prefill.get(tenant, 0.0) + prefill
        self.running[tenant] = self.running.get(tenant, 0) + 1
        old = self.weights.get(tenant)
        if old != flow.weight:
            self.weights[tenant] = flow.weight
            self._reweighed(tenant, 0.0 if old is None else old, flow.weight)

    # -- what it answers -------------------------------------------------------------------------------------

    def eligible(self, budget: float, room: float, waiting: Mapping[str, float]) -> Callable[[FlowClass], bool] | None:
        """Which flows may be dispatched now: `budget` the fleet's prefill budget (tokens), `room` what of it is
        free, `waiting` the weights of the tenants with queued requests. None: every flow (fewer than two active
        tenants, or nothing held in reserve)."""
        weights = {**self.weights, **waiting}
        if len(weights) < 2:
            return None
        total_weight = sum(weights.values())
        total_sent = sum(self.sent.get(tenant, 0.0) * weight for tenant, weight in weights.items())
        heavy: set[str] = set()
        reserve = 0.0
        for tenant, weight in weights.items():
            if self.sent.get(tenant, 0.0) * total_weight > total_sent:
                heavy.add(tenant)
            else:
                reserve += max(0.0, budget * weight / total_weight - self.queued_prefill.get(tenant, 0.0))
        if room > reserve or not heavy:
            return None
        return lambda flow: flow.tenant not in heavy

    def admits(self, tenant: str, budget: float, room: float) -> bool | None:
        """Whether `eligible(budget, room, {})` (nothing queued) lets `tenant`'s flows go, in O(1): True or False
        where the running totals decide it beyond their rounding, None for a near tie (ask `eligible`)."""
        weights = self.weights
        weight = weights.get(tenant)
        if weight is None or len(weights) < 2:
            return True  # a tenant with nothing running is never heavy; one active tenant is never held
        if self._weight_drift > _DRIFT * self._weight_total or self._sent_drift > _DRIFT * self._sent_total:
            self._resum()
        margin = _MARGIN + 4 * (len(weights) + 2) * _UNIT
        weight_error = 4 * _UNIT * (self._weight_drift + self._weight_total)
        sent_error = 4 * _UNIT * (self._sent_drift + self._sent_total)
        low_weight = (self._weight_total - weight_error) * (1 - margin)
        high_weight = (self._weight_total + weight_error) * (1 + margin)
        low_sent = (self._sent_total - sent_error) * (1 - margin)
        high_sent = (self._sent_total + sent_error) * (1 + margin)
        sent = self.sent.get(tenant, 0.0)
        if sent * high_weight < low_sent:
            return True  # light: never held
        if sent * low_weight <= high_sent or low_weight <= 0:
            return None
        # Heavy: it goes while the room exceeds the light tenants' reserve, which is at most every other active
        # tenant's share of the budget.
        if room > budget * (high_weight - weight) / low_weight * (1 + margin):
            return True
        return None

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def _scale(self, now: float) -> float:
        horizon = self.horizon_s
        if now - self._base > 50 * horizon:
            shrink = math.exp(-(now - self._base) / horizon)
            self.sent = {tenant: v * shrink for tenant, v in self.sent.items() if v * shrink > 1e-3}
            self._base = now
            self._resum()
        return math.exp((now - self._base) / horizon)

    def _add_sent(self, change: float, term: float) -> None:
        self._sent_total += change
        self._sent_drift += abs(change) + abs(term) + abs(self._sent_total)

    def _reweighed(self, tenant: str, old: float, new: float) -> None:
        """`tenant`'s weight in the active set went from `old` to `new` (0: not in it)."""
        sent = self.sent.get(tenant, 0.0)
        self._weight_total += new - old
        self._weight_drift += abs(new) + abs(old) + abs(self._weight_total)
        self._add_sent(sent * new - sent * old, sent * (new + old))

    def _resum(self) -> None:
        """The running totals summed afresh (exactly rounded) over the active tenants."""
        self._weight_total = math.fsum(self.weights.values())
        self._sent_total = math.fsum(self.sent.get(tenant, 0.0) * weight for tenant, weight in self.weights.items())
        self._weight_drift = self._weight_total
        self._sent_drift = self._sent_total

    def _prefilled(self, entry: _InFlight) -> None:
        if entry.prefill > 0:
            self.queued_prefill[entry.tenant] = max(0.0, self.queued_prefill[entry.tenant] - entry.prefill)
            entry.prefill = 0.0

    # RequestListener
    def on_commit(self, routed: Routed) -> None:
        return None

    def on_first_token(self, routed: Routed, now: float) -> None:
        entry = self._in_flight.get(id(routed))
        if entry is not None:
            self._prefilled(entry)

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        return None

    def on_finish(self, routed: Routed, now: float) -> None:
        entry = self._in_flight.pop(id(routed), None)
        if entry is None:
            return
        self._prefilled(entry)
        tenant = entry.tenant
        left = self.running[tenant] - 1
        if left > 0:
            self.running[tenant] = left
            return
        del self.running[tenant]
        self._reweighed(tenant, self.weights.pop(tenant), 0.0)
        self.queued_prefill.pop(tenant, None)


class BandShares:
    """Headroom for the more urgent bands: the less urgent ones cannot fill the prefill budget the more urgent ones'
    recent share of arrivals would use.

    Strict order between bands decides who goes first among the requests waiting together, but a request of the
    first band that arrives while the fleet is at the saturation threshold still waits — in the router for room,
    then on its replica behind the passes of prefill queued there — for what the default band already filled. So,
    as for light tenants (`TenantShares`), the budget (`hold_passes` x `kv_batch_tokens` per routable replica) is
    divided by demand: each band's **share** is the prompt tokens of its arrivals over those of all arrivals
    (decayed with `HORIZON_S`), and the bands more urgent than a request's band have in reserve their share of the
    budget less their own queued prefill (uncached prompt tokens of their dispatched requests without a first
    token). A request of band b is dispatched (or goes straight through) only while the fleet's room exceeds the
    reserve of the bands before b; the first band goes whenever the fleet has room, as without it.

    Nothing is held for a band that sent nothing lately (its share decays to nothing), so a fleet whose requests
    are all in one band is unchanged; what it holds back is at most the more urgent bands' unused share, which they
    fill as soon as they send. Like `TenantShares`, a `RequestListener` told of arrivals and dispatches by the
    caller.
    """

    def __init__(self, bands: int, horizon_s: float = HORIZON_S) -> None:
        self.horizon_s = horizon_s
        self.sent = [0.0] * bands
        """Per band: prompt tokens of its arrivals, decayed with `horizon_s`, kept scaled by e^((now - base) / h)."""
        self.queued_prefill = [0.0] * bands
        """Per band: uncached prompt tokens of its dispatched requests without a first token."""
        self._in_flight: dict[int, tuple[int, float]] = {}
        self._base = 0.0

    def arrived(self, flow: FlowClass, prompt_tokens: int, now: float) -> None:
        if prompt_tokens > 0:
            self.sent[flow.band] += prompt_tokens * self._scale(now)

    def routed(self, routed: Routed, flow: FlowClass) -> None:
        prefill = float(max(0, routed.prompt_tokens - routed.predicted_cached))
        self._in_flight[id(routed)] = (flow.band, prefill)
        self.queued_prefill[flow.band] += prefill

    def may_hold(self, band: int) -> bool:
        """Whether anything is held for the bands before `band` at all (some of them sent lately)."""
        return any(sent > 0 for sent in self.sent[:band])

    def reserves(self, budget: float) -> list[float]:
        """Per band: the prefill tokens held in reserve for the bands more urgent than it."""
        total = sum(self.sent)
        reserves = [0.0] * len(self.sent)
        if total <= 0:
            return reserves
        held = 0.0
        for band, sent in enumerate(self.sent):
            reserves[band] = held
            held += max(0.0, budget * sent / total - self.queued_prefill[band])
        return reserves

    def eligible(self, budget: float, room: float) -> Callable[[FlowClass], bool] | None:
        """Which flows may be dispatched now; None: every flow (no band is kept out of the room)."""
        held = [0 < reserve >= room for reserve in self.reserves(budget)]
        if not any(held):
            return None
        return lambda flow: not held[flow.band]

    def _scale(self, now: float) -> float:
        horizon = self.horizon_s
        if now - self._base > 50 * horizon:
            shrink = math.exp(-(now - self._base) / horizon)
            self.sent = [v * shrink if v * shrink > 1e-3 else 0.0 for v in self.sent]
            self._base = now
        return math.exp((now - self._base) / horizon)

    def _prefilled(self, key: int) -> None:
        entry = self._in_flight.get(key)
        if entry is not None and entry[1] > 0:
            band, prefill = entry
            self.queued_prefill[band] = max(0.0, self.queued_prefill[band] - prefill)
            self._in_flight[key] = (band, 0.0)

    # RequestListener
    def on_commit(self, routed: Routed) -> None:
        return None

    def on_first_token(self, routed: Routed, now: float) -> None:
        self._prefilled(id(routed))

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        return None

    def on_finish(self, routed: Routed, now: float) -> None:
        self._prefilled(id(routed))
        self._in_flight.pop(id(routed), None)


def both(
    first: Callable[[FlowClass], bool] | None, second: Callable[[FlowClass], bool] | None
) -> Callable[[FlowClass], bool] | None:
    """The flows both predicates accept (None accepts every flow)."""
    if first is None:
        return second
    if second is None:
        return first
    return lambda flow: first(flow) and second(flow)


__all__ = ["HORIZON_S", "BandShares", "TenantShares", "both"]
