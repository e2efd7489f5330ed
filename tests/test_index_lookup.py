"""Lookup of long prompts: drop points inside and across chunks, with few sources (the byte path) and many
(the wide path), against a per-key reference."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvrouter.blocktable import Backend, native_backend, pure_backend
from kvrouter.index import PrefixIndex
from kvrouter.routing.router import PrefixMatch
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier


@pytest.fixture(params=[native_backend, pure_backend], ids=["native", "pure"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Every index example runs on the compiled tables and on their pure-Python twin."""
    factory: Callable[[], Backend] = request.param
    return factory()


def reference(held: dict[ReplicaName, set[BlockKey]], prompt: list[BlockKey]) -> dict[ReplicaName, int]:
    result = {}
    for replica, keys in held.items():
        count = 0
        for key in prompt:
            if key not in keys:
                break
            count += 1
        if count:
            result[replica] = count
    return result


@pytest.mark.parametrize("replicas", [1, 4, 7, 8, 9, 20, 64, 70])
@pytest.mark.parametrize("seed", range(6))
def test_long_prompts_match_the_reference(replicas: int, seed: int, backend: Backend) -> None:
    rng = random.Random(seed * 100 + replicas)
    prompt = [BlockKey(rng.getrandbits(64)) for _ in range(rng.choice([17, 80, 336, 700, 1500]))]
    index = PrefixIndex(backend=backend)
    held: dict[ReplicaName, set[BlockKey]] = {}
    for n in range(replicas):
        name = ReplicaName(f"r{n}")
        length = rng.randrange(len(prompt) + 1)
        keys = prompt[:length] + [BlockKey(rng.getrandbits(64)) for _ in range(5)]
        if length > 3 and rng.random() < 0.5:  # a hole: later blocks held, but the prefix ends there
            hole = rng.randrange(length)
            keys.pop(hole)
        # Some replicas also hold blocks far down the prompt without its head.
        keys += rng.sample(prompt, min(len(prompt), 10))
        index.store_keys(name, [EngineBlockHash(k ^ n) for k in keys], keys)
        held[name] = set(keys)
    expected = {name: PrefixMatch(n, n) for name, n in reference(held, prompt).items()}
    assert dict(index.longest_prefixes(prompt, 0.0)) == expected


def test_provisional_and_lower_tiers_mix_with_long_prompts(backend: Backend) -> None:
    rng = random.Random(7)
    prompt = [BlockKey(rng.getrandbits(64)) for _ in range(600)]
    a, b = ReplicaName("a"), ReplicaName("b")
    index = PrefixIndex(provisional_ttl_s=5.0, backend=backend)
    index.store_keys(a, [EngineBlockHash(k) for k in prompt[:300]], prompt[:300])
    index.store_keys(a, [EngineBlockHash(k) for k in prompt[300:450]], prompt[300:450], Tier.CPU)
    index.add_provisional(b, prompt[:500], now=0.0)
    index.store_keys(b, [EngineBlockHash(k) for k in prompt[:20]], prompt[:20])
    assert dict(index.longest_prefixes(prompt, 1.0)) == {a: PrefixMatch(450, 300), b: PrefixMatch(500, 500)}
    assert dict(index.longest_prefixes(prompt, 6.0)) == {a: PrefixMatch(450, 300), b: PrefixMatch(20, 20)}


def test_provisional_marks_share_the_budget_and_are_not_counted_as_held(backend: Backend) -> None:
    a, b = ReplicaName("a"), ReplicaName("b")
    keys = [BlockKey(0x1000 + i) for i in range(12)]
    index = PrefixIndex(provisional_ttl_s=5.0, max_blocks=10, backend=backend)
    index.store_keys(a, [EngineBlockHash(k) for k in keys[:6]], keys[:6])
    index.add_provisional(b, keys[6:12], now=0.0)
    assert len(index) == 4  # a's two oldest keys (its chain's tail) made room; b's marks are not held blocks
    assert dict(index.longest_prefixes(keys[:6], 1.0)) == {a: PrefixMatch(4, 4)}
    assert dict(index.longest_prefixes(keys[6:], 1.0)) == {b: PrefixMatch(6, 6)}
    index.add_provisional(a, keys[:2], now=1.0)
    assert dict(index.longest_prefixes(keys[:6], 2.0)) == {a: PrefixMatch(4, 4)}
    assert dict(index.longest_prefixes(keys[:6], 7.0)) == {a: PrefixMatch(4, 4)}  # a's marks lapsed, its blocks stay
    assert dict(index.longest_prefixes(keys[6:], 7.0)) == {}
    assert len(index) == 4
