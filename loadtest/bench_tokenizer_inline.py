"""What `tokenizer_inline_chars` weighs: how long an encode holds the event loop, against what the hop costs.

1. The encode the loop runs for a short tail (`HfPromptTokenizer._encode`, the Rust tokenizer called directly):
   wall time per call on slices of a rendered multi-turn conversation of `loadtest/router_cpu.py`'s words, ~400
   characters (one answer and one question, the usual tail) and 2,048 (the default bound), with the project's tiny
   tokenizer (`kvrouter.tinymodel`) or `--tokenizer DIR` (e.g. ../shared/fixtures/vllm-kv-events/model). Median,
   p90 and p99 of `--calls` calls over 8 slices.
2. The process's CPU per request through `prompt_token_ids`, one request at a time, with `inline_chars=0` (every
   request on the threads, as before) and the default (short tails on the loop), on router_cpu.py's tenant and
   multi-turn bodies (20 tenants' ~4,000-token system prompts): the loop's thread, the tokenizer threads and the
   kernel's wake-ups. Medians of `--repeats` rounds, the two settings alternating.

Run from the repository root: `python loadtest/bench_tokenizer_inline.py` (under a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import router_cpu

from kvrouter.config import Settings
from kvrouter.openai_request import parse_request
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer


def encode_times(tokenizer: HfPromptTokenizer, calls: int) -> None:
    rng = random.Random(0)
    messages = [{"role": "system", "content": "You answer questions."}]
    for _ in range(30):
        messages.append({"role": "user", "content": router_cpu._text(rng, 50)})
        messages.append({"role": "assistant", "content": router_cpu._text(rng, 30)})
    text = tokenizer.tokenizer.apply_chat_template(messages, tokenize=False)
    for chars in (400, Settings().tokenizer_inline_chars):
        tails = [text[i : i + chars] for i in range(0, len(text) - chars, 997)][:8]
        for tail in tails:
            tokenizer._encode(tail, False)
        walls = []
        for _ in range(max(1, calls // len(tails))):
            for tail in tails:
                started = time.perf_counter_ns()
                tokenizer._encode(tail, False)
                walls.append((time.perf_counter_ns() - started) / 1e3)
        tokens = statistics.mean(len(tokenizer._encode(tail, False)) for tail in tails)
        q = statistics.quantiles(walls, n=100)
        print(
            f"encode of {chars:5,} characters (~{tokens:.0f} tokens): median {statistics.median(walls):.0f} µs, "
            f"p90 {q[89]:.0f}, p99 {q[98]:.0f} (wall, {len(walls)} calls)"
        )


def bodies(systems: list[str], salt: str) -> list[bytes]:
    conversations = router_cpu.conversation_bodies(systems, 400, 8, False, salt)
    turns = [conversation[turn] for turn in range(8) for conversation in conversations]
    return turns + [body for _, body in router_cpu.tenant_bodies(systems, 400, False, salt)]


async def cpu_per_request(tokenizer: HfPromptTokenizer, requests: list[bytes]) -> float:
    started = time.process_time_ns()
    for body in requests:
        await tokenizer.prompt_token_ids(parse_request("chat", body))
    return (time.process_time_ns() - started) / len(requests) / 1e3


async def hop_costs(path: Path, systems: list[str], repeats: int) -> None:
    settings = (0, Settings().tokenizer_inline_chars)
    tokenizers = {n: HfPromptTokenizer(path, threads=2, inline_chars=n) for n in settings}
    try:
        for n, tokenizer in tokenizers.items():
            await cpu_per_request(tokenizer, bodies(systems, f"warm-{n}"))
        figures: dict[int, list[float]] = {n: [] for n in settings}
        for repeat in range(repeats):
            for n, tokenizer in tokenizers.items():
                figures[n].append(await cpu_per_request(tokenizer, bodies(systems, f"{repeat}-{n}")))
        for n, values in figures.items():
            rounds = ", ".join(f"{v:.0f}" for v in values)
            print(f"inline_chars={n:5}: {statistics.median(values):.0f} µs CPU per request ({rounds})")
    finally:
        for tokenizer in tokenizers.values():
            tokenizer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the tiny one)")
    args = parser.parse_args()
    path = args.tokenizer or ensure_tokenizer()
    tokenizer = HfPromptTokenizer(path, threads=1)
    encode_times(tokenizer, args.calls)
    systems = router_cpu.system_prompts(20, 4000, tokenizer.tokenizer)
    tokenizer.close()
    asyncio.run(hop_costs(path, systems, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
