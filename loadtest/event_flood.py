"""KV-event flood: routing decision latency and router memory while replicas publish ~100k events/s.

Processes: `kvrouter sim` (replicas answering HTTP), one `kvrouter` router (kv_aware, embedded ZMQ ingest, an
index budget through KVROUTER_INDEX_MAX_BLOCKS), and a publisher process of this script that binds one ZMQ PUB
socket per replica and sends vLLM-format KV-event messages (map-encoded `BlockStored` events, each a new chain
of `--blocks-per-event` blocks, `--events-per-message` events per message) at `--rate` events/s in all. The
router follows those sockets instead of the simulator's own publishers.

Measured, idle first and then during the flood, from this process:
* decision latency: completion requests with token-id prompts (no tokenizer work) sent through the router, the
  router's own `kvrouter_routing_decision_seconds` (mean over the phase) and the client's end-to-end time;
* the events the router applied per second (`kvrouter_kv_events_total`, status ok) against those offered;
* the router's RSS and its index size (`kvrouter_index_blocks`) against the budget.

Run from the repository root: `python loadtest/event_flood.py` (about 40 s). `--json` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvrouter.loadgen.fleet import free_port_range, scrape, start_kvrouter, start_sim  # noqa: E402

BLOCK = 16


def publish(endpoints: list[str], rate: float, seconds: float, events_per_message: int, blocks: int) -> None:
    """The publisher process: bind PUB sockets, wait for subscribers, then send at `rate` events/s in all."""
    import zmq

    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    sockets = []
    for endpoint in endpoints:
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.SNDHWM, 1_000_000)
        socket.bind(endpoint)
        sockets.append(socket)
    time.sleep(1.5)  # subscribers connect and subscribe
    rng = random.Random(7)
    encoder = msgspec.msgpack.Encoder()
    seqs = [0] * len(sockets)
    messages_per_s = rate / events_per_message
    start = time.perf_counter()
    sent = 0
    next_hash = 1
    while True:
        now = time.perf_counter() - start
        if now >= seconds:
            break
        due = int(now * messages_per_s)
        while sent < due:
            turn = sent % len(sockets)
            events = []
            for _ in range(events_per_message):
                tokens = [rng.randrange(8192) for _ in range(BLOCK * blocks)]
                hashes = list(range(next_hash, next_hash + blocks))
                next_hash += blocks
                events.append({"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": BLOCK})
            payload = encoder.encode([time.time(), events, 0])
            sockets[turn].send_multipart([b"kv-events", seqs[turn].to_bytes(8, "big"), payload])
            seqs[turn] += 1
            sent += 1
        time.sleep(0.001)
    print(json.dumps({"messages": sent, "events": sent * events_per_message}), flush=True)
    time.sleep(0.5)
    for socket in sockets:
        socket.close(linger=1000)
    context.term()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


async def phase(base: str, pid: int, seconds: float, rng: random.Random) -> dict[str, float]:
    """Requests at 50/s with token-id prompts for `seconds`; the router's decision time and the client's latency."""
    before = scrape(base) or {}
    latencies: list[float] = []
    rss: list[float] = []
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds:
            prompt = [rng.randrange(8192) for _ in range(BLOCK * 32)]
            body = {"model": "m", "prompt": prompt, "max_tokens": 1}
            sent = time.perf_counter()
            async with session.post(base + "/v1/completions", json=body) as response:
                await response.read()
                assert response.status == 200, response.status
            latencies.append(time.perf_counter() - sent)
            n += 1
            if n % 10 == 0:
                rss.append(rss_mb(pid))
            await asyncio.sleep(max(0.0, start + n / 50 - time.perf_counter()))
    after = scrape(base) or {}
    count = after.get("kvrouter_routing_decision_seconds_count", 0) - before.get(
        "kvrouter_routing_decision_seconds_count", 0
    )
    name = "kvrouter_routing_decision_seconds_sum"
    total = after.get(name, 0) - before.get(name, 0)
    return {
        "requests": len(latencies),
        "decision_mean_ms": round(1000 * total / count, 3) if count else float("nan"),
        "request_p50_ms": round(1000 * percentile(latencies, 0.5), 2),
        "request_p99_ms": round(1000 * percentile(latencies, 0.99), 2),
        "rss_max_mb": round(max(rss), 1) if rss else rss_mb(pid),
        "events_applied": after.get("kvrouter_kv_events_total", 0) - before.get("kvrouter_kv_events_total", 0),
        "index_blocks": after.get("kvrouter_index_blocks", 0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100_000, help="events per second offered (default 100k)")
    parser.add_argument("--seconds", type=float, default=20.0, help="flood duration (default 20)")
    parser.add_argument("--idle-seconds", type=float, default=8.0, help="idle phase before the flood")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--events-per-message", type=int, default=100)
    parser.add_argument("--blocks-per-event", type=int, default=1)
    parser.add_argument("--index-max-blocks", type=int, default=200_000, help="router's index budget")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--publish", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.publish:
        publish(args.publish.split(","), args.rate, args.seconds, args.events_per_message, args.blocks_per_event)
        return 0

    with tempfile.TemporaryDirectory(prefix="kvrouter-flood-") as tmp:
        work = Path(tmp)
        sim = start_sim(
            replicas=args.replicas,
            profile="cpu-tiny",
            replicas_file=work / "sim.yaml",
            log=work / "sim.log",
            extra=["--block-size", str(BLOCK)],
        )
        router = None
        publisher = None
        try:
            fleet = yaml.safe_load((work / "sim.yaml").read_text())
            base_port = free_port_range(args.replicas)
            endpoints = [f"tcp://127.0.0.1:{base_port + n}" for n in range(args.replicas)]
            for entry, endpoint in zip(fleet["replicas"], endpoints, strict=True):
                entry["kv_events"] = {"endpoint": endpoint, "topic": "kv-events"}
            (work / "replicas.yaml").write_text(yaml.safe_dump(fleet))
            os.environ["KVROUTER_INDEX_MAX_BLOCKS"] = str(args.index_max_blocks)
            port = free_port_range(1, start=base_port + args.replicas + 1)
            router = start_kvrouter(work / "replicas.yaml", port, "kv_aware", work / "router.log")
            base = f"http://127.0.0.1:{port}"
            pid = router.process.pid
            rng = random.Random(3)
            idle = asyncio.run(phase(base, pid, args.idle_seconds, rng))
            publisher = subprocess.Popen(
                [sys.executable, __file__, "--publish", ",".join(endpoints), "--rate", str(args.rate),
                 "--seconds", str(args.seconds), "--events-per-message", str(args.events_per_message),
                 "--blocks-per-event", str(args.blocks_per_event)],
                stdout=subprocess.PIPE,
            )  # fmt: skip
            time.sleep(1.5)
            flood = asyncio.run(phase(base, pid, args.seconds - 1.0, rng))
            out, _ = publisher.communicate(timeout=60)
            offered = json.loads(out.decode().strip().splitlines()[-1])
            final = scrape(base) or {}
            rss_end = rss_mb(pid)
            alive = router.alive()
        finally:
            if publisher is not None and publisher.poll() is None:
                publisher.kill()
            if router is not None:
                router.stop()
            sim.child.stop()
    result = {
        "offered_events_per_s": round(offered["events"] / args.seconds),
        "applied_events_per_s": round(flood["events_applied"] / (args.seconds - 1.0)),
        "index_budget_blocks": args.index_max_blocks,
        "index_blocks_end": final.get("kvrouter_index_blocks", 0),
        "rss_end_mb": round(rss_end, 1),
        "idle": idle,
        "flood": flood,
        "decision_mean_ratio": round(flood["decision_mean_ms"] / idle["decision_mean_ms"], 2),
        "request_p99_ratio": round(flood["request_p99_ms"] / idle["request_p99_ms"], 2),
        "router_alive": alive,
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    # kvrouter_index_blocks counts engine-hash mappings; evicted keys leave some behind until a sweep, which runs
    # once a quarter of the budget has piled up (kvrouter/index.py).
    return 0 if alive and result["index_blocks_end"] <= args.index_max_blocks * 1.25 + 128 else 1


if __name__ == "__main__":
    raise SystemExit(main())
