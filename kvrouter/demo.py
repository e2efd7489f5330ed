"""`kvrouter demo`: a two-minute round-robin vs KV-aware comparison on simulated replicas.

Everything runs locally from the installed package (`pip install 'kvrouter[loadtest]'`): a tokenizer built on
the spot (`kvrouter.tinymodel`), four simulated 4×B200 replicas of a ~1T-parameter MoE (`kvrouter sim`, no
GPU, no Redis), a fresh kvrouter per policy in front of fresh replicas, and Locust replaying a multi-tenant
workload — 100 tenants, each with a ~9,000-token system prompt and tool schemas, short user turns — at a rate
that keeps round-robin's replicas busy. The tenants' prefixes together are larger than one replica's KV cache:
round-robin makes every replica hold every tenant and evict them; KV-aware routing gives each tenant a home.
The demo is `kvrouter bench` with fixed settings; it prints progress, then the comparison table (with the load
generator's lateness, and a warning when the machine was too busy to keep the schedule), and leaves the full
report (report.md, plots) in `--out`. Like the bench it checks the `loadtest` extra first (exit 2 without it)
and stops every child process on SIGTERM as on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys

from kvrouter import bench
from kvrouter.loadgen.fleet import FleetError, interrupts_stop_children
from kvrouter.loadgen.report import console_table

# Engine-time settings of the demo's workload; see the module docstring.
DEMO_SETTINGS: dict[str, str] = {
    "--workload": "multi-tenant",
    "--replicas": "4",
    "--profile": "b200x4-moe-1t",
    "--tenants": "100",
    "--system-tokens": "8000",
    "--output-tokens": "16",
    "--rate": "22",
    "--time-scale": "0.5",
    "--slo-ttft": "1.0",
    "--users": "256",
    "--drain": "60",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="kvrouter-demo", help="Report directory (default ./kvrouter-demo).")
    parser.add_argument("--duration", type=float, default=30.0, help="Wall seconds of load per policy.")
    parser.add_argument(
        "--policies", default="round_robin,least_loaded,kv_aware", help="Comma-separated; the first is the baseline."
    )
    parser.add_argument("--seed", type=int, default=0)


def bench_argv(args: argparse.Namespace) -> list[str]:
    argv = [item for pair in DEMO_SETTINGS.items() for item in pair]
    return [*argv, "--out", str(args.out), "--duration", str(args.duration), "--policies", args.policies,
            "--seed", str(args.seed)]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="kvrouter demo")
    bench.add_arguments(parser)
    bench_args = parser.parse_args(bench_argv(args))
    try:
        plan = bench.plan_from_args(bench_args)
    except ValueError as error:
        print(f"kvrouter demo: {error}", file=sys.stderr)
        return 2
    refusal = bench.loadtest_refusal("demo")
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    print(
        f"kvrouter demo: {len(plan.rows)} policies x {args.duration:.0f} s of load on {plan.replicas} simulated "
        f"replicas ({plan.profile}); the simulator runs at {plan.time_scale}x real time, figures are engine time.",
        flush=True,
    )
    try:
        with interrupts_stop_children():
            report = bench.execute(plan, say=lambda text: print(text, flush=True))
    except FleetError as error:
        print(f"kvrouter demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        return bench.interrupted_exit("demo", error, plan.out)
    print()
    print(console_table(report))
    print(f"\nfull report: {plan.out / 'report.md'}{bench.plots_note(report)}")
    return 0
