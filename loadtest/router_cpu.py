"""Router CPU per request: kvrouter's own cost on long shared-prefix chat prompts, against a baseline, in one run.

Starts, as separate processes, four fast fake replicas (one process: a bare asyncio HTTP server per port that
answers every completion at once, as JSON or as an SSE stream with usage, and publishes vLLM KV events over ZMQ
for what it "computed") and one `kvrouter` per (source tree, policy) in front of them, then drives every router
in turn with the same closed-loop load generator (`--concurrency` keep-alive connections) and the same request
bodies. The figure is the router process's CPU time (user + system, from /proc/<pid>/stat) over a run divided
by the requests it served: what one request costs the router, which the machine's other load changes little
(wall-clock rates are printed too, and they do depend on it).

Workloads (deterministic, every body unique across runs so no router is handed an exact repeat):
* `tenants`: `--tenants` tenants, each with a ~`--system-tokens`-token system prompt, and a distinct
  ~50-token user turn per request (the tenant picked round-robin);
* `multiturn`: conversations over the same system prompts that grow by one user turn (~50 tokens) and one
  assistant answer (~30 tokens) per request, `--turns` turns each, a conversation's turns sent in order.

Each workload runs non-streaming and streaming (`"stream": true`, a few SSE chunks and a usage chunk). The
replicas publish, per request, a BlockStored event for the blocks they "computed" (the whole system prompt the
first time a replica sees a tenant, then a few tail blocks chained on it), so the router's KV-event ingest runs
during the measurement and its CPU is part of the figure.

Baseline: `--baseline REF` exports that git revision (`git archive`) into a temporary directory, builds its C
extensions and runs its router next to this checkout's, on the same bodies, interleaved repeat by repeat;
figures are medians over `--repeats`. `--workers-check` adds throughput with `--workers 2` against one worker
(`--workers-policy`, round_robin by default with no KV events; kv_aware with them, each worker subscribing to the
replicas' publishers), fresh routers each repeat, for the baseline too when one is given (then also the paired
ratios of this checkout's throughput and CPU per request to the baseline's). On a host with cores to spare,
`--router-cpus 0,1` pins every router to those cores and this script, the replicas and the load generator to the
others, and `--drivers N` spreads the workers check's connections over N load-generator processes, so that only
the router's cores limit its throughput. `--workers-apart` adds a third leg: two independent one-worker routers
(no shared load), each on its own port with half the load generators; `--workers 2`'s CPU per request over
theirs is what the workers' sharing costs beyond two busy router processes on the same cores.

Run from the repository root, e.g. `python loadtest/router_cpu.py --baseline main` (a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import random
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
_WORDS = (  # noqa: SIM905 (a sentence of words reads better than 75 quoted ones)
    "the of and to in is for that with on as by this be are from at or an which it not can all each their will has "
    "more one other data time use system user request model token answer question policy account invoice order "
    "customer support product service price report summary table query search result tool function schema field "
    "value error status retry cache replica router prefix block latency throughput queue budget tenant contract"
).split()


# -- request bodies -------------------------------------------------------------------------------------------


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def system_prompts(tenants: int, tokens: int, tokenizer: Any) -> list[str]:
    """One system prompt per tenant, ~`tokens` tokens of the tokenizer long, distinct from its first words."""
    rng = random.Random(20)
    probe = _text(rng, 2000)
    per_word = len(tokenizer(probe, add_special_tokens=False).input_ids) / 2000
    words = max(1, round(tokens / per_word))
    return [f"You are the assistant of tenant {t}. " + _text(rng, words) for t in range(tenants)]


def tenant_bodies(systems: list[str], count: int, stream: bool, salt: str) -> list[tuple[int, bytes]]:
    rng = random.Random(salt)
    bodies = []
    for n in range(count):
        tenant = n % len(systems)
        messages = [
            {"role": "system", "content": systems[tenant]},
            {"role": "user", "content": f"Request {salt}-{n}: " + _text(rng, 40)},
        ]
        bodies.append((tenant, _body(messages, tenant, stream)))
    return bodies


def conversation_bodies(systems: list[str], count: int, turns: int, stream: bool, salt: str) -> list[list[bytes]]:
    """`count` requests as conversations of `turns` requests each; a conversation's bodies in turn order."""
    rng = random.Random(salt)
    conversations = []
    for c in range((count + turns - 1) // turns):
        tenant = c % len(systems)
        messages: list[dict[str, str]] = [{"role": "system", "content": systems[tenant]}]
        bodies = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Conversation {salt}-{c} turn {turn}: " + _text(rng, 40)})
            bodies.append(_body(messages, tenant, stream))
            messages.append({"role": "assistant", "content": _text(rng, 25)})
        conversations.append(bodies)
    return conversations


def _body(messages: list[dict[str, str]], tenant: int, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": "bench-model", "messages": messages, "max_tokens": 8, "user": f"t{tenant}"}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


# -- the fake replicas ----------------------------------------------------------------------------------------

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "bench-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Fine."}, "finish_reason": "stop"},
        ],
        "usage": {
            "prompt_tokens": 4000,
            "total_tokens": 4008,
            "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 3968},
        },
    }
).encode()
_SSE_CHUNKS = [
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
    *[
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i
        for i in range(4)
    ],
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":4000,'
    b'"completion_tokens":8,"total_tokens":4008,"prompt_tokens_details":{"cached_tokens":3968}}}\n\n',
    b"data: [DONE]\n\n",
]


def _http(status: str, body: bytes, content_type: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: keep-alive\r\n".encode()
    return head + b"Content-Type: " + content_type + b"\r\n\r\n" + body


_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Events:
    """One replica's KV events: the tenant's system-prompt blocks the first time, then a few tail blocks."""

    def __init__(self, publisher: Any, prefixes: list[list[int]], replica: int) -> None:
        self.publisher = publisher
        self.prefixes = prefixes
        self.seen: set[int] = set()
        self.next_hash = (replica + 1) << 40
        self.seq = 0

    def request(self, tenant: int) -> None:
        from kvrouter.sim.model import StoredBlocks

        prefix = self.prefixes[tenant]
        blocks = len(prefix) // BLOCK_SIZE
        if blocks == 0:
            return
        first = (tenant + 1) << 20
        events = []
        if tenant not in self.seen:
            self.seen.add(tenant)
            hashes = tuple(first + i for i in range(blocks))
            events.append(StoredBlocks(hashes, None, tuple(prefix[: blocks * BLOCK_SIZE]), BLOCK_SIZE))
        tail = tuple(self.next_hash + i for i in range(3))
        self.next_hash += 3
        tokens = tuple((self.next_hash + i) % 8000 for i in range(3 * BLOCK_SIZE))
        events.append(StoredBlocks(tail, first + blocks - 1, tokens, BLOCK_SIZE))
        self.publisher(events)


def _replica_protocol(events: _Events | None) -> type[asyncio.Protocol]:
    class FastReplica(asyncio.Protocol):
        COMPLETION = _http("200 OK", _COMPLETION, b"application/json")
        HEALTH = _http("200 OK", b"", b"text/plain")
        # Routers that learn a worker's model from it (smg) ask /v1/models; vLLM's list, one card.
        MODELS = _http(
            "200 OK",
            b'{"object":"list","data":[{"id":"bench-model","object":"model","created":0,"owned_by":"vllm",'
            b'"root":"bench-model","parent":null,"max_model_len":32768}]}',
            b"application/json",
        )
        METRICS = _http(
            "200 OK",
            b'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
            b'vllm:kv_cache_usage_perc{engine="0"} 0.0\n',
            b"text/plain",
        )

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)
            self.buffer = b""
            self.loop = asyncio.get_running_loop()

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
                body = self.buffer[end + 4 : end + 4 + length]
                self.buffer = self.buffer[end + 4 + length :]
                parts = head.split(" ", 2)
                if len(parts) < 2:
                    continue  # not a request line (a stray blank line between keep-alive requests): no answer
                path = parts[1]
                if path.startswith("/health"):
                    self.transport.write(self.HEALTH)
                elif path.startswith("/metrics"):
                    self.transport.write(self.METRICS)
                elif path.startswith("/v1/models"):
                    self.transport.write(self.MODELS)
                else:
                    self.answer(body)

        def answer(self, body: bytes) -> None:
            if events is not None:
                at = body.find(b'"user": "t')
                if at >= 0:
                    events.request(int(body[at + 10 : body.index(b'"', at + 10)]))
            if b'"stream": true' not in body:
                self.transport.write(self.COMPLETION)
                return
            # Each SSE event in its own write, a loop turn apart, as an engine streams them.
            pieces = [_SSE_HEAD + _chunk(_SSE_CHUNKS[0]), *map(_chunk, _SSE_CHUNKS[1:]), b"0\r\n\r\n"]

            def send(i: int) -> None:
                if not self.transport.is_closing():
                    self.transport.write(pieces[i])
                    if i + 1 < len(pieces):
                        self.loop.call_soon(send, i + 1)

            send(0)

    return FastReplica


async def serve_replicas(ports: list[int], event_ports: list[int], prefixes: list[list[int]]) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    context = None
    if event_ports:
        import zmq

        from kvrouter.sim.publisher import encode_payload, encode_seq

        context = zmq.Context()
    for number, port in enumerate(ports):
        events = None
        if context is not None:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, 100_000)
            pub.bind(f"tcp://127.0.0.1:{event_ports[number]}")

            def publish(batch: list[Any], pub: Any = pub, seq: list[int] = [0]) -> None:  # noqa: B006
                payload = encode_payload(time.time(), batch)
                pub.send_multipart([b"kv-events", encode_seq(seq[0]), payload], flags=zmq.NOBLOCK)
                seq[0] += 1

            events = _Events(publish, prefixes, number)
        servers.append(await loop.create_server(_replica_protocol(events), "127.0.0.1", port, backlog=1024))
    await asyncio.gather(*(server.serve_forever() for server in servers))


# -- the load generator ---------------------------------------------------------------------------------------


@dataclass
class Run:
    requests: int
    seconds: float
    errors: int


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> tuple[bool, bool]:
    """One request and its whole answer: (answered 200, the answer said `Connection: close`)."""
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    length = -1
    chunked = closing = False
    for line in head.split(b"\r\n"):
        lower = line.lower()
        if lower.startswith(b"content-length:"):
            length = int(line[15:])
        elif lower.startswith(b"transfer-encoding:") and b"chunked" in lower:
            chunked = True
        elif lower.startswith(b"connection:") and b"close" in lower:
            closing = True  # the router recycles a connection after client_keepalive_requests answers
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length >= 0:
        await reader.readexactly(length)
    return head.startswith(b"HTTP/1.1 200"), closing


async def drive(port: int, concurrency: int, work: list[list[bytes]]) -> Run:
    """Each connection takes the next sequence of bodies from `work` and sends them in order, one at a time."""
    queue = iter(work)
    done = [0, 0]

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        try:
            for bodies in queue:
                for body in bodies:
                    ok, closing = await _exchange(reader, writer, body)
                    done[0 if ok else 1] += 1
                    if closing:
                        writer.close()
                        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return Run(done[0] + done[1], time.perf_counter() - started, done[1])


# -- orchestration --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as children:
            found += [int(c) for c in children.read().split()]
    return found


def cpu_seconds(pid: int) -> float:
    """CPU of `pid` and its live children (a --workers supervisor's routers)."""
    total = 0.0
    for each in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def wait_ready(port: int) -> None:
    for _ in range(1200):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            line = await reader.readline()
            writer.close()
            if b" 200 " in line:
                return
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing ready on port {port}")


def export_tree(ref: str, target: Path) -> Path:
    """`ref` of this repository as a plain tree with its C extensions built (the baseline's router). `ref` may also
    be a directory holding such a tree (`git archive REF` unpacked: for a host without the repository's history)."""
    if Path(ref).is_dir():
        shutil.copytree(ref, target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
        target.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    # setup.py alone declares the extensions; an older setuptools refuses the copy's pyproject.toml metadata.
    (target / "pyproject.toml").unlink(missing_ok=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=target, check=True, capture_output=True)
    return target


@dataclass
class RouterProcess:
    label: str
    policy: str
    port: int
    process: subprocess.Popen[bytes]


def _pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A preexec function that pins the child (and what it starts) to `cpus`; None leaves it unpinned."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def start_router(
    tree: Path,
    label: str,
    policy: str,
    config: Path,
    workers: int = 1,
    settings: tuple[str, ...] = (),
    cpus: set[int] | None = None,
) -> RouterProcess:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env.update(setting.split("=", 1) for setting in settings)
    # The tree first (its kvrouter, not the installed one), then whatever path this process was given (a host
    # whose dependencies live in a target directory, loadtest/gpu/cores_run.sh).
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    argv = [
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1",
        "--port", str(port), "--policy", policy, "--log-level", "warning", "--workers", str(workers),
    ]  # fmt: skip
    return RouterProcess(label, policy, port, subprocess.Popen(argv, cwd=tree, env=env, preexec_fn=_pinned(cpus)))


def start_peer(spec: str, worker_urls: list[str], cpus: set[int] | None = None) -> RouterProcess:
    """Another router, `NAME=COMMAND` with `{port}`, `{worker_urls}` (space-separated) and `{metrics_port}` (another
    free port, for a peer's own metrics listener: sglang-router and smg both default to 29000) in COMMAND."""
    name, _, template = spec.partition("=")
    port = free_port()
    command = template.format(port=port, worker_urls=" ".join(worker_urls), metrics_port=free_port())
    process = subprocess.Popen(shlex.split(command), stdout=subprocess.DEVNULL, preexec_fn=_pinned(cpus))
    return RouterProcess(name, "peer", port, process)


def write_config(path: Path, ports: list[int], event_ports: list[int], tokenizer: Path) -> None:
    lines = [f"tokenizer: '{tokenizer}'", f"block_size: {BLOCK_SIZE}", "replicas:"]
    for number, port in enumerate(ports):
        line = f"  - {{name: r{number}, url: 'http://127.0.0.1:{port}'"
        if event_ports:
            line += f", kv_events: {{endpoint: 'tcp://127.0.0.1:{event_ports[number]}'}}"
        lines.append(line + "}")
    path.write_text("\n".join(lines) + "\n")


def workloads(args: argparse.Namespace, systems: list[str], salt: str) -> Iterator[tuple[str, list[list[bytes]]]]:
    for name in args.workloads:
        for stream in args.streams:
            tag = f"{salt}-{name}-{stream}"
            if name == "tenants":
                work = [[body] for _, body in tenant_bodies(systems, args.requests, stream, tag)]
            else:
                work = conversation_bodies(systems, args.requests, args.turns, stream, tag)
            yield f"{name} {'streaming' if stream else 'non-streaming'}", work


async def measure(args: argparse.Namespace, routers: list[RouterProcess], systems: list[str]) -> None:
    for router in routers:
        await wait_ready(router.port)
    print(f"warm-up: {args.warmup} requests per router per workload")
    for _name, work in workloads(args, systems, "warm"):
        first, sent = [], 0
        for bodies in work:
            if sent >= args.warmup:
                break
            first.append(bodies)
            sent += len(bodies)
        for router in routers:
            await drive(router.port, args.concurrency, first)
    cpu: dict[tuple[str, str], list[float]] = {}
    by_repeat: dict[tuple[str, str], dict[int, float]] = {}
    rates: dict[tuple[str, str], list[float]] = {}
    dropped: dict[tuple[str, str], int] = {}
    for repeat in range(args.repeats):
        for name, work in workloads(args, systems, f"r{repeat}"):
            order = routers if repeat % 2 == 0 else routers[::-1]
            for router in order:
                before = cpu_seconds(router.process.pid)
                run = await drive(router.port, args.concurrency, work)
                used = cpu_seconds(router.process.pid) - before
                key = (name, f"{router.label} {router.policy}")
                if run.errors:
                    # A failed request costs a router far less than a served one: such a run is no figure.
                    print(f"  {key}: {run.errors} errors of {run.requests}: run left out")
                    dropped[key] = dropped.get(key, 0) + 1
                    continue
                cpu.setdefault(key, []).append(used / max(1, run.requests) * 1e6)
                by_repeat.setdefault(key, {})[repeat] = cpu[key][-1]
                rates.setdefault(key, []).append(run.requests / run.seconds)
        print(f"repeat {repeat + 1}/{args.repeats} done (load average {os.getloadavg()[0]:.1f})")
    print()
    print(f"router CPU per request, median of {args.repeats} runs of {args.requests} requests (range):")
    print("| workload | router | CPU µs/request | req/s per core | wall req/s (machine-dependent) |")
    print("|---|---|---|---|---|")
    for (name, who), values in cpu.items():
        median = statistics.median(values)
        spread = f"{min(values):,.0f}-{max(values):,.0f}"
        rate = statistics.median(rates[(name, who)])
        left_out = dropped.get((name, who), 0)
        runs = f", {len(values)} runs: {left_out} with errors left out" if left_out else ""
        print(f"| {name} | {who} | {median:,.0f} ({spread}{runs}) | {1e6 / median:,.0f} | {rate:,.0f} |")
    for name, who in dropped.keys() - cpu.keys():
        print(f"| {name} | {who} | every run had errors | | |")
    labels = {who.split(" ")[0] for _, who in cpu}
    if {"this", "base"} <= labels:
        print()
        for (name, who), values in cpu.items():
            label, policy = who.split(" ")
            base = cpu.get((name, f"base {policy}"))
            if label == "this" and base:
                ratio = statistics.median(values) / statistics.median(base)
                # Both routers ran the same bodies back to back in each repeat: the ratio within a repeat is
                # less exposed to the machine's load changing between repeats than the ratio of medians.
                mine, theirs = by_repeat[(name, who)], by_repeat[(name, f"base {policy}")]
                pairs = sorted(mine[r] / theirs[r] for r in mine.keys() & theirs.keys())
                paired = f", median of {len(pairs)} paired ratios {statistics.median(pairs):.2f}x" if pairs else ""
                spread = f" ({pairs[0]:.2f}-{pairs[-1]:.2f})" if pairs else ""
                print(
                    f"  {name} {policy}: this checkout's CPU per request is {ratio:.2f}x the baseline's{paired}{spread}"
                )


def _drive_share(port: int, concurrency: int, work: list[list[bytes]]) -> Run:
    """One load-generator process's part of the workers check (a fresh event loop in a forked child)."""
    return asyncio.run(drive(port, concurrency, work))


async def drive_spread(ports: list[int], concurrency: int, work: list[list[bytes]], drivers: int) -> tuple[Run, float]:
    """`drive` over `drivers` processes (the connections and the bodies split evenly; driver i sends to port
    i mod the ports given); with one driver and one port, in this loop. Returns the run (wall time: the slowest
    driver's) and the load generators' CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    if drivers <= 1 and len(ports) == 1:
        run = await drive(ports[0], concurrency, work)
    else:
        drivers = max(drivers, len(ports))
        shares = [work[i::drivers] for i in range(drivers)]
        context = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(drivers, mp_context=context) as pool:
            loop = asyncio.get_running_loop()
            each = max(1, concurrency // drivers)
            runs = await asyncio.gather(
                *(
                    loop.run_in_executor(pool, _drive_share, ports[i % len(ports)], each, share)
                    for i, share in enumerate(shares)
                )
            )
        run = Run(sum(r.requests for r in runs), max(r.seconds for r in runs), sum(r.errors for r in runs))
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before, strict=True))
    return run, cpu


def per_worker(port: int) -> dict[str, dict[str, float]]:
    """One scrape of a `--workers` router: every worker's samples, summed over their other labels, by the `worker`
    label (a scrape holds every worker's: kvrouter/server/worker_metrics.py); empty from a tree without it."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvrouter.loadgen.fleet import http_get

    try:
        status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return {}
    workers: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text if status == 200 else ""):
        for sample in family.samples:
            worker = sample.labels.get("worker")
            if worker is not None:
                figures = workers.setdefault(worker, {})
                figures[sample.name] = figures.get(sample.name, 0.0) + sample.value
    return workers


async def all_workers_up(port: int, workers: int, within_s: float = 60.0) -> None:
    """Until a scrape holds every worker (each listening), so none misses the warm-up's connections; a tree whose
    scrape has no `worker` label (before kvrouter/server/worker_metrics.py) gets a second instead."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        seen = await asyncio.to_thread(per_worker, port)
        if not seen:
            await asyncio.sleep(1.0)
            return
        if len(seen) >= workers:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"not every one of {workers} workers answered on port {port} within {within_s:.0f} s")


async def worker_figures(port: int) -> str:
    """After a leg: each worker's requests served and its shared-load figures (the stagger's mean wait, the
    measured staleness, placeholders, load reports per request), from one scrape."""
    seen = await asyncio.to_thread(per_worker, port)
    parts = []
    for _, figures in sorted(seen.items()):
        served = figures.get("kvrouter_requests_total", 0.0)
        waited = figures.get("kvrouter_load_share_staggered_decisions_total", 0.0)
        wait_ms = 1e3 * figures.get("kvrouter_load_share_stagger_seconds_total", 0.0) / waited if waited else 0.0
        staleness_ms = 1e3 * figures.get("kvrouter_load_share_staleness_seconds", float("nan"))
        placed = figures.get("kvrouter_load_share_blind_placeholders_total", 0.0) / max(1.0, served)
        published = figures.get("kvrouter_load_share_published_total", 0.0) / max(1.0, served)
        received = figures.get("kvrouter_load_share_received_total", 0.0) / max(1.0, served)
        parts.append(
            f"{served:,.0f} requests, stagger {wait_ms:.1f} ms mean over {waited:,.0f}, staleness {staleness_ms:.1f} "
            f"ms, {placed:.2f} placeholders, {published:.2f} reports sent and {received:.2f} received per request"
        )
    return "; ".join(parts) if parts else "(this tree's scrape has no worker label: no per-worker figures)"


@dataclass(frozen=True)
class Leg:
    """One leg of the workers check: `routers` routers of `workers` workers each, the load spread over them."""

    name: str
    routers: int
    workers: int
    salt: str  # seeds the leg's bodies


ONE, TWO = Leg("1 worker(s)", 1, 1, "w1"), Leg("2 worker(s)", 1, 2, "w2")
APART = Leg("2 routers apart", 2, 1, "w3")  # two independent one-worker routers (no shared load), each on its own port


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Repeat by repeat, sorted: the paired ratios whose median the workers check reports."""
    return sorted(a / b for a, b in zip(numerators, denominators, strict=True))


async def workers_check(
    args: argparse.Namespace,
    trees: list[tuple[str, Path]],
    config: Path,
    systems: list[str],
    cpus: set[int] | None,
) -> None:
    """`--workers 2` against one, for each tree (this checkout, and the `--baseline` export if any): every repeat
    starts fresh routers (warmed with `--warmup` requests, then timed over `--requests`), the trees' order
    alternating repeat by repeat, so that a machine whose speed drifts treats both alike."""
    policy = args.workers_policy
    print()
    print(
        f"--workers 2 vs 1 ({policy}, {args.requests} tenants requests, median of {args.repeats}, "
        f"{args.drivers} load-generator process(es), routers on cores {sorted(cpus) if cpus else 'any'}):"
    )
    legs = [ONE, TWO, APART] if args.workers_apart else [ONE, TWO]
    rates: dict[tuple[str, Leg], list[float]] = {}
    costs: dict[tuple[str, Leg], list[float]] = {}
    for repeat in range(args.repeats):
        for label, tree in trees if repeat % 2 == 0 else trees[::-1]:
            settings = tuple(args.setting) if label == "this" else ()
            for leg in legs:
                routers = [
                    start_router(tree, label, policy, config, settings=settings, workers=leg.workers, cpus=cpus)
                    for _ in range(leg.routers)
                ]
                ports = [router.port for router in routers]
                try:
                    for router in routers:
                        await wait_ready(router.port)
                        if leg.workers > 1:
                            await all_workers_up(router.port, leg.workers)
                    await asyncio.sleep(1.0)
                    salt = f"{leg.salt}-{label}-{repeat}"
                    warm = [[b] for _, b in tenant_bodies(systems, args.warmup, False, salt + "-warm-up")]
                    await drive_spread(ports, args.concurrency, warm, args.drivers)
                    bodies = [[b] for _, b in tenant_bodies(systems, args.requests, False, salt)]
                    cpu_before = sum(cpu_seconds(router.process.pid) for router in routers)
                    run, driver_cpu = await drive_spread(ports, args.concurrency, bodies, args.drivers)
                    router_cpu = sum(cpu_seconds(router.process.pid) for router in routers) - cpu_before
                    if leg.workers > 1:
                        print(f"    workers (warm-up included): {await worker_figures(ports[0])}")
                finally:
                    for router in routers:
                        router.process.terminate()
                    for router in routers:
                        router.process.wait(timeout=30)
                rate, cost = run.requests / run.seconds, 1e6 * router_cpu / max(1, run.requests)
                rates.setdefault((label, leg), []).append(rate)
                costs.setdefault((label, leg), []).append(cost)
                print(
                    f"  {label}, {leg.name}, repeat {repeat + 1}: {rate:,.0f} req/s, {run.errors} errors; "
                    f"router {router_cpu / run.seconds:.2f} cores busy, {cost:,.0f} µs CPU per request; "
                    f"load generator {driver_cpu / run.seconds:.2f} cores"
                )
    for label, _ in trees:
        one, two = statistics.median(rates[(label, ONE)]), statistics.median(rates[(label, TWO)])
        cost_one, cost_two = statistics.median(costs[(label, ONE)]), statistics.median(costs[(label, TWO)])
        each = ratios(rates[(label, TWO)], rates[(label, ONE)])
        print(
            f"  {label}: 1 worker {one:,.0f} req/s, 2 workers {two:,.0f} req/s: {two / one:.2f}x (wall clock: "
            f"machine-dependent); CPU per request {cost_one:,.0f} and {cost_two:,.0f} µs ({cost_two / cost_one:.2f}x)"
        )
        print(
            f"  {label}: 2 workers over 1, repeat by repeat: {statistics.median(each):.2f}x median "
            f"({', '.join(f'{r:.2f}' for r in each)})"
        )
        if args.workers_apart:
            apart = ratios(costs[(label, TWO)], costs[(label, APART)])
            print(
                f"  {label}: two independent routers {statistics.median(rates[(label, APART)]):,.0f} req/s, CPU per "
                f"request {statistics.median(costs[(label, APART)]):,.0f} µs; --workers 2's CPU per request over "
                f"theirs, repeat by repeat: {statistics.median(apart):.2f}x median "
                f"({', '.join(f'{r:.2f}' for r in apart)}) (what sharing costs beyond two busy routers)"
            )
    if len(trees) == 2:
        (this, _), (base, _) = trees

        def paired(series: dict[tuple[str, Leg], list[float]], leg: Leg) -> float:
            """The median over repeats of this tree's figure over the baseline's (the same repeat's)."""
            return statistics.median(ratios(series[(this, leg)], series[(base, leg)]))

        for leg in legs:
            print(
                f"  {this} against {base}, {leg.name}: throughput {paired(rates, leg):.2f}x, CPU per "
                f"request {paired(costs, leg):.2f}x (medians of the repeats' paired ratios)"
            )


def run_bench(args: argparse.Namespace, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None) -> int:
    from transformers import AutoTokenizer

    from kvrouter.tinymodel import ensure_tokenizer

    router_cpus = {int(c) for c in args.router_cpus.split(",")} if args.router_cpus else None
    if router_cpus:  # this script, the replicas and the load generators keep off the routers' cores
        others = set(range(os.cpu_count() or 1)) - router_cpus
        if not others:
            raise SystemExit("--router-cpus leaves no core for the replicas and the load generator")
        os.sched_setaffinity(0, others)
    tokenizer_dir = ensure_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    systems = system_prompts(args.tenants, args.system_tokens, tokenizer)
    heads = [tokenizer.apply_chat_template([{"role": "system", "content": s}], tokenize=False) for s in systems]
    prefixes = [tokenizer(head, add_special_tokens=False).input_ids for head in heads]
    print(f"{args.tenants} tenants, system prompts of ~{len(prefixes[0])} tokens ({len(systems[0]):,} characters)")
    ports = [free_port() for _ in range(4)]
    event_ports = [free_port() for _ in range(4)] if args.events else []
    processes: list[subprocess.Popen[bytes]] = []
    routers: list[RouterProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "replicas.yaml"
        write_config(config, ports, event_ports, tokenizer_dir)
        prefixes_file = Path(tmp) / "prefixes.json"
        prefixes_file.write_text(json.dumps(prefixes))
        trees = [("this", REPO)]
        if args.baseline:
            trees.append(("base", export_tree(args.baseline, Path(tmp) / "baseline")))
        replica_argv = [sys.executable, __file__, "--serve-replicas", ",".join(map(str, ports))]
        if event_ports:
            replica_argv += ["--event-ports", ",".join(map(str, event_ports)), "--prefixes", str(prefixes_file)]
        try:
            processes.append(subprocess.Popen(replica_argv, cwd=REPO))
            for label, tree in trees:
                for policy in args.policies:
                    settings = tuple(args.setting) if label == "this" else ()
                    routers.append(start_router(tree, label, policy, config, settings=settings, cpus=router_cpus))
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            for peer in args.peer:
                routers.append(start_peer(peer, urls, router_cpus))
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(measure(args, routers, systems))
                if args.workers_check:
                    plain = Path(tmp) / "plain.yaml"
                    write_config(plain, ports, [], tokenizer_dir)
                    checked = config if args.workers_policy == "kv_aware" else plain
                    runner.run(workers_check(args, trees, checked, systems, router_cpus))
        finally:
            for process in [*processes, *(r.process for r in routers)]:
                process.terminate()
            for process in [*processes, *(r.process for r in routers)]:
                process.wait(timeout=30)
            shutil.rmtree(Path(tmp) / "baseline", ignore_errors=True)
    print(f"machine load average {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores, other work included)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--baseline", metavar="REF", help="git revision to measure against (e.g. main), or a directory holding its tree"
    )
    parser.add_argument("--policies", type=lambda s: s.split(","), default=["kv_aware", "round_robin"])
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=["tenants", "multiturn"])
    parser.add_argument(
        "--streams", type=lambda s: [x == "on" for x in s.split(",")], default=[False, True], help="off,on"
    )
    parser.add_argument("--requests", type=int, default=1000, help="requests per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=200, help="requests per router and workload before measuring")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--turns", type=int, default=8, help="requests per conversation (multiturn)")
    parser.add_argument("--no-events", dest="events", action="store_false", help="replicas publish no KV events")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="KVROUTER_X=V",
        help="a setting for this checkout's routers only (a knob against the baseline)",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="another router ({port}, {worker_urls}, {metrics_port})",
    )
    parser.add_argument("--workers-check", action="store_true", help="also --workers 2 vs 1 throughput")
    parser.add_argument("--workers-policy", default="round_robin", help="the workers check's policy")
    parser.add_argument("--drivers", type=int, default=1, help="load-generator processes in the workers check")
    parser.add_argument(
        "--workers-apart",
        action="store_true",
        help="the workers check also runs two independent one-worker routers (no shared load), half the load each",
    )
    parser.add_argument("--router-cpus", help="pin the routers to these cores (e.g. 0,1), the rest to the others")
    parser.add_argument("--serve-replicas", help=argparse.SUPPRESS)
    parser.add_argument("--event-ports", default="", help=argparse.SUPPRESS)
    parser.add_argument("--prefixes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    if args.serve_replicas:
        ports = [int(p) for p in args.serve_replicas.split(",")]
        event_ports = [int(p) for p in args.event_ports.split(",") if p]
        prefixes = json.loads(Path(args.prefixes).read_text()) if args.prefixes else []
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve_replicas(ports, event_ports, prefixes))
        return 0
    return run_bench(args, loop_factory)


if __name__ == "__main__":
    sys.exit(main())
