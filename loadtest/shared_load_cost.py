"""What shared load costs a router: CPU per request with load sharing on vs off, and Redis traffic per 1,000
requests, measured in one run.

Starts a redis-server (no persistence, a free port), the fast fake replica of `proxy_overhead.py` and, in front
of it, router processes in Redis mode with the fleet's tokenizer (the local tiny one), so every request is
tokenized, keyed and routed by `kv_aware` as in production, and its routed prefix is shared. One extra router
instance only listens (it takes no requests): it is the peer whose reports the measured router folds in, and the
subscriber Redis fans the measured router's reports out to. Rounds alternate: the measured router with sharing
off (`KVROUTER_LOAD_SHARE=false`), then on, each over the same closed-loop load (`--concurrency` clients for
`--duration` s). Per round: the router's CPU time from /proc over the requests it answered, and Redis's own
`total_net_input_bytes` / `total_net_output_bytes` (INFO stats) over the round, and the load reports the
measured router published (`kvrouter_load_share_published_total`) and its staleness gauge at the round's end.

Run from the repository root: `python loadtest/shared_load_cost.py` (about a minute). Prints the median CPU
microseconds per request per setting, their ratio (target: on within 10% of off), and bytes into and out of
Redis and load reports per 1,000 requests with sharing on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po

REPO = Path(__file__).resolve().parents[1]


def redis_info(port: int) -> dict[str, int]:
    """Redis's INFO stats counters, read over a raw socket (one RESP bulk string)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"INFO stats\r\n")
        data = b""
        while b"\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n")
        length = int(head[1:])
        while len(body) < length:
            body += sock.recv(65536)
    stats = {}
    for line in body.decode().splitlines():
        name, sep, value = line.partition(":")
        if sep and value.strip().isdigit():
            stats[name] = int(value)
    return stats


def router_metric(port: int, name: str) -> float:
    """One sample of the router's /metrics (0 when absent: sharing off)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def start_router(config: Path, port: int, redis_port: int, *, share: bool) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["KVROUTER_LOAD_SHARE"] = "true" if share else "false"
    argv = [
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1", "--port", str(port),
        "--policy", "kv_aware", "--log-level", "warning", "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
    ]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO, env=env)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=20)


Row = tuple[float, int, int, int, float, float]


async def measure(args: argparse.Namespace, config: Path, replica_port: int, redis_port: int, share: bool) -> Row:
    """(router CPU us per request, requests, bytes into Redis, bytes out of Redis, reports published, staleness
    in ms at the end) for one round."""
    port = po.free_port()
    router = start_router(config, port, redis_port, share=share)
    try:
        await po.wait_ready(port)
        await po.load(port, 4, 1.0)  # warm-up: connections, tokenizer cache
        published = "kvrouter_load_share_published_total"
        reports_before = router_metric(port, published)
        before = redis_info(redis_port)
        cpu_before = po.cpu_seconds(router.pid)
        run = await po.load(port, args.concurrency, args.duration)
        cpu = po.cpu_seconds(router.pid) - cpu_before
        after = redis_info(redis_port)
        reports = router_metric(port, published) - reports_before
        staleness_ms = router_metric(port, "kvrouter_load_share_staleness_seconds") * 1000
        requests = len(run.latencies)
        into = after["total_net_input_bytes"] - before["total_net_input_bytes"]
        out = after["total_net_output_bytes"] - before["total_net_output_bytes"]
        return cpu / max(1, requests) * 1e6, requests, into, out, reports, staleness_ms
    finally:
        stop(router)


async def bench(args: argparse.Namespace, config: Path, replica_port: int, redis_port: int) -> int:
    await po.wait_ready(replica_port)
    listener_port = po.free_port()
    listener = start_router(config, listener_port, redis_port, share=True)
    try:
        await po.wait_ready(listener_port)
        rows: dict[bool, list[Row]] = {False: [], True: []}
        for round_number in range(args.rounds):
            for share in (False, True):
                rows[share].append(await measure(args, config, replica_port, redis_port, share))
                cpu_us, requests, into, out, reports, staleness_ms = rows[share][-1]
                print(
                    f"round {round_number + 1} sharing {'on ' if share else 'off'}: {requests} requests, "
                    f"{cpu_us:.0f} us CPU/request, Redis in {into} B, out {out} B, {reports:.0f} reports"
                    + (f", staleness {staleness_ms:.1f} ms" if share else "")
                )
    finally:
        stop(listener)
    off = statistics.median(row[0] for row in rows[False])
    on = statistics.median(row[0] for row in rows[True])
    print(f"router CPU per request, median of {args.rounds} rounds: off {off:.0f} us, on {on:.0f} us")
    print(f"  on/off {on / off:.3f} (target <= 1.10)")

    def per_thousand(share: bool, column: int) -> float:
        return statistics.median(row[column] / row[1] * 1000 / 1024 for row in rows[share])

    reports = statistics.median(row[4] / row[1] * 1000 for row in rows[True])
    print(
        f"Redis traffic per 1,000 requests, sharing on: in {per_thousand(True, 2):.1f} KiB, "
        f"out {per_thousand(True, 3):.1f} KiB; {reports:.0f} load reports published"
    )
    print(
        f"  sharing off (the rest of the plane, the listener's heartbeats): in {per_thousand(False, 2):.1f} KiB, "
        f"out {per_thousand(False, 3):.1f} KiB; {args.concurrency} clients, one listening peer; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per round and setting")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--rounds", type=int, default=3, help="alternating off/on rounds")
    args = parser.parse_args()
    from kvrouter.tinymodel import ensure_tokenizer

    tokenizer = ensure_tokenizer()
    redis = shutil.which("redis-server")
    if redis is None:
        print("redis-server is not on PATH", file=sys.stderr)
        return 2
    replica_port, redis_port = po.free_port(), po.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "replicas.yaml"
        config.write_text(
            f"tokenizer: {tokenizer}\nreplicas:\n"
            f"  - {{name: fast-a, url: 'http://127.0.0.1:{replica_port}'}}\n"
            f"  - {{name: fast-b, url: 'http://127.0.0.1:{replica_port}'}}\n"
        )
        processes = [
            subprocess.Popen(
                [redis, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                cwd=tmp,
                stdout=subprocess.DEVNULL,
            ),
            subprocess.Popen([sys.executable, po.__file__, "--serve-replica", str(replica_port)], cwd=REPO),
        ]
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis_info(redis_port)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            return asyncio.run(bench(args, config, replica_port, redis_port))
        finally:
            for process in processes:
                stop(process)


if __name__ == "__main__":
    sys.exit(main())
