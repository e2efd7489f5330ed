"""The router's load picture per replica: its own accounting merged with what the engines report.

`LoadBook` is synchronous and clock-free, so the live router and virtual-time replay drive the same object:
`begin` when a request is sent (its uncached prompt tokens count as pending prefill), `first_token` when the
first token comes back (prefill done: the request now decodes), `finish` when it ends for any reason.
`observe_engine` records the last scrape of the engine's own gauges. `snapshot` gives a policy's `ReplicaLoad`.
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


class LoadBook:
    def __init__(self) -> None:
        self._counts: dict[ReplicaName, _Counts] = {}
        self._engine: dict[ReplicaName, EngineGauges] = {}

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
        engine = self._engine.get(replica)
        return ReplicaLoad(
            in_flight=counts.in_flight,
            pending_prefill_tokens=counts.pending_prefill_tokens,
            decode_requests=counts.decode_requests,
            engine_waiting=engine.waiting if engine else None,
            engine_running=engine.running if engine else None,
            kv_usage=engine.kv_usage if engine else None,
        )

    def in_flight_total(self) -> int:
        return sum(counts.in_flight for counts in self._counts.values())
