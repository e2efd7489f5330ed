"""Benchmark of the token-exact prefix plane: tokenization, block keys, event ingest, lookup, memory.

    python loadtest/bench_index.py [--tokenizer DIR] [--quick]

Prints medians, each next to a naive baseline measured in the same run (so a busy machine shows up in both);
keys, ingest and lookup are timed in CPU time of the benchmark thread (per-core figures, robust to other load):
* chat tokenization of a 1k / 8k / 32k-token conversation: cold (nothing cached), next turn (the previous
  turn's render cached: only the new tail is tokenized) and an exact repeat;
* block keys per 1k tokens (block size 16), the C path and the Python path, vs. a bare xxh3 loop over the same bytes;
* ingest in blocks/s from vLLM-format msgpack batches (decode + keys + index) and index-only, vs. a dict insert;
* lookup of a 512-block prompt over 4 and 64 replicas (p50, p99) vs. a per-key loop over a dict of sets, and
  over 4 replicas that also carry provisional marks of recently routed requests ("4 + marks");
* bytes per tracked block (tracemalloc) for one replica, for four replicas sharing the blocks and for 64
  replicas each with its own, at several sizes (the tables' load moves between growth steps), with and
  without a block budget.
Index figures are printed for the compiled tables (`native`, what the router runs) and, next to them, for their
pure-Python twin (`pure`, what runs when the extension was not built).
Targets: >= 1M blocks/s ingested per core, <= 20 us lookup p50, <= 64 bytes per block.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from kvrouter.blocks import chain_keys, native_block_keys, python_chain_keys
from kvrouter.blocktable import Backend, native_backend, pure_backend
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import WireDecoder
from kvrouter.index import PrefixIndex
from kvrouter.openai_request import ParsedRequest, parse_request
from kvrouter.tokenization import HfPromptTokenizer, RenderCache
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName

BLOCK = 16


def timed(run: Callable[[], object], repeat: int, clock: Callable[[], float] = time.thread_time) -> list[float]:
    """Seconds per run. CPU time of this thread by default: what a core spends, whatever else shares the
    machine; tokenization passes wall time (the tokenizer may use its own threads)."""
    samples = []
    for _ in range(repeat):
        start = clock()
        run()
        samples.append(clock() - start)
    return samples


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def percentile_us(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


# ---- tokenization -------------------------------------------------------------------------------------------


def conversation(tokenizer: HfPromptTokenizer, target_tokens: int, rng: random.Random) -> list[dict[str, str]]:
    words = ["the", "tokenizer", "def", "return", "class", "async", "await", "cache", "block", "prefix", "事業"]
    messages = [{"role": "system", "content": " ".join(rng.choices(words, k=400))}]
    while True:
        text = tokenizer.render(parse_request("chat", json.dumps({"messages": messages}).encode()))
        if len(tokenizer.tokenizer(text, add_special_tokens=False).input_ids) >= target_tokens:
            return messages
        messages.append({"role": "user", "content": " ".join(rng.choices(words, k=300))})
        messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=200))})


def bench_tokenization(path: Path, repeat: int) -> None:
    print("## chat tokenization (ms wall time, median)")
    print(f"{'tokens':>8} {'cold':>9} {'next turn':>10} {'repeat':>9} {'baseline':>9}  (baseline: render + tokenize)")
    rng = random.Random(1)
    for size in (1_000, 8_000, 32_000):
        probe = HfPromptTokenizer(path, threads=1)
        messages = conversation(probe, size, rng)
        history = messages[:-2]
        previous = parse_request("chat", json.dumps({"messages": history}).encode())
        current = parse_request("chat", json.dumps({"messages": messages}).encode())
        tokens = len(probe.token_ids(current)[0])

        def tokenize(tokenizer: HfPromptTokenizer, request: ParsedRequest = current) -> None:
            tokenizer.token_ids(request)

        def baseline(tokenizer: HfPromptTokenizer = probe, request: ParsedRequest = current) -> None:
            tokenizer.tokenizer(tokenizer.render(request), add_special_tokens=False)

        cold_samples, next_samples, repeat_samples = [], [], []
        for _ in range(repeat):
            probe.cache = RenderCache()  # a conversation never seen
            cold_samples += timed(partial(tokenize, probe), 1, time.perf_counter)
            probe.cache = RenderCache()
            probe.token_ids(previous)  # the previous turn was tokenized when it was routed
            next_samples += timed(partial(tokenize, probe), 1, time.perf_counter)
            repeat_samples += timed(partial(tokenize, probe), 1, time.perf_counter)
        base = timed(baseline, repeat, time.perf_counter)
        print(
            f"{tokens:>8} {median_us(cold_samples) / 1e3:>9.2f} {median_us(next_samples) / 1e3:>10.2f} "
            f"{median_us(repeat_samples) / 1e3:>9.2f} {median_us(base) / 1e3:>9.2f}"
        )


# ---- block keys ---------------------------------------------------------------------------------------------


def bench_keys(repeat: int) -> None:
    tokens = list(range(1024))
    data = bytes(4 * 1024)
    step = BLOCK * 4

    def bare() -> None:
        for at in range(0, len(data), step):
            xxhash.xxh3_64_intdigest(data[at : at + step])

    keys = median_us(timed(lambda: chain_keys(tokens, BLOCK), repeat))
    python = median_us(timed(lambda: python_chain_keys(tokens, BLOCK, 0, b""), repeat))
    base = median_us(timed(bare, repeat))
    path = "C" if native_block_keys() else "Python (extension not built)"
    print(
        f"\n## block keys: {keys:.1f} us per 1k tokens (block size {BLOCK}, {path}); Python path {python:.1f} us; "
        f"bare xxh3 loop {base:.1f} us"
    )


# ---- ingest -------------------------------------------------------------------------------------------------


def event_payloads(count: int, blocks_per_event: int, rng: random.Random) -> list[bytes]:
    payloads = []
    parent: int | None = None
    next_hash = 1
    for n in range(count):
        hashes = list(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": [rng.randrange(150_000) for _ in range(blocks_per_event * BLOCK)],
            "block_size": BLOCK,
            "medium": "GPU",
            "extra_keys": [None] * blocks_per_event,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        if parent is None:
            del event["parent_block_hash"]
        parent = hashes[-1] if n % 8 else None  # chains of eight events, like a growing conversation
        payloads.append(msgspec.msgpack.encode([time.time(), [event], 0]))
    return payloads


def bench_ingest(batches: int, repeat: int, backends: list[Backend]) -> None:
    rng = random.Random(2)
    per_event = 32
    payloads = event_payloads(batches, per_event, rng)
    total_blocks = batches * per_event
    decoder = WireDecoder()
    decoded = [decoder.decode_payload("r0", s, p)[0] for s, p in enumerate(payloads)]
    keys = [BlockKey(rng.getrandbits(64)) for _ in range(total_blocks)]
    hashes = [EngineBlockHash(rng.getrandbits(64)) for _ in range(total_blocks)]
    replica = ReplicaName("r0")

    def full(backend: Backend) -> None:
        ingest = IndexIngest(PrefixIndex(backend=backend), block_sizes={replica: BLOCK})
        for seq, payload in enumerate(payloads):
            batch, _ = decoder.decode_payload("r0", seq, payload)
            assert batch is not None
            ingest.apply(batch)
        assert ingest.counts == {(replica, "BlockStored", "ok"): batches}

    def no_decode(backend: Backend) -> None:
        ingest = IndexIngest(PrefixIndex(backend=backend), block_sizes={replica: BLOCK})
        for batch in decoded:
            assert batch is not None
            ingest.apply(batch)

    def index_only(backend: Backend) -> None:
        index = PrefixIndex(backend=backend)
        for at in range(0, total_blocks, per_event):
            index.store_keys(replica, hashes[at : at + per_event], keys[at : at + per_event])

    def baseline() -> None:
        plain: dict[int, int] = {}
        get = plain.get
        for key in keys:
            plain[key] = get(key, 0) | 1

    runs: dict[str, Callable[[], None]] = {"baseline": baseline}
    for backend in backends:
        for name, run in (("full", full), ("no_decode", no_decode), ("index_only", index_only)):
            runs[f"{name} {backend.name}"] = partial(run, backend)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():  # interleaved, so a busy spell hits every variant alike
            gc.collect()
            samples[name] += timed(run, 1)

    def rate(name: str) -> float:
        return total_blocks / statistics.median(samples[name]) / 1e6

    print(f"\n## ingest, CPU time ({total_blocks} blocks, {per_event} per BlockStored, chained; median of {repeat})")
    print(f"  {'M blocks/s':<22}" + "".join(f"{b.name:>9}" for b in backends))
    labels = {"full": "decode + keys + index", "no_decode": "keys + index", "index_only": "store_keys only"}
    for name, label in labels.items():
        print(f"  {label:<22}" + "".join(f"{rate(f'{name} {b.name}'):>9.2f}" for b in backends))
    print(f"  baseline dict |= loop : {rate('baseline'):.2f} M blocks/s")


# ---- lookup -------------------------------------------------------------------------------------------------


def bench_lookup(repeat: int, background: int, backend: Backend) -> None:
    rng = random.Random(3)
    print(f"\n## lookup of a 512-block prompt, {backend.name} tables (us of CPU time)")
    print(f"{'replicas':>9} {'p50':>8} {'p99':>8} {'baseline p50':>13}  (baseline: per-key loop over dict of sets)")
    for replicas, marked in ((4, False), (4, True), (64, False)):
        index = PrefixIndex(backend=backend)
        reference: dict[int, set[str]] = {}
        prompt = [BlockKey(rng.getrandbits(64)) for _ in range(512)]
        names = [ReplicaName(f"r{n}") for n in range(replicas)]
        for n, name in enumerate(names):
            held = prompt[: (n + 1) * 512 // replicas]  # replica n holds a prefix growing with n
            other = [BlockKey(rng.getrandbits(64)) for _ in range(background // replicas)]
            blocks = held + other
            index.store_keys(name, [EngineBlockHash(rng.getrandbits(64)) for _ in blocks], blocks)
            for key in blocks:
                reference.setdefault(key, set()).add(name)
        if marked:
            # A live router's steady state: every replica carries provisional marks of recently routed requests
            # (a source bit each), and this prompt's first half was just routed to r0.
            for name in names:
                for _ in range(8):
                    index.add_provisional(name, [BlockKey(rng.getrandbits(64)) for _ in range(512)], 0.0)
            index.add_provisional(names[0], prompt[:256], 0.0)
            for key in prompt[:256]:
                reference.setdefault(key, set()).add(names[0])

        def naive(prompt: list[BlockKey] = prompt, reference: dict[int, set[str]] = reference) -> dict[str, int]:
            lengths: dict[str, int] = {}
            alive: set[str] | None = None
            for position, key in enumerate(prompt):
                holders = reference.get(key, set())
                alive = set(holders) if alive is None else alive & holders
                if not alive:
                    break
                for name in alive:
                    lengths[name] = position + 1
            return lengths

        result = index.longest_prefixes(prompt, 0.0)
        assert {r: m.blocks for r, m in result.items()} == naive()
        samples = timed(partial(index.longest_prefixes, prompt, 0.0), repeat)
        base = timed(naive, max(50, repeat // 10))
        label = f"{replicas} + marks" if marked else str(replicas)
        print(f"{label:>9} {median_us(samples):>8.1f} {percentile_us(samples, 0.99):>8.1f} {median_us(base):>13.1f}")


# ---- memory -------------------------------------------------------------------------------------------------


def bench_memory(sizes: list[int], backend: Backend) -> None:
    """tracemalloc's count of what building the index allocates. The native tables hold raw 64-bit words; the
    pure ones hold the callers' int objects, which were allocated before tracing began and are added here."""
    rng = random.Random(4)
    print(f"\n## bytes per tracked block, {backend.name} tables (tracemalloc; key and hash ints included)")
    print(f"{'blocks':>9} {'1 replica':>10} {'+budget':>8} {'4 sharing':>10} {'per entry':>10} {'64 own':>8}")
    for blocks in sizes:
        keys = [BlockKey(rng.getrandbits(64) | 1 << 63) for _ in range(blocks)]
        row = []
        for replicas, shared, budget in ((1, True, None), (1, True, blocks), (4, True, None), (64, False, None)):
            hashes = [EngineBlockHash(rng.getrandbits(64) | 1 << 63) for _ in range(blocks)]
            per = blocks // replicas if not shared else blocks
            fresh_keys = [BlockKey(int(str(k))) for k in keys]  # new int objects, so they are counted
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            index = PrefixIndex(backend=backend, max_blocks=budget)
            for n in range(replicas):
                at = 0 if shared else n * per
                index.store_keys(ReplicaName(f"r{n}"), hashes[at : at + per], fresh_keys[at : at + per])
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            held = 0
            if backend.name == "pure":  # the dicts keep the callers' ints alive
                held = sum(h.__sizeof__() for h in hashes) * (replicas if shared else 1)
                held += sum(k.__sizeof__() for k in fresh_keys)
            row.append((after - before + held) / blocks)
            del index
        one, budgeted, four, many = row
        print(f"{blocks:>9} {one:>10.0f} {budgeted:>8.0f} {four:>10.0f} {four / 4:>10.0f} {many:>8.0f}")
    print("  (per distinct block; 'per entry' = 4 sharing / 4, per (replica, block); '64 own': 64 replicas, each")
    print("   holding its own share of the blocks: 64 source bits, one mask word)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: tiny model)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    repeat = 5 if args.quick else 15
    if args.tokenizer is None:
        from kvrouter.tinymodel import ensure_tokenizer

        path = ensure_tokenizer(Path(tempfile.gettempdir()) / "kvrouter-bench-tokenizer")
    else:
        path = args.tokenizer
    bench_tokenization(path, 3 if args.quick else 5)
    bench_keys(repeat * 20)
    backends = [native_backend(), pure_backend()]
    bench_ingest(2_000 if args.quick else 5_000, 3 if args.quick else 5, backends)
    for backend in backends:
        bench_lookup(repeat * 100 if backend.name == "native" else repeat * 20, 100_000, backend)
    for backend in backends:
        bench_memory([100_000, 300_000] if args.quick else [100_000, 200_000, 300_000, 1_000_000], backend)


if __name__ == "__main__":
    main()
