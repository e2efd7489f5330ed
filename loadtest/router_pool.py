"""Several kvrouter instances behind one port, as pods behind a Service: for `kvrouter bench --router-cmd`.

Starts a redis-server (no persistence, a free port), `kvrouter relay` (the replicas' KV events into Redis),
`--routers` kvrouter instances in Redis mode (so they share the index and, unless `--no-share`, their load), and
a plain TCP balancer on `--port` that hands each new client connection to the next instance in turn. Locust users
keep their connection, so sessions spread over the instances as behind a connection-level load balancer.
SIGTERM or SIGINT stops every process it started, by PID. With `--samples FILE`, every `--sample-every` seconds
each instance's view of the fleet (`/debug/route` for a one-token prompt: per replica the load it counts, its own
and its peers', the queued prefill it estimates and the costs it prices with) is appended to FILE as one JSON line,
so a row whose requests piled on one replica shows which instance saw what.

    kvrouter bench --workload multi-tenant --policies '' \\
      --router-cmd "k1=python loadtest/router_pool.py --port {port} --replicas {replicas_file} --routers 1" \\
      --router-cmd "k3=python loadtest/router_pool.py --port {port} --replicas {replicas_file} --routers 3"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing ready at {url}")


def load_share_summary(port: int) -> str:
    """What an instance's load plane did, from its /metrics: staleness, and the stagger's decisions and waits."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5.0) as response:
            text = response.read().decode()
    except (OSError, ValueError) as error:
        return f"no metrics ({error})"
    families = list(text_string_to_metric_families(text))
    samples = [
        sample for family in families if family.name.startswith("kvrouter_load_share_") for sample in family.samples
    ]
    values = {s.name.removeprefix("kvrouter_load_share_"): s.value for s in samples if not s.labels}
    staggered = values.get("staggered_decisions_total", 0.0)
    waited = values.get("stagger_seconds_total", 0.0)
    mean_ms = 1000 * waited / staggered if staggered else 0.0
    staleness_ms = 1000 * values.get("staleness_seconds", float("nan"))
    placeholders = values.get("blind_placeholders_total", 0.0)
    problems = {s.labels["reason"]: s.value for s in samples if s.name == "kvrouter_load_share_problems_total"}
    refused = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(problems.items()) if count) or "none"
    return (
        f"peers {values.get('peers', 0):.0f}, staleness {staleness_ms:.1f} ms, published "
        f"{values.get('published_total', 0):.0f}, placeholders {placeholders:.0f}, staggered {staggered:.0f} "
        f"decisions (mean wait {mean_ms:.1f} ms), peers expired {values.get('expired_total', 0):.0f}, session "
        f"errors {values.get('session_errors_total', 0):.0f}, reports refused: {refused}; {cache_prediction(families)}"
    )


def cache_prediction(families: list[Metric]) -> str:
    """Predicted against actual cached tokens over the replicas, and the requests whose engine found 16k or more
    tokens fewer cached than the router predicted (a hit that was not there: the prompt's prefill was undercounted
    in the load the router priced)."""
    sums: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            name = sample.name
            if name in ("kvrouter_predicted_cached_tokens_total", "kvrouter_actual_cached_tokens_total"):
                sums[name] = sums.get(name, 0.0) + sample.value
            elif name == "kvrouter_cached_tokens_error_bucket" and float(sample.labels["le"]) == -16384.0:
                sums["short"] = sums.get("short", 0.0) + sample.value
            elif name == "kvrouter_cached_tokens_error_count":
                sums["requests"] = sums.get("requests", 0.0) + sample.value
    predicted = sums.get("kvrouter_predicted_cached_tokens_total", 0.0)
    actual = sums.get("kvrouter_actual_cached_tokens_total", 0.0)
    return (
        f"cached tokens predicted {predicted:,.0f}, actual {actual:,.0f}; {sums.get('short', 0.0):.0f} of "
        f"{sums.get('requests', 0.0):.0f} requests 16k+ tokens short of the predicted hit"
    )


SAMPLED = (
    "in_flight", "pending_prefill_tokens", "peer_pending_prefill_tokens", "queued_prefill_tokens",
    "decode_requests", "ttft_estimate_s", "prefill_tokens_per_s", "pass_fixed_s", "decode_s_per_request",
    "calibration_samples", "blind_group_ahead", "blind_placeholder_tokens",
)  # fmt: skip
"""What a sample keeps of each candidate of `/debug/route` (kv_aware's breakdown; the load includes the blind
group's placeholders for peers' unseen requests, `blind_placeholder_tokens` of it on that replica)."""


def view_of(port: int, model: str) -> dict[str, object]:
    """One instance's view of the fleet now: what `/debug/route` says of each replica for a one-token prompt."""
    body = json.dumps({"model": model, "prompt": [1], "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/debug/route", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5.0) as response:
            route = json.loads(response.read())
    except (OSError, ValueError) as error:
        return {"error": str(error)}
    candidates = {c["replica"]: {key: c[key] for key in SAMPLED if key in c} for c in route.get("candidates", [])}
    return {"chosen": route.get("chosen"), "blind_group": route.get("blind_group"), "replicas": candidates}


async def sample(ports: list[int], model: str, path: Path, every_s: float, stop: asyncio.Event) -> None:
    """Append every instance's view to `path` every `every_s` seconds until `stop`."""
    with path.open("a") as out:
        while not stop.is_set():
            at = time.time()
            views = await asyncio.gather(*(asyncio.to_thread(view_of, port, model) for port in ports))
            for index, view in enumerate(views):
                out.write(json.dumps({"t": round(at, 3), "instance": index, **view}) + "\n")
            out.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=every_s)


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5.0) as response:
        models = json.loads(response.read())
    return str(models["data"][0]["id"])


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def balance(port: int, backends: list[int], stop: asyncio.Event) -> None:
    turn = itertools.cycle(backends)

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", next(turn))
        except OSError:
            client_writer.close()
            return
        for sock in (client_writer, upstream_writer):
            raw = sock.get_extra_info("socket")
            if raw is not None:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await stop.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replicas", type=Path, required=True)
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--policy", default="kv_aware")
    parser.add_argument("--no-share", action="store_true", help="Routers do not share load (KVROUTER_LOAD_SHARE).")
    parser.add_argument("--samples", type=Path, help="Append each instance's view of the fleet here (JSON lines).")
    parser.add_argument("--sample-every", type=float, default=5.0, help="Seconds between samples (--samples).")
    args = parser.parse_args()
    redis = shutil.which("redis-server")
    if redis is None:
        print("router_pool: redis-server is not on PATH", file=sys.stderr)
        return 2
    processes: list[subprocess.Popen[bytes]] = []
    stop = asyncio.Event()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            redis_port = free_port()
            processes.append(
                subprocess.Popen(
                    [redis, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                    cwd=tmp,
                    stdout=subprocess.DEVNULL,
                )
            )
            url = f"redis://127.0.0.1:{redis_port}/0"
            kvrouter = [sys.executable, "-m", "kvrouter.cli"]
            env = {**os.environ, "KVROUTER_LOAD_SHARE": "false" if args.no_share else "true"}
            processes.append(
                subprocess.Popen([*kvrouter, "relay", "--replicas", str(args.replicas), "--redis-url", url], env=env)
            )
            ports = [free_port() for _ in range(args.routers)]
            for port in ports:
                argv = [
                    *kvrouter, "--replicas", str(args.replicas), "--host", "127.0.0.1", "--port", str(port),
                    "--policy", args.policy, "--redis-url", url, "--log-level", "warning",
                ]  # fmt: skip
                processes.append(subprocess.Popen(argv, cwd=REPO, env=env))
            for port, process in zip(ports, processes[2:], strict=True):
                wait_http(f"http://127.0.0.1:{port}/ready", process)

            def on_signal(signum: int, _frame: object) -> None:
                stop.set()

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)

            async def serve() -> None:
                loop = asyncio.get_running_loop()
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(signum, stop.set)
                tasks = [balance(args.port, ports, stop)]
                if args.samples is not None:
                    tasks.append(sample(ports, served_model(ports[0]), args.samples, args.sample_every, stop))
                await asyncio.gather(*tasks)

            asyncio.run(serve())
            for port in ports:
                print(f"router_pool: instance on {port}: {load_share_summary(port)}", file=sys.stderr, flush=True)
        finally:
            for process in reversed(processes):
                if process.poll() is None:
                    process.terminate()
            for process in reversed(processes):
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
