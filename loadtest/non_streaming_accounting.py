"""Non-streaming accounting: how long the router counts a non-streaming request's prompt as pending prefill.

Starts simulated replicas (`kvrouter sim`, default profile b200x4-moe-1t) and a kvrouter in front of them three
times — streaming requests (the reference: the router sees the first token), non-streaming with
`assemble_non_streaming` on (the default: fetched as streams and assembled, kvrouter/server/assembly.py), and
non-streaming with it off (forwarded unchanged) — and sends each the same closed-loop load of chat requests with
long prompts and `--max-tokens` output tokens. From the router's own metrics it prints, per run:

* pending prefill per request: the time from arrival to the moment the router moved the request from pending
  prefill to decoding — the router's TTFT histogram where it sees a first token, the whole request's duration
  where it does not (assembly off: the first token is reported when the whole answer arrives);
* the answer's end-to-end time, and the router's CPU time per request (from /proc, robust to the machine's load).

Run from the repository root: `python loadtest/non_streaming_accounting.py` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrouter.loadgen.fleet import free_port_range, scrape, start_kvrouter, start_sim, stop_all

WORDS = ("cache", "block", "prefix", "replica", "router", "token", "engine", "queue", "decode", "prefill")


@dataclass
class Run:
    label: str
    requests: int
    pending_s: float
    duration_s: float
    cpu_us: float
    errors: int


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, args: argparse.Namespace, *, stream: bool) -> int:
    errors = 0
    sent = 0

    async def client(session: aiohttp.ClientSession, worker: int) -> None:
        nonlocal errors, sent
        while sent < args.requests:
            sent += 1
            system = " ".join(WORDS[(worker + i) % len(WORDS)] for i in range(args.prompt_words))
            body = {
                "model": "sim",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"turn {sent}"}],
                "max_tokens": args.max_tokens,
                "stream": stream,
            }
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                await response.read()
                errors += response.status != 200

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, worker) for worker in range(args.concurrency)))
    return errors


def one_run(label: str, args: argparse.Namespace, replicas_file: Path, work: Path, *, stream: bool, on: bool) -> Run:
    port = free_port_range(1)
    os.environ["KVROUTER_ASSEMBLE_NON_STREAMING"] = "true" if on else "false"
    router = start_kvrouter(replicas_file, port, "kv_aware", work / f"router-{label}.log")
    try:
        url = f"http://127.0.0.1:{port}"
        before = cpu_seconds(router.process.pid)
        errors = asyncio.run(drive(url, args, stream=stream))
        cpu = cpu_seconds(router.process.pid) - before
        metrics = scrape(url) or {}
    finally:
        stop_all([router])
    count = metrics.get("kvrouter_request_duration_seconds_count", 0.0) or 1.0
    duration = metrics.get("kvrouter_request_duration_seconds_sum", 0.0) / count
    ttft_count = metrics.get("kvrouter_ttft_seconds_count", 0.0)
    pending = metrics.get("kvrouter_ttft_seconds_sum", 0.0) / ttft_count if ttft_count else duration
    return Run(label, args.requests, pending, duration, cpu / args.requests * 1e6, errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--profile", default="b200x4-moe-1t")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=1500, help="words in each request's system prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvrouter-nonstream-") as tmp:
        work = Path(tmp)
        sim = start_sim(
            replicas=args.replicas, profile=args.profile, replicas_file=work / "replicas.yaml", log=work / "sim.log"
        )
        try:
            started = time.monotonic()
            runs = [
                one_run("streaming", args, sim.replicas_file, work, stream=True, on=True),
                one_run("non-streaming, assembled", args, sim.replicas_file, work, stream=False, on=True),
                one_run("non-streaming, whole", args, sim.replicas_file, work, stream=False, on=False),
            ]
        finally:
            stop_all([sim.child])
    print(f"{args.requests} chat requests per run, {args.concurrency} clients, {args.prompt_words}-word prompts, ")
    print(f"max_tokens {args.max_tokens}, {args.replicas} x {args.profile}; {time.monotonic() - started:.0f} s")
    print(f"{'run':<28}{'pending prefill':>17}{'end to end':>12}{'router CPU/req':>16}{'errors':>8}")
    for run in runs:
        line = f"{run.label:<28}{run.pending_s * 1e3:>14.0f} ms{run.duration_s * 1e3:>9.0f} ms"
        print(line + f"{run.cpu_us:>13.0f} µs{run.errors:>8}")
    reference = runs[0].pending_s
    for run in runs[1:]:
        print(f"{run.label}: pending prefill {run.pending_s / reference:.2f}x the streaming run's")
    return 0 if all(run.errors == 0 for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
