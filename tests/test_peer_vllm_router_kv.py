"""loadtest/peer_vllm_router_kv.py without vLLM: the request order, the summary's routing test, the replicas' seed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def peer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peer_vllm_router_kv", ROOT / "loadtest" / "peer_vllm_router_kv.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_round_zero_places_every_tenant_then_rounds_are_shuffled_permutations(peer: ModuleType) -> None:
    order = peer.request_order(4, 3, seed=0)
    assert order[:4] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    for number in (1, 2):
        assert sorted(order[4 * number : 4 * number + 4]) == [(tenant, number) for tenant in range(4)]
    assert peer.request_order(4, 3, seed=0) == order


def test_a_router_that_sends_everything_to_one_replica_scores_half(peer: ModuleType) -> None:
    def results(replica_of_repeat: dict[int, str]) -> list[object]:
        placed = [peer.Result(t, 0, f"r{t % 2}", 100, 0, routed=False, holder=False) for t in range(4)]
        repeats = [
            peer.Result(t, 1, replica_of_repeat[t], 100, 96, routed=True, holder=replica_of_repeat[t] == f"r{t % 2}")
            for t in range(4)
        ]
        return placed + repeats

    aware = peer.summarize("kv_aware/chat", results({t: f"r{t % 2}" for t in range(4)}), (4, 4, 8))
    stuck = peer.summarize("kv_aware/chat", results(dict.fromkeys(range(4), "r0")), (0, 4, 0))
    assert "first routed repeat on the prefix's replica 4/4" in aware
    assert "first routed repeat on the prefix's replica 2/4" in stuck
    assert "crediting a cached prefix 0/4, event batches applied 0" in stuck


def test_the_replica_seed_is_exactly_the_asked_one(peer: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # the caller's must not leak into a replica
    paths = (Path("python"), Path("model"), Path("logs"))
    assert "PYTHONHASHSEED" not in peer.SeededServer("r0", *paths).environment()
    assert peer.SeededServer("r0", *paths, hash_seed="1").environment()["PYTHONHASHSEED"] == "1"
