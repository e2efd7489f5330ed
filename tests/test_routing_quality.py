"""Routing-quality counters (best cached overlap vs the chosen one) and the fleet saturation gauge: pure, then
on a real router app's /metrics, and the KEDA example that scales the engines on the gauge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.config import load_fleet
from kvrouter.index import PrefixIndex
from kvrouter.policies.base import CandidateScore, Decision, ReplicaLoad
from kvrouter.policies.round_robin import RoundRobinPolicy
from kvrouter.routing.load import EngineGauges, LoadBook
from kvrouter.routing.quality import RoutingQuality, SaturationConfig, fleet_saturation, replica_saturation
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.server.app import LOAD, REPLICAS, create_app
from kvrouter.typedefs import ReplicaName
from tests.conftest import ReplicaFactory, router_settings
from tests.deploy_support import DEPLOY

A, B, C = ReplicaName("a"), ReplicaName("b"), ReplicaName("c")
BS = 16


def committed(quality: RoutingQuality, cached: dict[ReplicaName, int], chosen: ReplicaName) -> None:
    router = Router(
        policy=RoundRobinPolicy(), load=LoadBook(), index=PrefixIndex(), listeners=[quality], clock=lambda: 0.0
    )
    scores = tuple(CandidateScore(name, tokens, 0.0) for name, tokens in cached.items())
    facts = RoutingFacts([list(range(200))])
    router.commit(Decision(chosen, scores), facts, Route(chosen, BS))


def test_blocks_lost_to_load_balancing_are_counted_per_decision() -> None:
    quality = RoutingQuality()
    committed(quality, {A: 128, B: 32, C: 0}, A)  # the best: nothing lost
    committed(quality, {A: 128, B: 32, C: 0}, B)  # 96 tokens = 6 blocks recomputed for load's sake
    committed(quality, {A: 0, B: 0, C: 0}, C)  # nothing cached anywhere: not a quality question
    committed(quality, {A: 64, B: 64, C: 8}, B)  # a tie with the best is the best
    committed(quality, {A: 40, B: 0}, B)  # a partial block still costs a block
    assert (quality.decisions, quality.decisions_with_cache, quality.not_best) == (5, 4, 2)
    assert (quality.blocks_lost, quality.tokens_lost) == (6 + 3, 96 + 40)


def test_saturation_is_the_larger_of_prefill_pressure_and_kv_usage() -> None:
    config = SaturationConfig(prefill_tokens_per_s=1000.0, queue_target_s=2.0)
    assert replica_saturation(ReplicaLoad(), 1.0, config) == 0.0
    assert replica_saturation(ReplicaLoad(pending_prefill_tokens=1000), 1.0, config) == 0.5
    assert replica_saturation(ReplicaLoad(pending_prefill_tokens=1000), 2.0, config) == 0.25  # twice the capacity
    assert replica_saturation(ReplicaLoad(pending_prefill_tokens=1000, kv_usage=0.8), 1.0, config) == 0.8
    assert replica_saturation(ReplicaLoad(pending_prefill_tokens=10**9), 1.0, config) == 1.0
    half, full = ReplicaLoad(pending_prefill_tokens=1000), ReplicaLoad(kv_usage=1.0)
    assert fleet_saturation([(half, 1.0), (full, 3.0)], config) == pytest.approx((0.5 + 3.0) / 4)
    # A replica that cannot take requests absorbs nothing; no replica at all is no capacity at all.
    assert fleet_saturation([(half, 1.0), (None, 1.0)], config) == 0.75
    assert fleet_saturation([], config) == 1.0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def test_router_exports_quality_and_saturation(
    aiohttp_client: Any, tmp_path: Path, fake_replicas: ReplicaFactory
) -> None:
    replicas = await fake_replicas(2)
    path = tmp_path / "replicas.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": r.name, "url": r.url} for r in replicas]}), "utf-8")
    settings = router_settings(replicas=path, kv_prefill_tokens_per_s=1000.0, saturation_queue_s=1.0)
    client = await aiohttp_client(create_app(settings, load_fleet(path), registry=CollectorRegistry()))
    for _ in range(3):
        response = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
        assert response.status == 200
    load: LoadBook = client.app[LOAD]
    r0, r1 = (ReplicaName(r.name) for r in replicas)
    load.begin(r0, 500)  # half a second of queued prefill at 1,000 tokens/s
    load.observe_engine(r1, EngineGauges(waiting=0, running=3, kv_usage=0.9))
    found = samples(await (await client.get("/metrics")).text())
    assert found[("kvrouter_routing_decisions_total", ())] == 3
    assert found[("kvrouter_routing_not_best_cached_total", ())] == 0
    assert found[("kvrouter_replica_saturation", (("replica", r0),))] == 0.5
    assert found[("kvrouter_replica_saturation", (("replica", r1),))] == 0.9
    assert found[("kvrouter_fleet_saturation", ())] == pytest.approx(0.7)
    # A drained replica leaves the fleet's figure (it is leaving); the other stays.
    client.app[REPLICAS].draining.add(r1)
    found = samples(await (await client.get("/metrics")).text())
    assert found[("kvrouter_fleet_saturation", ())] == 0.5


def test_keda_example_scales_the_engines_on_fleet_saturation() -> None:
    scaled = yaml.safe_load((DEPLOY / "kubernetes" / "autoscaling" / "keda-vllm.yaml").read_text(encoding="utf-8"))
    assert scaled["kind"] == "ScaledObject"
    engines = [
        d
        for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "vllm.yaml").read_text(encoding="utf-8"))
        if d["kind"] == "StatefulSet"
    ]
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", engines[0]["metadata"]["name"])
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "kvrouter_fleet_saturation" in trigger["metadata"]["query"]
    assert 0 < float(trigger["metadata"]["activationThreshold"]) < float(trigger["metadata"]["threshold"]) < 1
