"""The router's load picture per replica: its own accounting merged with what the engines report.

`LoadBook` is synchronous and clock-free, so the live router and virtual-time replay drive the same object:
`begin` when a request is sent (its uncached prompt tokens count as pending prefill), `first_token` when the
first token comes back (prefill done: the request now decodes), `finish` when it ends for any reason.
`observe_engine` records the last scrape of the engine's own gauges. `snapshot` gives a policy's `ReplicaLoad`.

Shared load. Several router instances in front of one fleet each count only what they routed themselves; the
load plane (`kvrouter.redisplane.loadplane`, or the replay's `--routers K`) hands every instance the others'
own counts per replica: `fold_peer(peer, replica, ...)` replaces that peer's last report for the replica (reports
are absolute, so a lost or repeated one does no lasting harm; it returns the rise of the peer's in-flight count,
which `kvrouter.routing.herding` counts as the peer's dispatches, and of its pending prefill tokens, which
kv_aware's prefill-progress estimate queues as the peer's requests), `drop_peer` forgets a peer whose reports
expired.
`snapshot` adds the peers' counts to this instance's and says how much of the pending prefill is theirs
(`ReplicaLoad.peer_pending_prefill_tokens`: a policy that follows its own requests' progress needs its own part).
`own` gives this instance's counts alone, which is what it publishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrouter.policies.base import ReplicaLoad
from kvrouter.typedefs import ReplicaName


@dataclass(slots=True)
class Ticket:
    """One routed request's share of a replica's load; hand it back to `first_token` and `finish`."""

    replica: ReplicaName
    prefill_tokens: int
    prefilling: bool = True
    done: bool = False


@dataclass(frozen=True, slots=True)
class PeerRise:
    """How much a peer's report on one replica rose over its previous one (0 where it fell): its dispatches since,
    net of what finished or reached its first token in between."""

    requests: int
    prefill_tokens: int


@dataclass(slots=True)
class EngineGauges:
    waiting: int
    running: int
    kv_usage: float


@dataclass(slots=True)
class _Counts:
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    decode_requests: int = 0


@dataclass(frozen=True, slots=True)
class OwnLoad:
    """What this instance alone has in flight on one replica: the unit the load plane publishes."""

    in_flight: int
    pending_prefill_tokens: int
    decode_requests: int


class LoadBook:
    def __init__(self) -> None:
        self._counts: dict[ReplicaName, _Counts] = {}
        self._engine: dict[ReplicaName, EngineGauges] = {}
        self._peers: dict[str, dict[ReplicaName, OwnLoad]] = {}
        self._peer_sum: dict[ReplicaName, _Counts] = {}

    def begin(self, replica: ReplicaName, prefill_tokens: int) -> Ticket:
        counts = self._counts.setdefault(replica, _Counts())
        counts.in_flight += 1
        counts.pending_prefill_tokens += prefill_tokens
        return Ticket(replica, prefill_tokens)

    def first_token(self, ticket: Ticket) -> None:
        if ticket.done or not ticket.prefilling:
            return
        ticket.prefilling = False
        counts = self._counts.setdefault(ticket.replica, _Counts())
        counts.pending_prefill_tokens -= ticket.prefill_tokens
        counts.decode_requests += 1

    def add_prefill(self, ticket: Ticket, tokens: int) -> int:
        """The request turns out to have `tokens` more to prefill (a predicted prefix hit the engine evicted before
        admitting it, kvrouter/routing/lost_hits.py); returns what was added (0 once it has its first token)."""
        if ticket.done or not ticket.prefilling or tokens <= 0:
            return 0
        ticket.prefill_tokens += tokens
        self._counts.setdefault(ticket.replica, _Counts()).pending_prefill_tokens += tokens
        return tokens

    def finish(self, ticket: Ticket) -> None:
        """Idempotent: a ticket is released exactly once whatever path ends the request."""
        if ticket.done:
            return
        counts = self._counts.setdefault(ticket.replica, _Counts())
        if ticket.prefilling:
            counts.pending_prefill_tokens -= ticket.prefill_tokens
        else:
            counts.decode_requests -= 1
        counts.in_flight -= 1
        ticket.done = True

    def observe_engine(self, replica: ReplicaName, gauges: EngineGauges | None) -> None:
        if gauges is None:
            self._engine.pop(replica, None)
        else:
            self._engine[replica] = gauges

    def forget(self, replica: ReplicaName) -> None:
        """The replica left the fleet; outstanding tickets still finish harmlessly."""
        self._engine.pop(replica, None)

    def snapshot(self, replica: ReplicaName) -> ReplicaLoad:
        counts = self._counts.get(replica) or _Counts()
        peers = self._peer_sum.get(replica) or _Counts()
        engine = self._engine.get(replica)
        return ReplicaLoad(
            in_flight=counts.in_flight + peers.in_flight,
            pending_prefill_tokens=counts.pending_prefill_tokens + peers.pending_prefill_tokens,
            decode_requests=counts.decode_requests + peers.decode_requests,
            engine_waiting=engine.waiting if engine else None,
            engine_running=engine.running if engine else None,
            kv_usage=engine.kv_usage if engine else None,
            peer_pending_prefill_tokens=peers.pending_prefill_tokens,
        )

    def own_in_flight(self, replica: ReplicaName) -> int:
        """Requests this instance has in flight on `replica` (what it can wait for; peers' not included)."""
        counts = self._counts.get(replica)
        return counts.in_flight if counts is not None else 0

    def in_flight_total(self) -> int:
        return sum(counts.in_flight for counts in self._counts.values())

    # -- shared load -----------------------------------------------------------------------------------------

    def own(self) -> dict[ReplicaName, OwnLoad]:
        """This instance's own counts, per replica it ever routed to (zeros included: a peer must hear them)."""
        return {
            replica: OwnLoad(counts.in_flight, counts.pending_prefill_tokens, counts.decode_requests)
            for replica, counts in self._counts.items()
        }

    def fold_peer(self, peer: str, replica: ReplicaName, load: OwnLoad) -> PeerRise:
        """`peer`'s latest own counts on `replica`, replacing its previous report (validated by the caller).
        Returns how many more requests and pending prefill tokens the peer has there than it last reported."""
        reports = self._peers.setdefault(peer, {})
        previous = reports.get(replica) or OwnLoad(0, 0, 0)
        self._shift(replica, previous, -1)
        reports[replica] = load
        self._shift(replica, load, 1)
        return PeerRise(
            max(0, load.in_flight - previous.in_flight),
            max(0, load.pending_prefill_tokens - previous.pending_prefill_tokens),
        )

    def drop_peer(self, peer: str) -> None:
        """`peer` stopped reporting (expired or left): its share no longer counts anywhere."""
        for replica, load in self._peers.pop(peer, {}).items():
            self._shift(replica, load, -1)

    def peers(self) -> list[str]:
        return sorted(self._peers)

    def peer_in_flight(self) -> int:
        return sum(counts.in_flight for counts in self._peer_sum.values())

    def _shift(self, replica: ReplicaName, load: OwnLoad | None, sign: int) -> None:
        if load is None:
            return
        total = self._peer_sum.setdefault(replica, _Counts())
        total.in_flight += sign * load.in_flight
        total.pending_prefill_tokens += sign * load.pending_prefill_tokens
        total.decode_requests += sign * load.decode_requests
