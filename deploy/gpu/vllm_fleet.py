#!/usr/bin/env python3
"""Bring up N real vLLM replicas on the GPUs of one host, write their replicas.yaml, stop them on exit.

Replica i runs on GPU `gpus[i // per_gpu]` (CUDA_VISIBLE_DEVICES), serves HTTP on `port_base + i` and publishes
its KV events on `kv_port_base + 2i` (PUB, vLLM binds: its endpoint has '*') with its replay socket on
`kv_port_base + 2i + 1`. Every replica gets the flags kvrouter needs (prefix caching, block size, prompt-token
details, KV events) plus `--enforce-eager` and the memory split: with several replicas on one GPU each takes
`--gpu-memory-utilization` of it (default 0.9 / per_gpu) and, when given, exactly `--kv-cache-memory-bytes` of
KV cache, so that every replica holds the same number of blocks. Extra vLLM flags go after `--`.

All replicas start at once (vLLM's start, model load and warm-up take a minute or two each); the script waits
until every `/health` answers 200, writes replicas.yaml (model, tokenizer directory, block size, one entry per
replica with its kv_events endpoints as the router reaches them) and then either runs `--exec CMD` (a shell
command; its exit code becomes the script's) or waits for SIGTERM / Ctrl-C. Either way every replica is
stopped by its own process group (each is started in a session of its own, so vLLM's engine-core child goes
with it): SIGTERM, then SIGKILL after `--grace` seconds. A replica that exits during start-up fails the whole
start (its log's tail is printed) and the others are stopped.

The environment passes through, with VLLM_SERVER_DEV_MODE=1 added (kvrouter bench resets the prefix caches
between rows with POST /reset_prefix_cache, a development endpoint) and HF_HUB_OFFLINE=1 (no downloads).
Only the standard library and PyYAML: it runs under the Python that has vLLM, without kvrouter installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import yaml


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """One replica: where it runs and listens."""

    name: str
    gpu: str
    port: int
    kv_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True, slots=True)
class FleetPlan:
    model: Path
    served_model_name: str
    tokenizer: Path
    replicas: tuple[ReplicaPlan, ...]
    block_size: int
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: str | None
    topic: str
    extra_args: tuple[str, ...]

    def command(self, replica: ReplicaPlan, python: str) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{replica.kv_port}",
            "replay_endpoint": f"tcp://*:{replica.replay_port}",
            "topic": self.topic,
        }
        argv = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(replica.port),
            "--block-size", str(self.block_size), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", str(self.max_model_len), "--enforce-eager",
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--kv-events-config", json.dumps(kv_events),
        ]  # fmt: skip
        if self.kv_cache_memory_bytes is not None:
            argv += ["--kv-cache-memory-bytes", self.kv_cache_memory_bytes]
        return argv + list(self.extra_args)

    def environment(self, replica: ReplicaPlan, base: dict[str, str]) -> dict[str, str]:
        return {
            **base,
            "CUDA_VISIBLE_DEVICES": replica.gpu,
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }

    def replicas_yaml(self) -> dict[str, object]:
        """What kvrouter reads (kvrouter/config.py's FleetConfig): vLLM binds, so the router connects."""
        return {
            "model": self.served_model_name,
            "tokenizer": str(self.tokenizer),
            "block_size": self.block_size,
            "replicas": [
                {
                    "name": r.name,
                    "url": r.url,
                    "kv_events": {
                        "endpoint": f"tcp://127.0.0.1:{r.kv_port}",
                        "replay_endpoint": f"tcp://127.0.0.1:{r.replay_port}",
                        "topic": self.topic,
                    },
                }
                for r in self.replicas
            ],
        }


def plan_replicas(gpus: list[str], per_gpu: int, port_base: int, kv_port_base: int) -> tuple[ReplicaPlan, ...]:
    if not gpus or per_gpu < 1:
        raise ValueError("need at least one GPU and one replica per GPU")
    plans = []
    for index in range(len(gpus) * per_gpu):
        gpu = gpus[index // per_gpu]
        plans.append(
            ReplicaPlan(f"vllm-{index}", gpu, port_base + index, kv_port_base + 2 * index, kv_port_base + 2 * index + 1)
        )
    return tuple(plans)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, required=True, help="Model directory (config.json, weights).")
    parser.add_argument("--served-model-name", default="model")
    parser.add_argument("--tokenizer", type=Path, default=None, help="Tokenizer directory (default: --model).")
    parser.add_argument("--gpus", default="0", help="Comma-separated GPU ids (CUDA_VISIBLE_DEVICES values).")
    parser.add_argument("--per-gpu", type=int, default=1, help="Replicas per GPU.")
    parser.add_argument("--port-base", type=int, default=8100)
    parser.add_argument("--kv-port-base", type=int, default=5600)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="Default: 0.9 / per-gpu.")
    parser.add_argument("--kv-cache-memory-bytes", default=None, help="KV cache per replica, e.g. 6G.")
    parser.add_argument(
        "--topic",
        default="",
        help="KV-event topic (default: vLLM's own, empty; vllm-router 0.1.17 applies no events under another).",
    )
    parser.add_argument("--python", default=sys.executable, help="The interpreter that has vLLM.")
    parser.add_argument("--out", type=Path, default=Path("replicas.yaml"), help="Where to write replicas.yaml.")
    parser.add_argument("--log-dir", type=Path, default=Path("vllm-logs"))
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="Seconds to wait for every /health.")
    parser.add_argument("--grace", type=float, default=20.0, help="Seconds between SIGTERM and SIGKILL on stop.")
    parser.add_argument("--exec", dest="exec_cmd", default=None, help="Shell command to run once all are up.")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands and replicas.yaml; start none.")
    return parser.parse_args(argv), extra


def fleet_plan(args: argparse.Namespace, extra: list[str]) -> FleetPlan:
    gpus = [gpu.strip() for gpu in args.gpus.split(",") if gpu.strip()]
    utilization = args.gpu_memory_utilization or round(0.9 / args.per_gpu, 3)
    return FleetPlan(
        model=args.model.resolve(), served_model_name=args.served_model_name,
        tokenizer=(args.tokenizer or args.model).resolve(),
        replicas=plan_replicas(gpus, args.per_gpu, args.port_base, args.kv_port_base),
        block_size=args.block_size, max_model_len=args.max_model_len, gpu_memory_utilization=utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, topic=args.topic, extra_args=tuple(extra),
    )  # fmt: skip


@dataclass(slots=True)
class Running:
    replica: ReplicaPlan
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start(plan: FleetPlan, python: str, log_dir: Path) -> list[Running]:
    log_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for replica in plan.replicas:
        log = log_dir / f"{replica.name}.log"
        with log.open("wb") as handle:
            process = subprocess.Popen(
                plan.command(replica, python), stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=plan.environment(replica, dict(os.environ)), start_new_session=True,
            )  # fmt: skip
        running.append(Running(replica, process, log))
        print(f"started {replica.name} on GPU {replica.gpu}: pid {process.pid}, {replica.url}, log {log}", flush=True)
    return running


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as response:
            return int(response.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_healthy(running: list[Running], timeout_s: float) -> None:
    started = time.monotonic()
    pending = {r.replica.name: r for r in running}
    while pending:
        for name, replica in list(pending.items()):
            if replica.process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {replica.process.returncode}:\n{replica.tail()}")
            if healthy(replica.replica.url):
                print(f"{name} healthy after {time.monotonic() - started:.0f} s", flush=True)
                del pending[name]
        if time.monotonic() - started > timeout_s:
            names = ", ".join(pending)
            raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {names}")
        time.sleep(1.0)


def stop(running: list[Running], grace_s: float) -> None:
    """SIGTERM each replica's process group, then SIGKILL the ones still there after the grace period."""
    for replica in running:
        if replica.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replica.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for replica in running:
        try:
            replica.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replica.process.pid, signal.SIGKILL)
            replica.process.wait(timeout=10)
        print(f"stopped {replica.replica.name} (pid {replica.process.pid})", flush=True)


class _Stop(Exception):
    pass


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    try:
        plan = fleet_plan(args, extra)
    except ValueError as error:
        print(f"vllm_fleet: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        for replica in plan.replicas:
            print(f"CUDA_VISIBLE_DEVICES={replica.gpu} " + shlex.join(plan.command(replica, args.python)))
        print(yaml.safe_dump(plan.replicas_yaml(), sort_keys=False), end="")
        return 0

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Stop

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    running: list[Running] = []
    try:
        running = start(plan, args.python, args.log_dir)
        wait_healthy(running, args.ready_timeout)
        args.out.write_text(yaml.safe_dump(plan.replicas_yaml(), sort_keys=False), encoding="utf-8")
        print(f"all {len(running)} replicas healthy; wrote {args.out}", flush=True)
        if args.exec_cmd is not None:
            return subprocess.run(args.exec_cmd, shell=True, check=False).returncode
        while all(r.process.poll() is None for r in running):
            time.sleep(1.0)
        dead = [r for r in running if r.process.poll() is not None]
        print(f"{dead[0].replica.name} exited with code {dead[0].process.returncode}:\n{dead[0].tail()}")
        return 1
    except RuntimeError as error:
        print(f"vllm_fleet: {error}", file=sys.stderr)
        return 1
    except _Stop:
        return 0
    finally:
        stop(running, args.grace)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
