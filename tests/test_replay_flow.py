"""The router queue on the replay's virtual clock: it holds while the engines are saturated, never loses a
request, bounds the wait by the TTL, orders bands, and shares service fairly between tenants (kvrouter.flow)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvrouter.config import Settings
from kvrouter.flow.settings import BandConfig, FlowConfig, TenantConfig
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, ReplayResult, VirtualClock, replay_policy
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.report import summarize
from kvrouter.replay.tenancy import NOISY_TENANT, Tenancy, assign
from kvrouter.replay.trace import Trace, load_trace
from kvrouter.sim.mocker import DynamoMockerEngine
from tests.shared_data import MOONCAKE_CONVERSATION, shared


def replay(
    trace: Trace,
    flow: FlowConfig | None,
    *,
    tenants: Mapping[int, str] | None = None,
    urgent: frozenset[int] = frozenset(),
    replicas: int = 2,
) -> ReplayResult:
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    options = ReplayOptions(replicas=replicas, flow=flow, tenants=tenants, urgent=urgent)
    return replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=replay_policy_object("kv_aware", Settings(), clock),
        engine_factory=DynamoMockerEngine,
        options=options,
        clock=clock,
    )


@pytest.fixture(scope="module")
def overloaded() -> Trace:
    """600 conversation requests at x8 on two engines: far over capacity."""
    return load_trace(shared(MOONCAKE_CONVERSATION), speedup=8.0, limit=600)


def test_the_queue_holds_and_every_request_ends_once(overloaded: Trace) -> None:
    result = replay(overloaded, FlowConfig())
    records = result.records
    assert [r.index for r in records] == [r.index for r in overloaded.requests]
    assert sum(r.queued_s > 0 for r in records) > 100  # it held
    for record in records:
        if record.rejected is None:
            assert record.first_token is not None and record.finish is not None
            assert record.arrival + record.queued_s <= record.first_token <= record.finish
            # The TTFT splits into the router queue, the engine's queue and the engine's own time, exactly.
            assert record.admitted is not None and record.engine_wait is not None
            assert record.arrival + record.queued_s + record.engine_wait == pytest.approx(record.admitted)
        else:
            assert record.first_token is None and record.replica == "" and record.engine_wait is None
    summary = summarize(result)
    assert summary["completed"] + sum(summary["flow"]["rejected"].values()) == summary["scheduled"]
    tail = summary["tail"]
    assert tail["queued_mean"] > 0
    parts = tail["queued_mean"] + tail["engine_wait_mean"] + tail["in_engine_mean"]
    assert parts == pytest.approx(tail["ttft_mean"])


def test_a_short_ttl_bounds_the_wait_and_rejects_the_rest(overloaded: Trace) -> None:
    flow = FlowConfig(bands=[BandConfig(name="normal", ttl_s=2.0)], fail_fast=False)
    result = replay(overloaded, flow)
    rejected = [r for r in result.records if r.rejected is not None]
    assert rejected and all(r.rejected == "ttl" for r in rejected)
    assert max(r.queued_s for r in result.records) <= 2.0 + 1e-9
    # Failing fast, most of the requests that would have expired are refused on arrival instead.
    fast = replay(overloaded, flow.model_copy(update={"fail_fast": True}))
    reasons = [r.rejected for r in fast.records if r.rejected is not None]
    assert reasons.count("predicted_ttl") > reasons.count("ttl")
    assert max(r.queued_s for r in fast.records) <= 2.0 + 1e-9
    full = replay(overloaded, FlowConfig(bands=[BandConfig(name="normal", max_queue=5)]))
    assert any(r.rejected == "queue_full" for r in full.records)


def test_without_saturation_nothing_waits(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 500 * number, "input_length": 4000, "output_length": 20, "hash_ids": [0, number * 8 + 1]}
        for number in range(200)
    ]
    path = tmp_path / "light.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    light = load_trace(path)
    result = replay(light, FlowConfig(), replicas=2)
    assert all(r.queued_s == 0 and r.rejected is None for r in result.records)
    burst = load_trace(path, speedup=200.0)
    assert sum(r.queued_s > 0 for r in replay(burst, FlowConfig(), replicas=2).records) > 50


def test_the_urgent_band_goes_first(overloaded: Trace) -> None:
    urgent = frozenset(request.index for request in overloaded.requests if request.index % 5 == 0)
    result = replay(overloaded, FlowConfig(), urgent=urgent)
    summary = summarize(result)["flow"]["bands"]
    assert summary["high"]["ttft_p50"] < summary["normal"]["ttft_p50"] / 2
    assert summary["high"]["rejected"] == 0


def test_a_noisy_tenant_gets_its_share_and_the_others_theirs(overloaded: Trace) -> None:
    assigned = assign(overloaded, Tenancy(tenants=3, noisy_share=0.5, seed=1))
    noisy = sum(tenant == NOISY_TENANT for tenant in assigned.tenant.values())
    assert noisy == len(overloaded.requests)  # half of all arrivals
    fair = summarize(replay(assigned.trace, FlowConfig(), tenants=assigned.tenant))["flow"]["tenants"]
    unfair = replay(assigned.trace, FlowConfig(tenant_from=[]), tenants=None)
    # With tenants the noisy one waits for its own backlog; the others get through sooner than in one FCFS queue.
    plain = {r.index: r for r in unfair.records}
    others = [index for index, tenant in assigned.tenant.items() if tenant != NOISY_TENANT]
    shared_fcfs = sorted(plain[index].queued_s for index in others)
    assert fair["t0"]["queued_p99"] < shared_fcfs[int(0.99 * (len(shared_fcfs) - 1))]
    assert fair[NOISY_TENANT]["queued_p99"] > fair["t0"]["queued_p99"]


def test_tenancy_is_deterministic_and_keeps_conversations_together(overloaded: Trace) -> None:
    first = assign(overloaded, Tenancy(tenants=4, priority_share=0.2, seed=3))
    again = assign(overloaded, Tenancy(tenants=4, priority_share=0.2, seed=3))
    assert first.tenant == again.tenant and first.urgent == again.urgent
    by_conversation: dict[int, set[str]] = {}
    for request in overloaded.requests:
        key = request.chain[min(1, len(request.chain) - 1)]
        by_conversation.setdefault(key, set()).add(first.tenant[request.index])
    assert all(len(owners) == 1 for owners in by_conversation.values())
    assert 0.1 < len(first.urgent) / len(overloaded.requests) < 0.3


def test_backlogged_tenants_share_service_evenly() -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=8.0, limit=1200)
    assigned = assign(trace, Tenancy(tenants=3, seed=2))
    result = replay(assigned.trace, FlowConfig(), tenants=assigned.tenant)
    assert len(result.fairness) >= 5
    assert sum(result.fairness) / len(result.fairness) >= 0.9
    # A weight of 3 buys t0 three times the share while all wait: its requests wait less than the others'.
    weighted = replay(assigned.trace, FlowConfig(tenants={"t0": TenantConfig(weight=3.0)}), tenants=assigned.tenant)
    flow = summarize(weighted)["flow"]["tenants"]
    assert flow["t0"]["queued_p99"] < min(flow["t1"]["queued_p99"], flow["t2"]["queued_p99"])
    assert sum(weighted.fairness) / len(weighted.fairness) >= 0.9  # weighted service stays even


def test_headroom_keeps_the_noisy_tenant_out_of_the_others_share() -> None:
    # x1.0 on two engines: the regular tenants alone fit, the neighbour (half of all arrivals) takes it over.
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=1.0, limit=600)
    assigned = assign(trace, Tenancy(tenants=3, noisy_share=0.5, seed=1))
    with_room = summarize(replay(assigned.trace, FlowConfig(), tenants=assigned.tenant))["flow"]["tenants"]
    without = FlowConfig(tenant_headroom=False)
    plain = summarize(replay(assigned.trace, without, tenants=assigned.tenant))["flow"]["tenants"]
    # Every regular tenant waits less with the headroom; the neighbour, sending twice its share, pays for it.
    for tenant in ("t0", "t1", "t2"):
        assert with_room[tenant]["queued_p99"] < 0.9 * plain[tenant]["queued_p99"]
        assert with_room[tenant]["rejected"] == plain[tenant]["rejected"] == 0
    assert with_room[NOISY_TENANT]["rejected"] > plain[NOISY_TENANT]["rejected"]


def test_headroom_changes_nothing_for_one_tenant(overloaded: Trace) -> None:
    on = replay(overloaded, FlowConfig())
    off = replay(overloaded, FlowConfig(tenant_headroom=False))
    assert [(r.replica, r.queued_s, r.first_token, r.rejected) for r in on.records] == [
        (r.replica, r.queued_s, r.first_token, r.rejected) for r in off.records
    ]
