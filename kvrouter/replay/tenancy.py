"""Tenants and priorities for a replayed trace (`kvrouter replay --tenants N --noisy-share X --priority-share P`).

Deterministic from the seed. `tenants` regular tenants `t0`..: each conversation (a request's first two trace
blocks, chained: the system prompt and the conversation's opening) belongs to one tenant, drawn when the
conversation first appears, so a tenant's turns stay together. `noisy_share` adds a tenant `noisy` that sends that
share of all arrivals: copies of the trace's own requests (same lengths, arrival times spread evenly over the
trace's requests, a private prefix space mirroring the trace's sharing), so the other tenants' traffic is exactly
the trace without it. `priority_share` of the requests, drawn per request, are in the first (most urgent) band;
the rest in `default_band`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvrouter.replay.trace import Trace, TraceRequest

NOISY_TENANT = "noisy"


@dataclass(frozen=True, slots=True)
class Tenancy:
    tenants: int = 0
    noisy_share: float = 0.0
    priority_share: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tenants < 0 or not 0 <= self.noisy_share < 1 or not 0 <= self.priority_share <= 1:
            raise ValueError("tenants must be >= 0, noisy_share in [0, 1) and priority_share in [0, 1]")

    @property
    def active(self) -> bool:
        return self.tenants > 0 or self.noisy_share > 0 or self.priority_share > 0


@dataclass(frozen=True, slots=True)
class Assigned:
    trace: Trace
    tenant: dict[int, str]
    """Tenant per request index."""
    urgent: frozenset[int]
    """Indices of requests in the most urgent band."""


def assign(trace: Trace, tenancy: Tenancy) -> Assigned:
    requests = list(trace.requests)
    rng = random.Random(f"tenancy-{tenancy.seed}")
    tenant: dict[int, str] = {}
    conversation: dict[int, str] = {}
    for request in requests:
        if tenancy.tenants <= 0:
            tenant[request.index] = "anonymous"
            continue
        key = request.chain[min(1, len(request.chain) - 1)] if request.chain else -1
        owner = conversation.get(key)
        if owner is None:
            owner = f"t{rng.randrange(tenancy.tenants)}"
            conversation[key] = owner
        tenant[request.index] = owner
    if tenancy.noisy_share > 0 and requests:
        copies = _noisy(requests, tenancy.noisy_share)
        for copy in copies:
            tenant[copy.index] = NOISY_TENANT
        requests = sorted(requests + copies, key=lambda request: (request.arrival, request.index))
    urgent = frozenset(
        request.index for request in requests if tenancy.priority_share > 0 and rng.random() < tenancy.priority_share
    )
    return Assigned(replace(trace, requests=tuple(requests)), tenant, urgent)


def _noisy(requests: list[TraceRequest], share: float) -> list[TraceRequest]:
    count = round(share / (1 - share) * len(requests))
    top = max((max(request.chain, default=0) for request in requests), default=0) + 1
    first_index = max(request.index for request in requests) + 1
    copies = []
    for number in range(count):
        source = requests[number * len(requests) // count]
        copies.append(
            TraceRequest(
                index=first_index + number,
                arrival=source.arrival,
                input_length=source.input_length,
                output_length=source.output_length,
                chain=tuple(top + block for block in source.chain),
            )
        )
    return copies


__all__ = ["NOISY_TENANT", "Assigned", "Tenancy", "assign"]
