"""How much CPU `kvrouter sim` costs under load: `python -m kvrouter.sim.overhead`.

Starts `kvrouter sim` (N replicas in one process) as a child process, drives it with streaming chat requests from
this process (closed loop: `--concurrency` clients spread over the replicas, each sending its next request when
the previous stream ends), and prints completed requests per second, streamed tokens per second and the sim
process's CPU use (user + system time from /proc over wall time; 100% = one core). Prompts share a long system
prompt per client group so the prefix cache and the event publisher do real work.

`--trace FILE` instead times the engine model alone, with no server: a Mooncake-style trace (timestamp ms,
input_length, output_length, hash_ids) spread round-robin over the replicas' engines on a virtual clock, the
way trace replay drives them, and prints passes per second of CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvrouter.sim.cli import free_port_run


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def _client(
    session: aiohttp.ClientSession, url: str, group: int, stop: float, max_tokens: int, latencies: list[float]
) -> tuple[int, int]:
    system = " ".join(f"Rule {i} for tenant {group}: answer in formal business Japanese." for i in range(40))
    done = tokens = turn = 0
    while time.monotonic() < stop:
        turn += 1
        body = {
            "model": "sim",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        started = time.monotonic()
        async with session.post(url, json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: {") and b'"content":"' in line:
                    tokens += 1
        latencies.append(time.monotonic() - started)
        done += 1
    return done, tokens


async def _measure(args: argparse.Namespace) -> int:
    base = free_port_run(args.replicas)
    kv_base = free_port_run(2 * args.replicas)
    with tempfile.TemporaryDirectory() as tmp:
        fleet_file = Path(tmp) / "replicas.yaml"
        command = [
            sys.executable, "-m", "kvrouter.cli", "sim", "--replicas", str(args.replicas), "--profile", args.profile,
            "--base-port", str(base), "--kv-base-port", str(kv_base), "--write-replicas", str(fleet_file),
            "--time-scale", str(args.time_scale), "--log-level", "warning",
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(*command)
        try:
            while not fleet_file.exists():
                if process.returncode is not None:
                    print("kvrouter sim exited", file=sys.stderr)
                    return 1
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)
            urls = [f"http://127.0.0.1:{base + i}/v1/chat/completions" for i in range(args.replicas)]
            connector = aiohttp.TCPConnector(limit=0)
            latencies: list[float] = []
            async with aiohttp.ClientSession(connector=connector) as session:
                cpu_before, wall_before = _cpu_seconds(process.pid), time.monotonic()
                own_before = time.process_time()
                stop = wall_before + args.duration
                results = await asyncio.gather(
                    *(
                        _client(session, urls[i % len(urls)], i % args.groups, stop, args.max_tokens, latencies)
                        for i in range(args.concurrency)
                    )
                )
                wall = time.monotonic() - wall_before
                cpu = _cpu_seconds(process.pid) - cpu_before
                own = time.process_time() - own_before
        finally:
            if process.returncode is None:
                process.terminate()
            await process.wait()
    requests = sum(done for done, _ in results)
    tokens = sum(count for _, count in results)
    median = statistics.median(latencies) if latencies else float("nan")
    print(
        f"{args.replicas} x {args.profile} replicas, time scale {args.time_scale:g}, {args.concurrency} streaming "
        f"clients, max_tokens {args.max_tokens}, {wall:.1f} s: {requests / wall:.1f} req/s, {tokens / wall:.0f} "
        f"tokens/s, median request {median * 1000:.0f} ms, sim CPU {100 * cpu / wall:.0f}% of one core "
        f"({1000 * cpu / max(requests, 1):.2f} ms per request), load client CPU {100 * own / wall:.0f}%"
    )
    return 0


def _engine_only(args: argparse.Namespace) -> int:
    import json

    from kvrouter.sim.hashing import label_hashes
    from kvrouter.sim.model import EngineRequest
    from kvrouter.sim.profiles import build_engine, get_profile

    rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line.strip()]
    profile = get_profile(args.profile)
    block_size = args.block_size or profile.block_size
    engines = [build_engine(profile, block_size=block_size, hash_seed=i) for i in range(args.replicas)]
    trace_block = args.trace_block_tokens
    clocks = [0.0] * len(engines)
    passes = 0
    started = time.process_time()
    for number, row in enumerate(rows):
        at = row["timestamp"] / 1000.0
        for index, engine in enumerate(engines):  # every engine runs its passes up to this arrival
            while engine.has_work() and clocks[index] <= at:
                clocks[index] += engine.step(clocks[index]).duration
                passes += 1
            if not engine.has_work():
                clocks[index] = max(clocks[index], at)
        # the trace's block ids name 512-token blocks; each becomes block_tokens / block_size engine blocks
        labels = [h * 4096 + part for h in row["hash_ids"] for part in range(trace_block // block_size)]
        length = row["input_length"]
        engines[number % len(engines)].add(
            EngineRequest(str(number), length, label_hashes(labels[: length // block_size]),
                          max(1, row["output_length"]), at)
        )  # fmt: skip
    for index, engine in enumerate(engines):
        while engine.has_work():
            clocks[index] += engine.step(clocks[index]).duration
            passes += 1
    cpu = time.process_time() - started
    print(
        f"{len(rows)} requests on {len(engines)} x {profile.name} engines (block {block_size}): {passes} passes, "
        f"{max(clocks):.0f} simulated s, {cpu:.1f} s CPU ({passes / cpu:,.0f} passes/s)"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--profile", default="b200x4-moe-1t")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8, help="Distinct shared system prompts.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--trace", default=None, help="Time the engine model alone on this trace.")
    parser.add_argument("--trace-block-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=None)
    args = parser.parse_args()
    if args.trace:
        return _engine_only(args)
    return asyncio.run(_measure(args))


if __name__ == "__main__":
    sys.exit(main())
