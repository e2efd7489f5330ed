"""After one of `kvrouter --workers 2`'s processes restarts, how much of a kept-alive client's load reaches it
again, by `client_keepalive_requests`.

The kernel (SO_REUSEPORT) spreads connections over the workers, not requests. A client whose connections are
pooled and kept alive (a gateway, an SDK) therefore stays on the workers it first reached: when one worker
crashes, its connections reconnect to the survivor, and the restarted worker gets nothing from that pool until
connections are opened anew. The router closes a connection after its `client_keepalive_requests`-th answer
(`Connection: close`), so they are.

Per setting (`--allowances`, each a fresh router): the fast fake replica of `proxy_overhead.py` (twice in the
fleet, no KV events), `kvrouter --workers 2` with round_robin and without Redis (the workers share load over
their local datagram plane), and an aiohttp pool of `--connections` kept-alive connections sending short
completions back to back. After `--warmup` s one worker is killed (SIGKILL, a crash); the supervisor starts it
again after 1 s. Every `--window` s for `--after` s the script reads each worker's `kvrouter_requests_total` (one
scrape holds every worker's, labelled `worker`: kvrouter/server/worker_metrics.py) and prints the restarted
worker's share of the requests answered in that window.

Run from the repository root: `python loadtest/worker_restart.py` (about a minute per setting).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po
import router_cpu as rc

REPO = Path(__file__).resolve().parents[1]
BODY = b'{"model": "m", "prompt": "hello", "max_tokens": 4}'


def spawned_workers(supervisor: int) -> list[int]:
    """The supervisor's worker processes (multiprocessing's spawn children, not its resource tracker)."""
    found = []
    for child in rc._children(supervisor):
        try:
            if b"multiprocessing.spawn" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except FileNotFoundError:
            continue
    return sorted(found)


async def worker_counts(port: int) -> dict[str, float]:
    """Each worker in one scrape, by its `worker` label: the requests it answered (0 before its first)."""
    workers = await asyncio.to_thread(rc.per_worker, port)
    return {worker: figures.get("kvrouter_requests_total", 0.0) for worker, figures in workers.items()}


async def run_setting(args: argparse.Namespace, config: Path, allowance: int) -> None:
    port = po.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["KVROUTER_CLIENT_KEEPALIVE_REQUESTS"] = str(allowance)
    argv = [
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1", "--port", str(port),
        "--policy", "round_robin", "--log-level", "warning", "--workers", "2",
    ]  # fmt: skip
    router = await asyncio.create_subprocess_exec(*argv, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    answered = [0, 0]  # ok, failed
    stop = asyncio.Event()
    try:
        await po.wait_ready(port)
        await asyncio.sleep(2.0)  # both workers listening
        pool = aiohttp.TCPConnector(limit=args.connections)
        async with aiohttp.ClientSession(connector=pool) as session:

            async def client() -> None:
                while not stop.is_set():
                    try:
                        async with session.post(f"{url}/v1/completions", data=BODY) as response:
                            await response.read()
                            answered[0 if response.status == 200 else 1] += 1
                    except aiohttp.ClientError:
                        answered[1] += 1  # the killed worker's connections fail once

            clients = [asyncio.create_task(client()) for _ in range(args.connections)]
            await asyncio.sleep(args.warmup)
            before = await worker_counts(port)
            workers = spawned_workers(router.pid)
            os.kill(workers[-1], signal.SIGKILL)
            killed_at = time.monotonic()
            for _ in range(600):
                counts = await worker_counts(port)
                # Restarted: a new process, and the scrape holds both workers again.
                if spawned_workers(router.pid) != workers and len(counts) == 2:
                    break
                await asyncio.sleep(0.05)
            # The restarted worker counts from zero.
            restarted = min(("0", "1"), key=lambda w: counts.get(w, 0.0) - before.get(w, 0.0))
            survivor = "1" if restarted == "0" else "0"
            print(
                f"client_keepalive_requests={allowance}: worker {restarted} killed after {args.warmup:.0f} s, "
                f"back in {time.monotonic() - killed_at:.1f} s; {args.connections} pooled connections"
            )
            previous = counts
            for window in range(int(args.after / args.window)):
                await asyncio.sleep(args.window)
                counts = await worker_counts(port)
                new = counts.get(restarted, 0.0) - previous.get(restarted, 0.0)
                old = counts.get(survivor, 0.0) - previous.get(survivor, 0.0)
                print(
                    f"  {window * args.window:3.0f}-{(window + 1) * args.window:3.0f} s after the restart: "
                    f"restarted worker {new:,.0f} requests, the other {old:,.0f} ({new / max(1.0, new + old):.0%})"
                )
                previous = counts
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
            print(f"  requests answered {answered[0]:,}, failed {answered[1]:,} (the killed worker's in flight)")
    finally:
        stop.set()
        if router.returncode is None:
            router.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(router.wait(), 30)
            except TimeoutError:
                router.kill()
                await router.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--allowances", default="1000,0", help="client_keepalive_requests values, one router each")
    parser.add_argument("--connections", type=int, default=16, help="the client's pooled connections")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before a worker is killed")
    parser.add_argument("--after", type=float, default=40.0, help="seconds measured after the restart")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per printed window")
    args = parser.parse_args()
    replica_port = po.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "replicas.yaml"
        config.write_text(
            "replicas:\n"
            f"  - {{name: fast-a, url: 'http://127.0.0.1:{replica_port}'}}\n"
            f"  - {{name: fast-b, url: 'http://127.0.0.1:{replica_port}'}}\n"
        )
        replica = subprocess.Popen([sys.executable, po.__file__, "--serve-replica", str(replica_port)], cwd=REPO)
        try:
            asyncio.run(po.wait_ready(replica_port))
            for allowance in (int(a) for a in args.allowances.split(",")):
                asyncio.run(run_setting(args, config, allowance))
        finally:
            replica.terminate()
            replica.wait(timeout=20)
    print(f"load average {os.getloadavg()[0]:.1f} at the end (2-core machines: other work shares the cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
