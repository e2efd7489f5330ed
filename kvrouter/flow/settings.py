"""The `flow:` section of replicas.yaml: when requests wait in the router, in which bands, and how tenants share.

    flow:
      enabled: true                 # KVROUTER_FLOW_CONTROL overrides it
      hold_passes: 2.0              # a replica is saturated with this many engine passes of prefill queued
      max_seqs: 256                 # ... or with this many requests in flight (vLLM's --max-num-seqs; null: off)
      engine_waiting: null          # ... or with this many requests waiting in the engine (scraped; off)
      kv_usage: null                # ... or with its KV cache this full (scraped, 0..1; off)
      default_band: normal
      bands:                        # most urgent first; strict order, with an anti-starvation guard
        - {name: high, ttl_s: 30, max_queue: 1024}
        - {name: normal, ttl_s: 60, max_queue: 4096}
        - {name: low, ttl_s: 120, max_queue: 4096}
      starvation_s: 10              # a request waiting this long is starving ...
      starvation_share: 0.1         # ... and every 10th dispatch goes to the oldest starving one
      fail_fast: true               # a request predicted to wait past its TTL gets its 429 at once
      engine_priority: false        # write the header's band into the body's `priority` for the engines
      fair_horizon_s: null          # null: VTC's counters; a number: service decays with that time constant
      tenant_headroom: true         # a heavy tenant cannot fill the light tenants' unused share of the budget
      band_headroom: false          # true: a band cannot fill the more urgent bands' unused share of the budget
      band_kv_reserve: true         # each replica keeps the more urgent bands' largest recent prompt's KV free ...
      kv_capacity_tokens: null      # ... given the engines' KV cache in tokens (num_gpu_blocks x block_size)
      tenant_from: [header, api_key, user]
      tenants:                      # weights for fair sharing (others weigh 1)
        team-a: {weight: 2, api_keys: ["sk-..."]}

Why two passes: the engine computes at most `kv_batch_tokens` prompt tokens per pass and the router hears of a
pass's end (first tokens) when it happens, so the pass in progress plus one full pass ready behind it keep an
engine busy until the router can send more, whatever the error of the router's estimate of the progress made on
the request in progress (up to a pass). Anything beyond that only waits in an engine queue, where nobody can
reorder it or move it elsewhere. One pass leaves passes short when the estimate runs ahead; on the held-out
Mooncake synthetic trace (docs/benchmarks.md, "Router queue") 2 was the better of 0.5 / 1 / 2 / 4 at ×2.7, ×3.0
and ×3.3.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TenantSource = Literal["header", "api_key", "user"]
DEFAULT_TENANT_FROM: tuple[TenantSource, ...] = ("header", "api_key", "user")

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"
"""Band and tenant names: what a header may carry and a metric label may show."""


class BandConfig(BaseModel):
    """One priority band of the router queue (`flow.bands`, most urgent first)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="Band name (the x-kvrouter-priority header's value).")
    ttl_s: float = Field(default=60.0, gt=0, le=3600, description="Longest wait in the router queue; then 429.")
    max_queue: int = Field(default=4096, ge=0, le=1_000_000, description="Requests the band may hold; then 429.")


class TenantConfig(BaseModel):
    """A tenant's share of service and the API keys that identify it (`flow.tenants`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(default=1.0, gt=0, le=1000, description="Share of service relative to other tenants.")
    api_keys: list[str] = Field(default_factory=list, description="Client API keys that identify this tenant.")


def _default_bands() -> list[BandConfig]:
    return [
        BandConfig(name="high", ttl_s=30.0, max_queue=1024),
        BandConfig(name="normal", ttl_s=60.0, max_queue=4096),
        BandConfig(name="low", ttl_s=120.0, max_queue=4096),
    ]


class FlowConfig(BaseModel):
    """The `flow:` section: the router queue (docs/flow-control.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Hold requests in the router when every replica is saturated.")
    hold_passes: float = Field(
        default=2.0, gt=0, le=64, description="Engine passes of queued prefill (x kv_batch_tokens) that saturate."
    )
    max_seqs: int | None = Field(
        default=None,
        ge=1,
        description="The engines' --max-num-seqs: a replica with this many requests in flight is saturated "
        "(null: not used; the replay takes it from its engines).",
    )
    engine_waiting: int | None = Field(
        default=None, ge=1, description="Engine-reported waiting requests that saturate a replica (null: not used)."
    )
    kv_usage: float | None = Field(
        default=None, gt=0, le=1, description="Engine-reported KV usage that saturates a replica (null: not used)."
    )
    bands: list[BandConfig] = Field(
        default_factory=_default_bands,
        min_length=1,
        max_length=16,
        description="Priority bands, most urgent first; strict between bands, except for starvation_s.",
    )
    default_band: str = Field(default="normal", description="Band of a request that names none (or an unknown one).")
    starvation_s: float = Field(
        default=10.0, gt=0, description="A request queued this long is starving: the guard below serves it."
    )
    starvation_share: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Share of dispatches that go to the oldest starving request, whatever its band (no starvation).",
    )
    fair_horizon_s: float | None = Field(
        default=None,
        gt=0,
        description="Fair sharing over a horizon: a tenant's service decays with this time constant and the least "
        "served backlogged tenant goes next (null: VTC's counters, among the tenants waiting together).",
    )
    tenant_headroom: bool = Field(
        default=True,
        description="Keep room for light tenants: while a tenant takes more than its weighted share of recent "
        "service, it is not dispatched into the part of the prefill budget (hold_passes x kv_batch_tokens per "
        "replica) that is the other active tenants' share and still unused (docs/flow-control.md).",
    )
    band_headroom: bool = Field(
        default=False,
        description="Keep room for the more urgent bands: a request is not dispatched into the part of the prefill "
        "budget that is the more urgent bands' share of recent arrivals (prompt tokens) and still unused by them "
        "(docs/flow-control.md). Nothing changes while every request is in one band.",
    )
    band_kv_reserve: bool = Field(
        default=True,
        description="Keep KV room for the more urgent bands: a request is dispatched only while some replica with "
        "room keeps free the KV cache the more urgent bands' largest prompt of the last minute needs, and is routed "
        "among the replicas keeping it (docs/flow-control.md). Needs kv_capacity_tokens (the replay takes it from "
        "its engines) and scraped KV usage; nothing changes while every request is in one band.",
    )
    kv_capacity_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Each engine's KV cache in tokens (vLLM's num_gpu_blocks x block_size), for band_kv_reserve "
        "(null: unknown, so no reserve live; the replay takes it from its engines).",
    )
    fail_fast: bool = Field(
        default=True,
        description="Refuse at once (429, Retry-After) a request whose predicted wait exceeds its band's TTL.",
    )
    engine_priority: bool = Field(
        default=False,
        description="When a request names its band only by x-kvrouter-priority (no 'priority' in the body), "
        "write the band into the body's 'priority' (vLLM's field: the band's distance from default_band, "
        "e.g. -1 for high) so engines run with --scheduling-policy priority order by it too. Off: bodies go "
        "unchanged (vLLM's default fcfs policy refuses a nonzero 'priority' with a 400).",
    )
    tenant_from: list[TenantSource] = Field(
        default_factory=lambda: list(DEFAULT_TENANT_FROM),
        description="Where a request's tenant comes from, first match wins: x-kvrouter-tenant, API key, 'user'.",
    )
    tenants: dict[str, TenantConfig] = Field(default_factory=dict, description="Weights and API keys per tenant.")
    max_tenants: int = Field(
        default=10_000, ge=1, description="Distinct tenants tracked for fairness; beyond it new ones share one."
    )

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in tenants:
            if re.fullmatch(NAME_PATTERN, name) is None:
                raise ValueError(f"tenant name {name!r}: use letters, digits and _.:- (at most 64)")
        return tenants

    @model_validator(mode="after")
    def _consistent(self) -> FlowConfig:
        names = [band.name for band in self.bands]
        if len(set(names)) != len(names):
            raise ValueError(f"band names must be unique, got {names}")
        if self.default_band not in names:
            raise ValueError(f"default_band {self.default_band!r} is not one of the bands {names}")
        keys = [key for tenant in self.tenants.values() for key in tenant.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key is listed under two tenants")
        if len(set(self.tenant_from)) != len(self.tenant_from):
            raise ValueError(f"tenant_from lists a source twice: {self.tenant_from}")
        return self

    @property
    def default_band_index(self) -> int:
        return [band.name for band in self.bands].index(self.default_band)


__all__ = ["BandConfig", "FlowConfig", "TenantConfig", "TenantSource"]
