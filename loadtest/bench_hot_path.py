"""The hot path's pure parts, one thread, thread CPU time: parse + tokenize a request, its block keys (from scratch,
and as the router gets them: a cached prefix's reused), and the index's lookup plus provisional marks, on
`loadtest/router_cpu.py`'s workloads; and the flow gate's tenant-share answer for one request with nothing queued
(the scan over every active tenant, and `TenantShares.admits`).

Prints medians of 3 rounds. Run it once per source tree to compare, e.g. this checkout against main's export:

    python loadtest/bench_hot_path.py
    git archive main | tar -x -C /tmp/main && (cd /tmp/main && rm pyproject.toml && python setup.py build_ext -i)
    PYTHONPATH=/tmp/main python loadtest/bench_hot_path.py

(`router_cpu.py` measures the whole router process; this isolates what the tokenizer threads and the index cost.)
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import router_cpu

from kvrouter.blocks import chain_keys
from kvrouter.flow.classes import FlowClass
from kvrouter.flow.shares import TenantShares
from kvrouter.index import PrefixIndex
from kvrouter.openai_request import parse_request
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer


def tokenize_us(tokenizer: HfPromptTokenizer, bodies: list[bytes]) -> float:
    started = time.thread_time()
    for body in bodies:
        tokenizer.token_ids(parse_request("chat", body))
    return (time.thread_time() - started) / len(bodies) * 1e6


def keys_us(tokenizer: HfPromptTokenizer, bodies: list[bytes]) -> tuple[float, float]:
    """Block keys per request, (from scratch, reused where the render cache holds a prefix's), in arrival order:
    each request is tokenized first (not timed), then its keys are computed both ways (timed apart, the first way
    alternating)."""
    block_size = router_cpu.BLOCK_SIZE
    reuse = getattr(tokenizer, "block_keys", None)  # absent on trees before key reuse: both ways are scratch
    scratch = reused = 0.0
    for n, body in enumerate(bodies):
        [ids] = tokenizer.token_ids(parse_request("chat", body))
        # Whichever runs first finds the cached prefix's keys and ids colder in memory: alternate the order.
        for way in (0, 1) if n % 2 else (1, 0):
            started = time.thread_time()
            got = reuse(ids, block_size, seed=0, lora=None, cache_salt=None) if way and reuse is not None else None
            if got is None:
                got = chain_keys(ids, block_size)
            spent = time.thread_time() - started
            if way:
                reused += spent
                assert got == chain_keys(ids, block_size)
            else:
                scratch += spent
    return scratch / len(bodies) * 1e6, reused / len(bodies) * 1e6


class _Routed:
    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.predicted_cached = prompt_tokens - 60


def shares_us(tenants: int = 100, active: int = 48, requests: int = 20_000) -> tuple[float, float]:
    """Per request, (scan, admits): `active` of `tenants` tenants with a request in flight, one arriving and one
    finishing per request, the room ample (the unsaturated case), as the gate's direct path asks."""
    rng = random.Random(2)
    shares = TenantShares()
    flows = [FlowClass(1, f"t{n}", 1.0, f"t{n}") for n in range(tenants)]
    running: list[object] = []
    budget, room = 65_536.0, 60_000.0
    admits = getattr(shares, "admits", None)
    scan = fast = 0.0
    for n in range(requests):
        flow = flows[n % tenants]
        shares.arrived(flow, rng.randrange(4_000, 4_200), n * 0.004)
        started = time.thread_time()
        eligible = shares.eligible(budget, room, {})
        allowed = eligible is None or eligible(flow)
        middle = time.thread_time()
        answer = admits(flow.tenant, budget, room) if admits is not None else None
        ended = time.thread_time()
        assert answer is None or answer == allowed
        scan += middle - started
        fast += ended - middle if answer is not None else ended - started
        routed = _Routed(4_100)
        shares.routed(routed, flow)  # type: ignore[arg-type]
        running.append((routed, flow))
        if len(running) > active:
            old, _ = running.pop(0)
            shares.on_finish(old, n * 0.004)  # type: ignore[arg-type]
    return scan / requests * 1e6, fast / requests * 1e6


def index_us(rounds: int = 3, requests: int = 6000) -> float:
    """255-key requests at ~250/s over 100 prefixes (a third of them new): one batch of marks expires per request."""
    rng = random.Random(1)
    prompts = [[rng.getrandbits(64) for _ in range(255)] for _ in range(100)]
    fresh = [[rng.getrandbits(64) for _ in range(255)] for _ in range(requests)]
    index = PrefixIndex(provisional_ttl_s=5.0)
    now = 0.0
    results = []
    for _ in range(rounds):
        started = time.thread_time()
        for n in range(requests):
            now += 0.004
            keys = prompts[n % 100] if n % 3 else fresh[n]
            index.longest_prefixes(keys, now)
            index.add_provisional(f"r{n % 4}", keys, now)
        results.append((time.thread_time() - started) / requests * 1e6)
    return statistics.median(results)


def main() -> int:
    import kvrouter

    tokenizer = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    systems = router_cpu.system_prompts(100, 4000, tokenizer.tokenizer)
    tokenize_us(tokenizer, [body for _, body in router_cpu.tenant_bodies(systems, 300, False, "warm")])
    tenants, multiturn, tenant_keys, multiturn_keys = [], [], [], []
    for r in range(3):
        tenants.append(tokenize_us(tokenizer, [b for _, b in router_cpu.tenant_bodies(systems, 600, False, f"t{r}")]))
        conversations = router_cpu.conversation_bodies(systems, 600, 8, False, f"m{r}")
        multiturn.append(tokenize_us(tokenizer, [b for c in conversations for b in c]))
        tenant_keys.append(keys_us(tokenizer, [b for _, b in router_cpu.tenant_bodies(systems, 600, False, f"k{r}")]))
        conversations = router_cpu.conversation_bodies(systems, 600, 8, False, f"n{r}")
        multiturn_keys.append(keys_us(tokenizer, [b for c in conversations for b in c]))
    print(f"kvrouter from {Path(kvrouter.__file__).parent}")
    print(f"parse + tokenize per request: tenants {statistics.median(tenants):.0f} us, ", end="")
    print(f"multiturn {statistics.median(multiturn):.0f} us (thread CPU)")
    for name, pairs in (("tenants", tenant_keys), ("multiturn", multiturn_keys)):
        scratch, reused = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        print(f"block keys per request, {name}: from scratch {scratch:.1f} us, reused {reused:.1f} us (thread CPU)")
    scan, fast = shares_us()
    print(f"tenant shares per request, 100 tenants, 48 active, nothing queued: scan {scan:.1f} us, ", end="")
    print(f"admits {fast:.1f} us (thread CPU; a deferred near tie counts both)")
    print(f"index lookup + provisional marks per 255-key request: {index_us():.1f} us (thread CPU)")
    tokenizer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
