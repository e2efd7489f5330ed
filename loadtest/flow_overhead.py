"""What the router queue costs when the fleet is not saturated: latency and CPU per request, flow control on vs
off, measured in one run.

Starts the fast fake replica of `proxy_overhead.py` and, in front of it, one router process per setting (kv_aware,
the local tiny tokenizer, two replica entries pointing at the fast replica), `KVROUTER_FLOW_CONTROL=false` then
`true`, in alternating rounds. Per round: added latency is not measurable against a direct path here, so the
figure is the router's own latency with one closed-loop client (p50, p99) and its CPU microseconds per request
under `--concurrency` clients. The fast replica answers at once, so no replica is ever saturated: what the
queue adds is its classification of the request and one saturation check.

First, in process, the gate's own cost per request on that path (classify + admit, nothing saturated) against
one kv_aware decision. Run from the repository root: `python loadtest/flow_overhead.py` (about a minute). Prints
that, then per round and the medians, with on - off for p50 (target: <= 0.05 ms) and the CPU ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po
from shared_load_cost import stop

REPO = Path(__file__).resolve().parents[1]


def start_router(config: Path, port: int, *, flow: bool) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["KVROUTER_FLOW_CONTROL"] = "true" if flow else "false"
    argv = [
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1", "--port", str(port),
        "--policy", "kv_aware", "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO, env=env)


async def measure(args: argparse.Namespace, config: Path, flow: bool) -> tuple[float, float, float, int]:
    """(p50 s, p99 s, router CPU us per request, requests) for one round."""
    port = po.free_port()
    router = start_router(config, port, flow=flow)
    try:
        await po.wait_ready(port)
        await po.load(port, 4, 1.0)  # warm-up: connections, tokenizer cache, answer layouts
        latency = await po.load(port, 1, args.latency_duration)
        cpu_before = po.cpu_seconds(router.pid)
        run = await po.load(port, args.concurrency, args.duration)
        cpu = po.cpu_seconds(router.pid) - cpu_before
        if latency.errors or run.errors:
            raise RuntimeError(f"{latency.errors + run.errors} requests failed (flow {'on' if flow else 'off'})")
        return latency.quantile(0.5), latency.quantile(0.99), cpu / max(1, len(run.latencies)) * 1e6, len(run.latencies)
    finally:
        stop(router)


async def bench(args: argparse.Namespace, config: Path, replica_port: int) -> int:
    await po.wait_ready(replica_port)
    rows: dict[bool, list[tuple[float, float, float, int]]] = {False: [], True: []}
    for round_number in range(args.rounds):
        for flow in (False, True):
            rows[flow].append(await measure(args, config, flow))
            p50, p99, cpu_us, requests = rows[flow][-1]
            print(
                f"round {round_number + 1} flow {'on ' if flow else 'off'}: p50 {po.ms(p50)}, p99 {po.ms(p99)}, "
                f"{cpu_us:.0f} us CPU/request over {requests} requests"
            )

    def median(flow: bool, column: int) -> float:
        return statistics.median(row[column] for row in rows[flow])

    p50_off, p50_on = median(False, 0), median(True, 0)
    cpu_off, cpu_on = median(False, 2), median(True, 2)
    # Paired by round (the machine's load drifts between rounds): the median of the per-round differences.
    added = statistics.median(on[0] - off[0] for off, on in zip(rows[False], rows[True], strict=True))
    print(f"medians of {args.rounds} rounds: p50 off {po.ms(p50_off)}, on {po.ms(p50_on)}")
    print(f"  added p50 (median of per-round on - off): {po.ms(added)} (target <= 0.050 ms)")
    print(f"  router CPU per request: off {cpu_off:.0f} us, on {cpu_on:.0f} us, on/off {cpu_on / cpu_off:.3f}")
    print(f"  p99 off {po.ms(median(False, 1))}, on {po.ms(median(True, 1))}; load average {os.getloadavg()[0]:.1f}")
    return 0


def micro(iterations: int = 20_000) -> None:
    """The gate's own cost, in process: classify + admit on an idle fleet of 4 (the path every request takes
    while nothing is saturated), against one routing decision on the same request."""
    from prometheus_client import CollectorRegistry

    from kvrouter.config import Settings, parse_fleet
    from kvrouter.openai_request import parse_request
    from kvrouter.server.app import PROXY, ROUTER, create_app

    fleet = parse_fleet(
        {"replicas": [{"name": f"r{n}", "url": f"http://127.0.0.1:{9 + n}"} for n in range(4)]}, Path("x.yaml")
    )
    app = create_app(Settings(policy="kv_aware"), fleet, registry=CollectorRegistry())
    gate, router = app[PROXY].gate, app[ROUTER]
    assert gate is not None
    parsed = parse_request("chat", REQUEST)
    headers = {"x-kvrouter-priority": "high", "x-kvrouter-tenant": "team-a"}

    async def run() -> tuple[float, float]:
        facts = await router.facts(parsed)
        routes = [replica.route for replica in app[PROXY].replicas.routable()]
        started = time.perf_counter()
        for _ in range(iterations):
            flow = gate.classify(headers, "", parsed)
            await gate.admit(flow, facts, "bench")
        gate_s = (time.perf_counter() - started) / iterations
        started = time.perf_counter()
        for _ in range(iterations):
            router.decide(facts, routes)
        return gate_s, (time.perf_counter() - started) / iterations

    gate_s, decide_s = asyncio.run(run())
    print(
        f"in process, {iterations} iterations: gate (classify + admit, nothing saturated) {gate_s * 1e6:.1f} us per "
        f"request; one kv_aware decision over 4 replicas {decide_s * 1e6:.1f} us (ratio {gate_s / decide_s:.2f})"
    )


REQUEST = b'{"model": "bench-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of the CPU round per setting")
    parser.add_argument("--latency-duration", type=float, default=4.0, help="seconds of the one-client round")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients of the CPU round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating off/on rounds")
    parser.add_argument("--micro-only", action="store_true", help="only the in-process measurement of the gate")
    args = parser.parse_args()
    micro()
    if args.micro_only:
        return 0
    from kvrouter.tinymodel import ensure_tokenizer

    tokenizer = ensure_tokenizer()
    replica_port = po.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "replicas.yaml"
        config.write_text(
            f"tokenizer: {tokenizer}\nreplicas:\n"
            f"  - {{name: fast-a, url: 'http://127.0.0.1:{replica_port}'}}\n"
            f"  - {{name: fast-b, url: 'http://127.0.0.1:{replica_port}'}}\n"
        )
        replica = subprocess.Popen([sys.executable, po.__file__, "--serve-replica", str(replica_port)], cwd=REPO)
        try:
            return asyncio.run(bench(args, config, replica_port))
        finally:
            stop(replica)


if __name__ == "__main__":
    sys.exit(main())
