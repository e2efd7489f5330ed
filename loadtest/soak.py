"""Soak: steady load through one kvrouter in front of simulated replicas, with the router's RSS over time.

Starts `kvrouter sim` (`--replicas` simulated vLLM replicas publishing KV events) and one `kvrouter` (kv_aware) in
front of it as child processes, then sends an open-loop stream of streaming chat requests at `--rate` per second
for `--duration` seconds: multi-turn-like prompts sharing one of `--prefixes` long system prompts, so the prefix
index fills, evicts and is matched all the time. Every request must end with status 200 and `data: [DONE]`;
anything else is a failure, counted by reason. The router's resident set size (VmRSS of its pid) is sampled every
`--sample-every` seconds.

Pass/fail: zero failed requests (no fault is injected), and RSS growth over the second half of the run below
`--max-growth-mb` (a leak grows steadily; a warm-up does not). Prints a table of samples and a summary; `--json`
writes everything for docs/reliability.md. Exit 0 on pass, 1 on fail.

Run from the repository root: `python loadtest/soak.py` (10 minutes); `--duration 30` is the CI-sized run
(tests/test_faults_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvrouter.loadgen.fleet import free_port_range, scrape, start_kvrouter, start_sim  # noqa: E402

_TEXT = (
    "kvrouter routes each request to the replica that already holds its prompt prefix in cache while "
    "weighing queue depth prefill tokens and decode load across the fleet of engines"
)
WORDS = tuple(_TEXT.split())


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    done: int
    failed: int
    in_flight: int


@dataclass
class SoakResult:
    duration_s: float
    rate: float
    sent: int = 0
    ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        rss = [s.rss_mb for s in self.samples]
        half = [s.rss_mb for s in self.samples if s.t_s >= self.duration_s / 2]
        lat = sorted(self.latencies_s)
        return {
            "duration_s": self.duration_s,
            "rate_per_s": self.rate,
            "sent": self.sent,
            "ok": self.ok,
            "failed": sum(self.failures.values()),
            "failures": dict(self.failures),
            "e2e_p50_s": round(lat[len(lat) // 2], 4) if lat else None,
            "e2e_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 4) if lat else None,
            "rss_first_mb": round(rss[0], 1) if rss else None,
            "rss_max_mb": round(max(rss), 1) if rss else None,
            "rss_last_mb": round(rss[-1], 1) if rss else None,
            "rss_second_half_growth_mb": round(max(half) - min(half), 1) if half else None,
        }


def make_body(rng: random.Random, prefixes: list[str]) -> dict[str, object]:
    system = prefixes[rng.randrange(len(prefixes))]
    history = [
        {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))}
        for _ in range(rng.randint(1, 3))
    ]
    return {
        "model": "sim",
        "messages": [{"role": "system", "content": system}, *history],
        "max_tokens": rng.randint(4, 24),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], result: SoakResult, timeout_s: float
) -> None:
    started = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            payload = await response.read()
            if response.status != 200:
                result.failures[f"status {response.status}"] += 1
            elif not payload.rstrip().endswith(b"data: [DONE]"):
                result.failures["stream without [DONE]"] += 1
            else:
                result.ok += 1
                result.latencies_s.append(time.perf_counter() - started)
    except TimeoutError:
        result.failures["timeout"] += 1
    except aiohttp.ClientError as error:
        result.failures[type(error).__name__] += 1


async def drive(
    url: str, pid: int, *, duration_s: float, rate: float, prefixes: int, sample_every_s: float, seed: int
) -> SoakResult:
    rng = random.Random(seed)
    prefix_texts = [
        f"System prompt {n}: " + " ".join(rng.choices(WORDS, k=rng.randint(150, 400))) for n in range(prefixes)
    ]
    result = SoakResult(duration_s, rate)
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        next_sample = 0.0
        n = 0
        while True:
            now = time.perf_counter() - start
            if now >= next_sample:
                rss = rss_mb(pid)
                if rss is not None:
                    done = result.ok + sum(result.failures.values())
                    sample = Sample(round(now, 1), round(rss, 1), done, sum(result.failures.values()), len(tasks))
                    result.samples.append(sample)
                    print(
                        f"t={sample.t_s:7.1f}s rss={sample.rss_mb:7.1f} MB done={done:7d} "
                        f"failed={sample.failed} in_flight={sample.in_flight}",
                        flush=True,
                    )
                next_sample += sample_every_s
            if now >= duration_s:
                break
            due = n / rate
            if due > now:
                await asyncio.sleep(min(due - now, max(0.0, next_sample - now)) or 0.001)
                continue
            task = asyncio.create_task(one_request(session, url, make_body(rng, prefix_texts), result, 60.0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            result.sent += 1
            n += 1
        if tasks:
            await asyncio.wait(tasks, timeout=90)
        rss = rss_mb(pid)
        if rss is not None:
            done = result.ok + sum(result.failures.values())
            end = round(time.perf_counter() - start, 1)
            result.samples.append(Sample(end, round(rss, 1), done, sum(result.failures.values()), len(tasks)))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--rate", type=float, default=25.0, help="requests per second (default 25)")
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default 4)")
    parser.add_argument("--profile", default="cpu-tiny", help="simulator profile (default cpu-tiny)")
    parser.add_argument("--prefixes", type=int, default=16, help="distinct system prompts (default 16)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="RSS sample period in seconds")
    parser.add_argument("--max-growth-mb", type=float, default=30.0, help="allowed RSS growth over the 2nd half")
    parser.add_argument("--index-max-blocks", type=int, default=None, help="router's index budget (blocks)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write samples and summary here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvrouter-soak-") as tmp:
        work = Path(tmp)
        sim = start_sim(
            replicas=args.replicas, profile=args.profile, replicas_file=work / "replicas.yaml", log=work / "sim.log"
        )
        router = None
        try:
            port = free_port_range(1)
            if args.index_max_blocks is not None:
                # The child inherits this process's environment (kvrouter.loadgen.fleet.start_child).
                os.environ["KVROUTER_INDEX_MAX_BLOCKS"] = str(args.index_max_blocks)
            router = start_kvrouter(
                work / "replicas.yaml", port, "kv_aware", work / "router.log", extra=["--max-concurrency", "100000"]
            )
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            result = asyncio.run(
                drive(
                    url,
                    router.process.pid,
                    duration_s=args.duration,
                    rate=args.rate,
                    prefixes=args.prefixes,
                    sample_every_s=args.sample_every,
                    seed=args.seed,
                )
            )
            router_alive = router.alive()
            metrics = scrape(f"http://127.0.0.1:{port}") or {}
            log_tail = router.log_tail(30)
        finally:
            if router is not None:
                router.stop()
            sim.child.stop()
    summary = result.summary()
    summary["router_alive"] = router_alive
    # Evidence that the prefix index was live throughout: events applied and tokens predicted cached.
    for name in ("kvrouter_kv_events_total", "kvrouter_index_blocks", "kvrouter_predicted_cached_tokens_total"):
        summary[name] = metrics.get(name)
    growth = summary["rss_second_half_growth_mb"]
    passed = (
        summary["failed"] == 0
        and router_alive
        and result.ok == result.sent
        and isinstance(growth, float | int)
        and growth <= args.max_growth_mb
    )
    summary["passed"] = passed
    print(json.dumps(summary, indent=2))
    if not router_alive:
        print(log_tail, file=sys.stderr)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"summary": summary, "samples": [asdict(s) for s in result.samples]}, indent=2) + "\n"
        )
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
