"""What a load test sends: the workload knobs, and a schedule's sessions and planned requests.

Shared by the synthetic workloads (`workloads.py`) and the Mooncake trace workload (`trace.py`), which both build
schedules of these; its own module so that neither has to import the other's internals (no import circle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Endpoint = Literal["chat", "completion"]
Body = dict[str, Any]


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    """Every knob of every workload; a workload reads the ones it needs."""

    seed: int = 0
    duration_s: float = 60.0
    rate: float = 2.0
    """Sessions starting per second (Poisson arrivals)."""
    tenants: int = 120
    tenant_skew: float = 0.6
    """Zipf exponent of tenant popularity (0: uniform)."""
    system_tokens: int = 3000
    tools_per_tenant: int = 6
    user_tokens: int = 40
    output_tokens: int = 64
    turns: int = 5
    think_s: float = 2.0
    """Mean pause between a response and the session's next request."""
    tool_result_tokens: int = 1500
    hot_share: float = 0.5
    hot_at: float = 1 / 3
    """Fraction of the duration after which the hot tenant takes `hot_share` of the traffic."""
    trace: Path | None = None
    trace_speedup: float = 1.0
    """Trace seconds per wall-clock second (10: the trace plays ten times faster)."""
    trace_start_s: float = 0.0
    """Offset into the trace where the replayed slice starts."""
    trace_block_tokens: int = 512
    vocab_low: int = 8
    """Token ids for trace prompts are drawn from [vocab_low, vocab_high): no special tokens."""
    vocab_high: int = 8192


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    endpoint: Endpoint
    make_body: Callable[[], Body]
    """The request body without `model` and `stream` (the sender adds them); built lazily to spare memory."""
    label: str
    """Groups the request in statistics (Locust's `name`)."""
    max_tokens: int
    think_s: float = 0.0
    """Pause between the previous request of the session finishing and this one being sent."""


@dataclass(frozen=True, slots=True)
class Session:
    start_s: float
    requests: tuple[PlannedRequest, ...]
    key: str
    """Tenant or conversation the session belongs to (for reports)."""
