"""`kvrouter bench`: the same workload through each routing policy (and other routers), side by side.

For every row — each `--policies` entry, each `--router-cmd`, each `--target` — the bench starts fresh simulated
replicas (cold caches, `kvrouter sim`) — or, with `--fleet replicas.yaml`, empties the prefix caches of replicas
already running (real vLLM: POST /reset_prefix_cache) — and a fresh router in front of them, runs Locust headless as a
subprocess on the identical schedule (same seed, same arrivals, same bytes), samples the replicas' /metrics
every second while it runs, and afterwards writes into `--out`: report.json, report.md, ttft_cdf.png,
ttft_over_time.png, replica_load.png, and per row the Locust CSVs, the per-request records and the logs.

Time: `--duration` is wall seconds of arrivals per row. `--time-scale X` runs the simulated engines X times
faster than real time (below 1: slower, which spares a small machine the streaming load); arrival rates,
think times and the trace speed-up are given in engine time and scaled here, and the report shows engine time.

`--router-cmd 'NAME=COMMAND'` runs another router in front of the same kind of fleet (`ROUTER_CMD_HELP`);
see docs/benchmarks.md for the commands used with smg, sglang-router and vllm-router. `--target 'NAME=URL'`
load-tests an endpoint that is already running (no simulator; replica metrics only from `--target-metrics`).

Before anything starts, Locust and matplotlib (the `loadtest` extra) must import, else exit 2 with the install
command. SIGTERM stops the run as Ctrl-C does: every child process is stopped and the partial report kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrouter.config import POLICY_NAMES
from kvrouter.loadgen.fleet import (
    LOADTEST_INSTALL,
    Child,
    ExternalFleet,
    FleetError,
    SimFleet,
    Terminated,
    external_fleet,
    free_port_range,
    interrupts_stop_children,
    locust_argv,
    missing_loadtest_modules,
    reset_prefix_caches,
    scrape,
    start_child,
    start_kvrouter,
    start_router_cmd,
    start_sim,
    stop_all,
)
from kvrouter.loadgen.plan import WorkloadParams
from kvrouter.loadgen.report import LoadSample, RowData, console_table, counter_deltas, read_records, summarize
from kvrouter.loadgen.workloads import WORKLOADS, build_schedule, count_requests

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake" / ("conversation_trace.jsonl")
)
"""Where a source checkout keeps the Mooncake trace (beside the repository); an installed package has none."""

ROUTER_CMD_HELP = """\
--router-cmd 'NAME=COMMAND' runs another router in front of fresh simulated replicas. COMMAND is a template;
these placeholders are filled in:
  {port}                   the port the router must listen on (127.0.0.1)
  {worker_urls}            the replicas' base URLs, space-separated ({worker_urls_csv}: comma-separated)
  {replicas_file}          a kvrouter replicas.yaml of the fleet
  {block_size}             the engines' KV block size
  {kv_event_sources}       WORKER_URL=tcp://HOST:PORT per replica, space-separated
  {kv_event_source_flags}  `--kv-event-source WORKER_URL=tcp://HOST:PORT` per replica
  {kv_endpoints}           the replicas' KV-event endpoints tcp://HOST:PORT, space-separated
  {model}                  the served model name (replicas.yaml `model`)
  {tokenizer}              the model's tokenizer directory (replicas.yaml `tokenizer`)
Simulated replicas refuse a request naming another model (404, as vLLM); Locust sends the fleet's model name.
docs/benchmarks.md has the commands used for smg, sglang-router and vllm-router."""


@dataclass(frozen=True, slots=True)
class RowSpec:
    name: str
    kind: str
    """"policy", "router-cmd" or "target"."""
    value: str
    """Policy name, command template or URL."""


@dataclass(slots=True)
class BenchPlan:
    workload: str
    params: WorkloadParams
    """Wall-clock workload parameters (engine-time knobs already scaled)."""
    rows: list[RowSpec]
    out: Path
    replicas: int
    profile: str
    time_scale: float
    users: int
    drain_s: float
    slo_ttft_s: float
    tokenizer: Path | None
    sim_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    target_metrics: list[str] = field(default_factory=list)
    quiet: bool = False
    fleet: Path | None = None
    """A replicas.yaml of replicas already running (real vLLM): every row runs against them, caches reset."""
    session_header: bool = False
    """Clients send their session key as x-session-id (session affinity hints)."""

    def locust_flags(self) -> list[str]:
        p = self.params
        flags = ["--kv-workload", self.workload, "--kv-seed", str(p.seed), "--kv-duration", str(p.duration_s),
                 "--kv-rate", str(p.rate), "--kv-tenants", str(p.tenants), "--kv-system-tokens", str(p.system_tokens),
                 "--kv-output-tokens", str(p.output_tokens), "--kv-turns", str(p.turns), "--kv-think", str(p.think_s),
                 "--kv-trace-speedup", str(p.trace_speedup), "--kv-trace-start", str(p.trace_start_s),
                 "--kv-vocab", str(p.vocab_high)]  # fmt: skip
        if p.trace is not None:
            flags += ["--kv-trace", str(p.trace)]
        if self.session_header:
            flags.append("--kv-session-header")
        return flags

    def parameters(self) -> dict[str, Any]:
        p = self.params
        scale = self.time_scale
        common: dict[str, Any] = {
            "workload": self.workload,
            "replicas": self.replicas,
            "profile": self.profile if self.fleet is None else "external",
            **({"fleet": str(self.fleet)} if self.fleet is not None else {}),
            "time_scale": scale,
            "wall_duration_s": p.duration_s,
            "engine_duration_s": p.duration_s * scale,
            "seed": p.seed,
        }
        if p.trace is not None:
            knobs: dict[str, Any] = {
                "trace": str(p.trace),
                "trace_speedup_engine": p.trace_speedup / scale,
                "trace_start_s": p.trace_start_s,
            }
        else:
            knobs = {
                "rate_per_engine_s": p.rate / scale,
                "tenants": p.tenants,
                "system_tokens": p.system_tokens,
                "output_tokens": p.output_tokens,
                "turns": p.turns,
                "think_engine_s": p.think_s * scale,
            }
        return {
            **common,
            **knobs,
            "users": self.users,
            "sim_args": self.sim_args,
            "router_args": self.router_args,
            "session_header": self.session_header,
            "slo_ttft_s": self.slo_ttft_s,
            "rows": {row.name: f"{row.kind}: {row.value}" for row in self.rows},
            "command": "kvrouter " + " ".join(sys.argv[1:]),
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ROUTER_CMD_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--workload", default="multi-tenant", choices=sorted(WORKLOADS))
    parser.add_argument("--replicas", type=int, default=4, help="Simulated replicas per row.")
    parser.add_argument(
        "--fleet",
        type=Path,
        default=None,
        metavar="REPLICAS_YAML",
        help="Run every row against these running replicas (real vLLM) instead of simulated ones; their prefix "
        "caches are reset before each row (POST /reset_prefix_cache: vLLM needs VLLM_SERVER_DEV_MODE=1).",
    )
    parser.add_argument("--profile", default="b200x4-moe-1t", help="Simulator profile.")
    parser.add_argument("--duration", type=float, default=60.0, help="Wall seconds of arrivals per row.")
    parser.add_argument("--policies", default="round_robin,least_loaded,kv_aware", help="Comma-separated ('' none).")
    parser.add_argument(
        "--router-cmd",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="Another router in front of fresh simulated replicas (COMMAND: a template, see below).",
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="An endpoint already running; load-tested as is.",
    )
    parser.add_argument(
        "--target-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="Replica base URLs whose /metrics belong to --target rows.",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="Report directory.")
    parser.add_argument("--time-scale", type=float, default=1.0, help="Engine seconds per wall second.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=None, help="Sessions per engine second (chat workloads).")
    parser.add_argument("--tenants", type=int, default=None)
    parser.add_argument("--system-tokens", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--think", type=float, default=None, help="Mean pause between turns, engine seconds.")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="Mooncake trace (JSONL) for --workload mooncake; in a source checkout the default is "
        "../shared/traces/mooncake/conversation_trace.jsonl beside the repository.",
    )
    parser.add_argument("--trace-speedup", type=float, default=1.0, help="Trace seconds per engine second.")
    parser.add_argument("--trace-start", type=float, default=0.0, help="Offset into the trace, seconds.")
    parser.add_argument("--users", type=int, default=512, help="Locust users (concurrent sessions at most).")
    parser.add_argument("--drain", type=float, default=180.0, help="Wall seconds allowed after the last arrival.")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO for goodput, engine seconds.")
    parser.add_argument("--tokenizer", type=Path, default=None, help="Tokenizer dir (default: the tiny one).")
    parser.add_argument("--sim-arg", action="append", default=[], help="Extra argument for `kvrouter sim`.")
    parser.add_argument("--router-arg", action="append", default=[], help="Extra argument for kvrouter.")
    parser.add_argument("--quiet", action="store_true", help="No progress lines.")
    parser.add_argument(
        "--session-header",
        action="store_true",
        help="Clients send each chat / agent session's key as x-session-id (set KVROUTER_SESSION_MODE to compare).",
    )


def _split_named(values: list[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"{flag} expects NAME=VALUE, got {value!r}")
        pairs.append((name.strip(), rest.strip()))
    return pairs


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be positive")
    replicas = args.replicas
    if args.fleet is not None:
        if args.time_scale != 1.0:
            raise ValueError("--time-scale applies to simulated replicas only; real ones run in real time")
        try:
            replicas = len(external_fleet(args.fleet).replicas)
        except FleetError as error:
            raise ValueError(str(error)) from None
    scale = args.time_scale
    rows = []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
        rows.append(RowSpec(policy, "policy", policy))
    rows += [RowSpec(name, "router-cmd", cmd) for name, cmd in _split_named(args.router_cmd, "--router-cmd")]
    rows += [RowSpec(name, "target", url) for name, url in _split_named(args.target, "--target")]
    if not rows:
        raise ValueError("nothing to run: give --policies, --router-cmd or --target")
    if len({row.name for row in rows}) != len(rows):
        raise ValueError("row names must be unique")
    base = WorkloadParams(seed=args.seed, duration_s=args.duration)
    trace = args.trace or (DEFAULT_TRACE if args.workload == "mooncake" else None)
    if args.workload == "mooncake" and (trace is None or not trace.is_file()):
        raise ValueError(f"trace file not found: {trace}")
    params = WorkloadParams(
        seed=args.seed,
        duration_s=args.duration,
        rate=(args.rate if args.rate is not None else base.rate) * scale,
        tenants=args.tenants if args.tenants is not None else base.tenants,
        system_tokens=args.system_tokens if args.system_tokens is not None else base.system_tokens,
        output_tokens=args.output_tokens if args.output_tokens is not None else base.output_tokens,
        turns=args.turns if args.turns is not None else base.turns,
        think_s=(args.think if args.think is not None else base.think_s) / scale,
        trace=trace,
        trace_speedup=args.trace_speedup * scale,
        trace_start_s=args.trace_start,
    )
    return BenchPlan(
        workload=args.workload, params=params, rows=rows, out=args.out, replicas=replicas,
        profile=args.profile, time_scale=scale, users=args.users, drain_s=args.drain, slo_ttft_s=args.slo_ttft,
        tokenizer=args.tokenizer, sim_args=list(args.sim_arg), router_args=list(args.router_arg),
        target_metrics=list(args.target_metrics), quiet=args.quiet, fleet=args.fleet,
        session_header=args.session_header,
    )  # fmt: skip


@dataclass(slots=True)
class _Progress:
    """Reads the records file as it grows; prints one line every few seconds."""

    path: Path
    scheduled: int
    offset: int = 0
    done: int = 0
    errors: int = 0
    recent_ttft: list[float] = field(default_factory=list)
    recent_late: list[float] = field(default_factory=list)
    """Wall seconds each recent request was sent after its scheduled time."""

    def poll(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        cut = chunk.rfind(b"\n")
        if cut < 0:
            return
        self.offset += cut + 1
        for line in chunk[: cut + 1].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.done += 1
            if record.get("due_s") is not None and record.get("start_s") is not None:
                self.recent_late.append(max(0.0, float(record["start_s"]) - float(record["due_s"])))
            if record.get("error") is not None:
                self.errors += 1
            elif record.get("ttft_s") is not None:
                self.recent_ttft.append(record["ttft_s"])
        self.recent_ttft = self.recent_ttft[-200:]
        self.recent_late = self.recent_late[-200:]


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def _start_router(plan: BenchPlan, spec: RowSpec, sim: SimFleet | ExternalFleet, row_dir: Path) -> tuple[Child, str]:
    port = free_port_range(1)
    log = row_dir / "router.log"
    if spec.kind == "policy":
        child = start_kvrouter(sim.replicas_file, port, spec.value, log, plan.router_args)
    else:
        child = start_router_cmd(spec.name, spec.value, port, sim, log)
    return child, f"http://127.0.0.1:{port}"


def _tokenizer(plan: BenchPlan) -> Path:
    if plan.tokenizer is not None:
        return plan.tokenizer
    from kvrouter.tinymodel import ensure_tokenizer

    return ensure_tokenizer()


def run_row(plan: BenchPlan, spec: RowSpec, scheduled: int, say: Any) -> RowData:
    row_dir = plan.out / spec.name
    row_dir.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    try:
        replicas: dict[str, str] = {}
        model = ""  # a target's model is asked from its /v1/models
        if spec.kind == "target":
            host = spec.value.rstrip("/")
            replicas = {f"replica-{i}": url.rstrip("/") for i, url in enumerate(plan.target_metrics)}
        else:
            sim: SimFleet | ExternalFleet
            if plan.fleet is not None:
                say(f"[{spec.name}] resetting the prefix caches of {plan.replicas} replicas; starting the router")
                sim = external_fleet(plan.fleet)
                reset_prefix_caches(sim.replicas)
            else:
                say(f"[{spec.name}] starting {plan.replicas} simulated replicas ({plan.profile}) and the router")
                sim = start_sim(
                    replicas=plan.replicas, profile=plan.profile, replicas_file=row_dir / "replicas.yaml",
                    log=row_dir / "sim.log", time_scale=plan.time_scale, tokenizer=_tokenizer(plan),
                    extra=plan.sim_args, strict_model=True,
                )  # fmt: skip
                children.append(sim.child)
            router, host = _start_router(plan, spec, sim, row_dir)
            children.append(router)
            replicas = sim.replicas
            model = sim.model
        before = {name: scrape(url) for name, url in replicas.items()}
        records_path = row_dir / "records.jsonl"
        argv = locust_argv(
            host=host, users=plan.users, run_time_s=plan.params.duration_s + plan.drain_s,
            csv_prefix=row_dir / "locust", records=records_path,
            flags=[*plan.locust_flags(), *(["--kv-model", model] if model else [])],
        )  # fmt: skip
        locust = start_child("locust", argv, row_dir / "locust.log")
        children.append(locust)
        samples = _watch(plan, spec, locust, replicas, _Progress(records_path, scheduled), say)
        after = {name: scrape(url) for name, url in replicas.items()}
        if locust.process.returncode not in (0, 1):  # 1: some requests failed, which the report shows
            say(f"[{spec.name}] locust exited with {locust.process.returncode}:\n{locust.log_tail()}")
        counters = {name: counter_deltas(before[name], after[name]) for name in replicas}
        return RowData(spec.name, read_records(records_path), scheduled, counters, samples)
    finally:
        stop_all(children)


def _watch(
    plan: BenchPlan, spec: RowSpec, locust: Child, replicas: dict[str, str], progress: _Progress, say: Any
) -> list[LoadSample]:
    started = time.monotonic()
    samples: list[LoadSample] = []
    last_print = 0.0
    while locust.alive():
        time.sleep(1.0)
        now = time.monotonic() - started
        queues = []
        for name, url in replicas.items():
            metrics = scrape(url, timeout_s=1.0)
            if metrics is None:
                continue
            running = metrics.get("vllm:num_requests_running", 0.0)
            waiting = metrics.get("vllm:num_requests_waiting", 0.0)
            samples.append(LoadSample(now, name, running, waiting, metrics.get("vllm:kv_cache_usage_perc", 0.0)))
            queues.append(f"{running:.0f}+{waiting:.0f}")
        progress.poll()
        if not plan.quiet and now - last_print >= 5.0:
            last_print = now
            ttft = _median(progress.recent_ttft)
            ttft_text = "–" if ttft is None else f"{ttft * plan.time_scale:.3f} s"
            late = max(progress.recent_late, default=None)
            late_text = "–" if late is None else f"{1000 * late:.0f} ms"
            say(
                f"[{spec.name}] {now:5.0f}/{plan.params.duration_s:.0f} s  done {progress.done}/{progress.scheduled}"
                f"  errors {progress.errors}  TTFT p50 (recent) {ttft_text}  sent late (max recent) {late_text}"
                f"  running+waiting per replica {' '.join(queues) or '–'}"
            )
    return samples


def execute(plan: BenchPlan, say: Any = print) -> dict[str, Any]:
    from kvrouter.loadgen.plots import write_plots
    from kvrouter.loadgen.report import write_report

    sessions = build_schedule(plan.workload, plan.params)
    scheduled = count_requests(sessions)
    say(f"workload {plan.workload}: {len(sessions)} sessions, {scheduled} requests over {plan.params.duration_s:.0f} s")
    rows: list[RowData] = []
    failed: dict[str, str] = {}
    report: dict[str, Any] = {}
    for spec in plan.rows:
        try:
            rows.append(run_row(plan, spec, scheduled, say))
        except FleetError as error:
            # One router that does not start (another project's, say) must not cost the other rows.
            say(f"[{spec.name}] failed: {error}")
            failed[spec.name] = str(error)
        report = {
            "parameters": plan.parameters(),
            "baseline": plan.rows[0].name,
            "results": {
                row.name: summarize(row, time_scale=plan.time_scale, slo_ttft_s=plan.slo_ttft_s) for row in rows
            },
            "failed": failed,
        }
        write_report(plan.out, report)  # after every row, so an interrupted run keeps what it measured
    if not rows:
        raise FleetError("no row ran: " + "; ".join(f"{name}: {text}" for name, text in failed.items()))
    try:
        written = write_plots(plan.out, rows, time_scale=plan.time_scale)
    except ImportError:
        say(f"matplotlib is not installed: no plots ({LOADTEST_INSTALL})")
        written = []
    report["plots"] = [path.name for path in written]
    write_report(plan.out, report)  # again, now linking the plots
    return report


def loadtest_refusal(command: str) -> str | None:
    """The one line to print (exit 2) when the `loadtest` extra is missing; None when it imports."""
    missing = missing_loadtest_modules()
    if not missing:
        return None
    names = " and ".join(missing)
    verb = "does" if len(missing) == 1 else "do"
    return f"kvrouter {command}: {names} {verb} not import; install the load-test extra: {LOADTEST_INSTALL}"


def interrupted_exit(command: str, error: KeyboardInterrupt, out: Path) -> int:
    """Report an interruption (Ctrl-C or SIGTERM; the children are stopped by then) and its exit code."""
    signum = error.signum if isinstance(error, Terminated) else signal.SIGINT
    print(
        f"kvrouter {command}: interrupted by {signal.Signals(signum).name}; every child process stopped; "
        f"partial report in {out}",
        file=sys.stderr,
    )
    return 128 + int(signum)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except ValueError as error:
        print(f"kvrouter bench: {error}", file=sys.stderr)
        return 2
    refusal = loadtest_refusal("bench")
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        with interrupts_stop_children():
            report = execute(plan, say=lambda text: print(text, flush=True))
    except FleetError as error:
        print(f"kvrouter bench: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        return interrupted_exit("bench", error, plan.out)
    print()
    print(console_table(report))
    with contextlib.suppress(OSError):
        print(f"\nreport: {plan.out / 'report.md'}{plots_note(report)}")
    return 0


def plots_note(report: dict[str, Any]) -> str:
    plots = report.get("plots") or []
    return f" (plots beside it: {', '.join(plots)})" if plots else " (no plots)"
