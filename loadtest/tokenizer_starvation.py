"""Tokenizer starvation: how long small requests wait for their token ids while large prompts tokenize.

Builds the router's tokenizer (`HfPromptTokenizer`, 2 threads as in production) twice — "before": every prompt on
the one shared pool (the large-prompt lane switched off), "after": the defaults (prompts over
`tokenizer_large_prompt_chars` on their own single thread) — and in each, starts `--large` large chat prompts of
`--large-chars` characters at once, then sends a small chat request every 20 ms until the large ones are done.
Prints the small requests' latency (p50, p99, max) and how long the large ones took.

Run from the repository root: `python loadtest/tokenizer_starvation.py [--tokenizer DIR]` (default: the tokenizer
of the captured vLLM model in the shared fixtures, else the project's tiny tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from kvrouter.openai_request import ParsedRequest, parse_request
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer, PromptLimits

CAPTURED = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "vllm-kv-events" / "model"


def chat(text: str) -> ParsedRequest:
    return parse_request("chat", json.dumps({"messages": [{"role": "user", "content": text}]}).encode())


async def run(tokenizer: HfPromptTokenizer, large: int, large_chars: int) -> tuple[list[float], float]:
    words = "the router tokenizes every prompt it routes, ここでも日本語の文章が混ざる "
    bigs = [chat(f"{n} " + words * (large_chars // len(words))) for n in range(large)]
    started = time.perf_counter()
    big_tasks = [asyncio.ensure_future(tokenizer.prompt_token_ids(b)) for b in bigs]
    latencies: list[float] = []
    n = 0
    while not all(t.done() for t in big_tasks):
        n += 1
        sent = time.perf_counter()
        await tokenizer.prompt_token_ids(chat(f"small question {n}: what is the capital of Japan?"))
        latencies.append(time.perf_counter() - sent)
        await asyncio.sleep(0.02)
    await asyncio.gather(*big_tasks)
    return latencies, time.perf_counter() - started


def report(name: str, latencies: list[float], big_s: float) -> None:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(
        f"{name:>6}: {len(ordered)} small requests while the large ones tokenized ({big_s:.1f}s): "
        f"p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=CAPTURED if CAPTURED.is_dir() else None)
    parser.add_argument("--large", type=int, default=2, help="large prompts started at once")
    parser.add_argument("--large-chars", type=int, default=1_000_000)
    args = parser.parse_args()
    path = args.tokenizer or ensure_tokenizer()
    print(f"tokenizer {path}; {args.large} prompts of {args.large_chars} chars")
    cases = {
        "before": PromptLimits(max_chars=10**9, max_tokens=10**9, large_chars=10**9),
        "after": PromptLimits(max_chars=10**9, max_tokens=10**9),
    }
    for name, limits in cases.items():
        tokenizer = HfPromptTokenizer(path, threads=2, limits=limits, cache_bytes=0)
        try:
            latencies, big_s = asyncio.run(run(tokenizer, args.large, args.large_chars))
        finally:
            tokenizer.close()
        report(name, latencies, big_s)


if __name__ == "__main__":
    main()
