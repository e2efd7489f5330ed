"""The router's queue: priority bands, weighted fair sharing of served tokens per tenant, TTLs and lengths.

Pure and synchronous; `now` is the caller's clock (monotonic live, virtual in replay), the payload is whatever the
caller needs to dispatch a waiter (a future live, a trace position in replay).

Order. Bands are strict — a request of a more urgent band goes first — with one guard against starvation: while
some waiter has been queued `starvation_s` or longer, every (1 / `starvation_share`)-th dispatch goes to the oldest
such waiter whatever its band, so a band that more urgent traffic would otherwise shut out keeps that share of the
fleet (10% by default) and moves. Inside a band, tenants share in the
spirit of VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24): each tenant has a counter
of the service it received — prompt tokens computed and tokens generated (`charge`), divided by its weight — and
the backlogged tenant with the lowest counter is served next, first come first served within the tenant. Two
ways to keep the counters (`fair_horizon_s`):
- VTC's own (null, the default): a tenant that becomes backlogged is lifted to the lowest counter among the
  band's backlogged tenants, so idle time banks no credit, and the counters start over when the band's queue
  empties (fairness among the tenants waiting together). No backlogged tenant's counter is ever more than about
  one request's service above another's, so none waits long behind the others: the bound is why it is the default.
  A light tenant's burst shares equally with a heavy tenant's backlog.
- decayed (a number of seconds): service decays exponentially with that time constant, so the counter is a
  tenant's recent use, and a tenant that used little lately goes ahead of one that has been taking the fleet
  until their recent use is level. There is no bound the other way: a tenant whose burst was heavy waits until its
  use has decayed below the others'. On the held-out Mooncake synthetic trace with a tenant sending half of all
  arrivals, 30 s cut the other tenants' TTFT p99 further than VTC's; on the conversation trace one regular tenant
  with heavy bursts then waited up to 41 s (docs/benchmarks.md, "Router queue").
Tenants tracked per band are capped (`max_tenants`); beyond it new ones share one.

Limits. A band holds at most `max_queue` waiters (`push` returns None past it: the caller answers 429), and a
waiter is held at most its band's `ttl_s` (`expire` hands back the ones past it: 429 with Retry-After).
`predicted_wait` says how long a new waiter would wait — the waiters ahead of it times the recent time between
dispatches while the queue was backlogged — so the caller can refuse at once a request that would only expire
(`fail_fast`) instead of holding it for a whole TTL first. `cancel` takes out a waiter whose client left; it costs
nothing but a mark (waiters are dropped lazily).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from kvrouter.flow.classes import FlowClass
from kvrouter.flow.settings import FlowConfig

T = TypeVar("T")
WaiterState = Literal["queued", "dispatched", "expired", "cancelled"]
OVERFLOW_TENANT = "~overflow"
MIN_GAPS = 32
"""Dispatches seen before `predicted_wait` says anything."""
GAP_HORIZON = 256
"""Dispatches over which the mean time between dispatches is averaged (then decays)."""


@dataclass(slots=True, eq=False)
class Waiter(Generic[T]):
    payload: T
    flow: FlowClass
    fair_id: str
    """The tenant id fairness uses (the flow's tenant, or the shared overflow id past `max_tenants`)."""
    enqueued: float
    deadline: float
    state: WaiterState = "queued"
    dispatched_at: float | None = None

    def waited(self, now: float) -> float:
        end = self.dispatched_at if self.dispatched_at is not None else now
        return max(0.0, end - self.enqueued)


@dataclass(slots=True)
class _Band(Generic[T]):
    name: str
    ttl_s: float
    max_queue: int
    order: deque[Waiter[T]] = field(default_factory=deque)
    """Every waiter in arrival order (= deadline order), dispatched or cancelled ones dropped lazily."""
    tenants: dict[str, deque[Waiter[T]]] = field(default_factory=dict)
    virtual: dict[str, float] = field(default_factory=dict)
    queued: int = 0

    def head(self) -> Waiter[T] | None:
        order = self.order
        while order and order[0].state != "queued":
            order.popleft()
        return order[0] if order else None

    def tenant_head(self, tenant: str) -> Waiter[T] | None:
        waiting = self.tenants.get(tenant)
        while waiting and waiting[0].state != "queued":
            waiting.popleft()
        if not waiting:
            self.tenants.pop(tenant, None)
            return None
        return waiting[0]


class FlowQueue(Generic[T]):
    def __init__(self, config: FlowConfig) -> None:
        self.config = config
        self.bands: list[_Band[T]] = [_Band(band.name, band.ttl_s, band.max_queue) for band in config.bands]
        self.starvation_s = config.starvation_s
        self._starving_every = max(1, round(1 / config.starvation_share))
        self._turn = 0
        self._horizon_s = config.fair_horizon_s
        self._base = 0.0
        self._queued = 0
        self._backlog_since = 0.0
        """When the queue last went from empty to non-empty (or the last dispatch, whichever is later)."""
        self._gap_s = 0.0
        self._gaps = 0
        """A decayed mean of the time between dispatches while something waited, and how many it has seen."""

    def __len__(self) -> int:
        return sum(band.queued for band in self.bands)

    def lengths(self) -> dict[str, int]:
        return {band.name: band.queued for band in self.bands}

    def predicted_wait(self, flow: FlowClass) -> float | None:
        """How long a request of `flow` queued now would wait: the waiters ahead of it (its band and the more
        urgent ones) times the recent time between dispatches while the queue was backlogged; None until a few
        dozen dispatches were seen."""
        if self._gaps < MIN_GAPS:
            return None
        ahead = sum(band.queued for band in self.bands[: flow.band + 1])
        return (ahead + 1) * self._gap_s

    def push(self, payload: T, flow: FlowClass, now: float) -> Waiter[T] | None:
        """Queue `payload`; None when its band is full."""
        band = self.bands[flow.band]
        if band.queued >= band.max_queue:
            return None
        if self._queued == 0:
            self._backlog_since = now
        self._queued += 1
        fair_id = flow.tenant
        if fair_id not in band.virtual and len(band.virtual) >= self.config.max_tenants:
            fair_id = OVERFLOW_TENANT
        waiter = Waiter(payload, flow, fair_id, now, now + band.ttl_s)
        if band.tenant_head(fair_id) is None:
            band.virtual.setdefault(fair_id, 0.0)
            if self._horizon_s is None:
                # Newly backlogged: lifted to the band's lowest backlogged counter (idle time banks no credit).
                floor = min((band.virtual.get(t, 0.0) for t in band.tenants), default=None)
                current = band.virtual.get(fair_id, 0.0)
                band.virtual[fair_id] = current if floor is None else max(current, floor)
            band.tenants[fair_id] = deque()
        band.tenants[fair_id].append(waiter)
        band.order.append(waiter)
        band.queued += 1
        return waiter

    def pop(self, now: float, eligible: Callable[[FlowClass], bool] | None = None) -> Waiter[T] | None:
        """The next waiter to dispatch, marked dispatched; None when nothing waits. `eligible`: only tenants whose
        head's flow it accepts are considered (`TenantShares.eligible`: held-back heavy tenants are skipped)."""
        starving: Waiter[T] | None = None
        for band in self.bands:
            head = band.head()
            starved = head is not None and now - head.enqueued >= self.starvation_s
            if starved and head is not None and (starving is None or head.enqueued < starving.enqueued):
                starving = head
        if starving is not None and eligible is not None and not eligible(starving.flow):
            starving = None
        self._turn += 1
        if starving is not None and self._turn >= self._starving_every:
            # The guard's share of dispatches, not all of them: under sustained overload every head of a lower
            # band is old, and a guard that always won would turn the bands upside down.
            self._turn = 0
            return self._take(self.bands[starving.flow.band], starving, now)
        for band in self.bands:
            if band.queued == 0:
                continue
            best: Waiter[T] | None = None
            best_virtual = 0.0
            for tenant in list(band.tenants):
                head = band.tenant_head(tenant)
                if head is None or (eligible is not None and not eligible(head.flow)):
                    continue
                virtual = band.virtual.get(tenant, 0.0)
                if (
                    best is None
                    or virtual < best_virtual
                    or (virtual == best_virtual and head.enqueued < best.enqueued)
                ):
                    best, best_virtual = head, virtual
            if best is not None:
                return self._take(band, best, now)
        return None

    def waiting_weights(self) -> dict[str, float]:
        """The weight of each tenant with a queued request (its head's flow), for `TenantShares`."""
        weights: dict[str, float] = {}
        for band in self.bands:
            for tenant in list(band.tenants):
                head = band.tenant_head(tenant)
                if head is not None:
                    weights[head.flow.tenant] = head.flow.weight
        return weights

    def _take(self, band: _Band[T], waiter: Waiter[T], now: float) -> Waiter[T]:
        waiter.state = "dispatched"
        waiter.dispatched_at = now
        gap = max(0.0, now - self._backlog_since)
        self._gap_s = gap if self._gaps == 0 else self._gap_s + (gap - self._gap_s) / min(self._gaps + 1, GAP_HORIZON)
        self._gaps += 1
        self._backlog_since = now
        self._left(band, waiter)
        return waiter

    def _left(self, band: _Band[T], waiter: Waiter[T]) -> None:
        self._queued -= 1
        band.queued -= 1
        band.tenant_head(waiter.fair_id)  # drops it from its tenant's deque when it was the head
        if band.queued == 0:
            band.order.clear()
            band.tenants.clear()
            if self._horizon_s is None:
                band.virtual.clear()
            elif len(band.virtual) > self.config.max_tenants // 2:
                # Decayed usage is history worth keeping, but not for tenants whose use has faded out.
                scale = self._scale(waiter.dispatched_at or waiter.enqueued)
                band.virtual = {t: v for t, v in band.virtual.items() if v / scale >= 1.0}

    def cancel(self, waiter: Waiter[T]) -> bool:
        """Take out a queued waiter (its client left); False when it was no longer queued."""
        if waiter.state != "queued":
            return False
        waiter.state = "cancelled"
        self._left(self.bands[waiter.flow.band], waiter)
        return True

    def expire(self, now: float) -> list[Waiter[T]]:
        """Waiters past their band's TTL, taken out."""
        gone: list[Waiter[T]] = []
        for band in self.bands:
            head = band.head()
            while head is not None and head.deadline <= now:
                head.state = "expired"
                self._left(band, head)
                gone.append(head)
                head = band.head()
        return gone

    def drain(self) -> list[Waiter[T]]:
        """Every queued waiter, taken out (the fleet can no longer serve them)."""
        gone = [waiter for band in self.bands for waiter in band.order if waiter.state == "queued"]
        for waiter in gone:
            waiter.state = "expired"
            self._left(self.bands[waiter.flow.band], waiter)
        return gone

    def next_deadline(self) -> float | None:
        deadlines = [head.deadline for head in map(_Band.head, self.bands) if head is not None]
        return min(deadlines, default=None)

    def _scale(self, now: float) -> float:
        """Decay mode: counters are kept multiplied by e^((now - base) / horizon), so comparing stored values at
        one moment compares decayed usage; rebased before the factor grows large."""
        horizon = self._horizon_s
        if horizon is None:
            return 1.0
        if now - self._base > 50 * horizon:
            shrink = math.exp(-(now - self._base) / horizon)
            for band in self.bands:
                band.virtual = {t: v * shrink for t, v in band.virtual.items()}
            self._base = now
        return math.exp((now - self._base) / horizon)

    def charge(self, flow: FlowClass, tokens: float, now: float) -> None:
        """`flow`'s tenant was served `tokens` (prompt tokens computed at dispatch, tokens generated at the end)."""
        if tokens <= 0:
            return
        band = self.bands[flow.band]
        fair_id = flow.tenant if flow.tenant in band.virtual else None
        if fair_id is None:
            if band.queued == 0 and self._horizon_s is None:
                return  # nothing waits in this band: no counter to keep
            fair_id = flow.tenant if len(band.virtual) < self.config.max_tenants else OVERFLOW_TENANT
        band.virtual[fair_id] = band.virtual.get(fair_id, 0.0) + tokens / flow.weight * self._scale(now)

    def waiting(self) -> Iterator[Waiter[T]]:
        for band in self.bands:
            for waiter in band.order:
                if waiter.state == "queued":
                    yield waiter

    def position(self, waiter: Waiter[T], now: float) -> dict[str, Any]:
        """Where a queued waiter stands, for /debug."""
        band = self.bands[waiter.flow.band]
        ahead_in_tenant = 0
        for other in band.tenants.get(waiter.fair_id, ()):
            if other is waiter:
                break
            if other.state == "queued":
                ahead_in_tenant += 1
        return {
            "band": band.name,
            "tenant": waiter.flow.label,
            "state": waiter.state,
            "waited_s": round(waiter.waited(now), 4),
            "expires_in_s": round(max(0.0, waiter.deadline - now), 4),
            "ahead_in_tenant": ahead_in_tenant,
            "queued_in_band": band.queued,
            "queued_in_more_urgent_bands": sum(b.queued for b in self.bands[: waiter.flow.band]),
            "tenant_service": round(band.virtual.get(waiter.fair_id, 0.0) / self._scale(now), 1),
        }


__all__ = ["OVERFLOW_TENANT", "FlowQueue", "Waiter"]
