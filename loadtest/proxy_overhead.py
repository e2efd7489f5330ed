"""Proxy overhead: what kvrouter adds on top of talking to a replica directly, measured in one run.

Starts, as separate processes, a fast fake replica (a bare asyncio HTTP server answering a canned vLLM chat
completion, so the replica is never the bottleneck) and `kvrouter` in front of it (round-robin, one replica),
then drives both with the same closed-loop load generator (a minimal keep-alive HTTP/1.1 client on uvloop):

* latency below saturation: `--latency-concurrency` clients (default 1), direct and through the router in
  alternating rounds; added p50/p99 = router minus direct, median over rounds;
* throughput: `--concurrency` clients (default 64) for `--duration` seconds each, direct and through the router;
  the router's own CPU time over its run gives CPU microseconds per request, hence the requests per second one
  router process sustains on one core, independent of the load generator sharing the machine.

Run from the repository root: `python loadtest/proxy_overhead.py` (about 40 s). Prints the figures, the ratio
router/direct and the targets (>= 2,000 req/s per router process; added p50 <= 1 ms, p99 <= 5 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

REPO = Path(__file__).resolve().parents[1]

CANNED = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help?", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 24,
            "total_tokens": 31,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    }
).encode()
REQUEST_BODY = json.dumps(
    {
        "model": "bench-model",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}],
        "max_tokens": 8,
    }
).encode()


# -- the fast replica ---------------------------------------------------------------------------------------


def _http_response(status: str, body: bytes, content_type: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: keep-alive\r\n".encode()
    return head + b"Content-Type: " + content_type + b"\r\n\r\n" + body


class FastReplica(asyncio.Protocol):
    """Answers every completion with the canned JSON; /health and /metrics for the router's background work."""

    COMPLETION = _http_response("200 OK", CANNED, b"application/json")
    HEALTH = _http_response("200 OK", b"", b"text/plain")
    METRICS = _http_response(
        "200 OK",
        b'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
        b'vllm:kv_cache_usage_perc{engine="0"} 0.0\n',
        b"text/plain",
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            path = head.split(" ", 2)[1]
            if path.startswith("/health"):
                self.transport.write(self.HEALTH)
            elif path.startswith("/metrics"):
                self.transport.write(self.METRICS)
            else:
                self.transport.write(self.COMPLETION)


async def serve_replica(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FastReplica, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# -- the load generator -------------------------------------------------------------------------------------


@dataclass
class Run:
    latencies: list[float]
    seconds: float
    errors: int

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _client(port: int, deadline: float, latencies: list[float], errors: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(REQUEST_BODY)).encode() + b"\r\n\r\n" + REQUEST_BODY
    )
    clock = time.perf_counter
    try:
        while clock() < deadline:
            started = clock()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            closing = False
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
                elif line[:11].lower() == b"connection:" and b"close" in line.lower():
                    closing = True  # the router recycles a connection after client_keepalive_requests answers
            await reader.readexactly(length)
            latencies.append(clock() - started)
            if not head.startswith(b"HTTP/1.1 200"):
                errors[0] += 1
            if closing:
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
    finally:
        writer.close()


async def load(port: int, concurrency: int, seconds: float) -> Run:
    latencies: list[float] = []
    errors = [0]
    started = time.perf_counter()
    deadline = started + seconds
    await asyncio.gather(*(_client(port, deadline, latencies, errors) for _ in range(concurrency)))
    return Run(latencies, time.perf_counter() - started, errors[0])


# -- orchestration ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_ready(port: int, path: bytes = b"/health") -> None:
    for _ in range(400):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            line = await reader.readline()
            writer.close()
            if b" 200 " in line:
                return
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing ready on port {port}")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


async def bench(args: argparse.Namespace, replica_port: int, router_port: int, router_pid: int) -> int:
    await wait_ready(replica_port)
    await wait_ready(router_port)
    await load(router_port, 4, 1.0)  # warm-up: connections, caches
    await load(replica_port, 4, 0.5)

    print(f"latency below saturation: {args.latency_concurrency} client(s), {args.rounds} rounds x 2 s each way")
    direct50, router50, direct99, router99, added50s, added99s = [], [], [], [], [], []
    for _ in range(args.rounds):
        direct = await load(replica_port, args.latency_concurrency, 2.0)
        routed = await load(router_port, args.latency_concurrency, 2.0)
        direct50.append(direct.quantile(0.5))
        router50.append(routed.quantile(0.5))
        direct99.append(direct.quantile(0.99))
        router99.append(routed.quantile(0.99))
        added50s.append(routed.quantile(0.5) - direct.quantile(0.5))
        added99s.append(routed.quantile(0.99) - direct.quantile(0.99))
    print(f"  direct  p50 {ms(statistics.median(direct50))}  p99 {ms(statistics.median(direct99))}")
    print(f"  router  p50 {ms(statistics.median(router50))}  p99 {ms(statistics.median(router99))}")
    added50, added99 = statistics.median(added50s), statistics.median(added99s)
    print(f"  added   p50 {ms(added50)} (target <= 1 ms)  p99 {ms(added99)} (target <= 5 ms)")

    print(f"throughput: {args.concurrency} clients x {args.duration:.0f} s, short non-streaming requests")
    direct = await load(replica_port, args.concurrency, args.duration)
    cpu_before = cpu_seconds(router_pid)
    routed = await load(router_port, args.concurrency, args.duration)
    router_cpu = cpu_seconds(router_pid) - cpu_before
    cpu_us = router_cpu / max(1, len(routed.latencies)) * 1e6
    print(f"  direct  {direct.rate:8.0f} req/s  p50 {ms(direct.quantile(0.5))}  errors {direct.errors}")
    print(f"  router  {routed.rate:8.0f} req/s  p50 {ms(routed.quantile(0.5))}  errors {routed.errors}")
    print(f"  ratio router/direct {routed.rate / direct.rate:.2f}")
    print(
        f"  router CPU {cpu_us:.0f} us/request -> {1e6 / cpu_us:.0f} req/s per router process on one core "
        f"(target >= 2000); {os.cpu_count()} cores shared by load generator, router and replica"
    )
    print(f"  machine load average {os.getloadavg()[0]:.1f} at the end of the run (other work included)")
    return 0 if routed.errors == 0 and direct.errors == 0 else 1


def run_bench(args: argparse.Namespace, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None) -> int:
    replica_port, router_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "replicas.yaml"
        config.write_text(f"replicas:\n  - {{name: fast, url: 'http://127.0.0.1:{replica_port}'}}\n")
        try:
            processes.append(
                subprocess.Popen([sys.executable, __file__, "--serve-replica", str(replica_port)], cwd=REPO)
            )
            router = subprocess.Popen(
                [
                    sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1",
                    "--port", str(router_port), "--policy", "round_robin", "--log-level", "warning",
                ],
                cwd=REPO, env=env,
            )  # fmt: skip
            processes.append(router)
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                return runner.run(bench(args, replica_port, router_port, router.pid))
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per throughput run")
    parser.add_argument("--concurrency", type=int, default=64, help="clients in the throughput runs")
    parser.add_argument("--latency-concurrency", type=int, default=1, help="clients in the latency runs")
    parser.add_argument("--rounds", type=int, default=5, help="alternating direct/router latency rounds")
    parser.add_argument("--serve-replica", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    if args.serve_replica:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve_replica(args.serve_replica))
        return 0
    return run_bench(args, loop_factory)


if __name__ == "__main__":
    sys.exit(main())
