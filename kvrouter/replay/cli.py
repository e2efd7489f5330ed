"""`kvrouter replay TRACE`: replay a trace against simulated engines on a virtual clock, one run per policy.

Example: `kvrouter replay shared/traces/mooncake/conversation_trace.jsonl --policies round_robin,kv_aware
--replicas 4 --profile dynamo-mocker --speedup 2.5 --out out/replay`. Prints the report table; with --out also
writes report.json, report.md, requests_<policy>.csv and ttft_cdf.png. Policy knobs come from the usual
settings (`KVROUTER_KV_*` environment) and `--set kv_name=value`. Every policy sees the same trace, the same
prompts and fresh engines, so rows differ only by routing.

Several routers (`kvrouter.replay.routers`): `--routers 4 --spread random --share-delay-ms off,0,10,50,200` replays
each policy through four router instances, once per sharing setting (`off`: each counts only its own load), one
row each, labelled `<policy>@k4-share<ms>` or `<policy>@k4-unshared`; with a delay each instance decides through
its blind group (kvrouter/routing/herding.py: ranked places, and each instance waits its rank times the delay
before deciding); `--blind-group on,nostagger,random,off` adds the row without the wait (`...-nostagger`), the
random-place row (`...-randomplace`) and the plain policy's (`...-herd`). `--share-calibration off,on` adds the row
where the instances also fit each other's calibration observations (`...-sharedcalib`; live:
`load_share_calibration`).

Session hints: `--sessions off,soft,sticky` replays each policy once per mode, the trace's conversations as
sessions (`kvrouter.replay.trace.conversations`), labelled `<policy>`, `<policy>+soft`, `<policy>+sticky`.

Disaggregated prefill/decode (docs/disaggregation.md): `--pd aggregated,always,conditional --roles 2P2D` replays
each policy on the same number of engines three ways: every engine serving whole requests (`<policy>+agg`), and 2
prefill + 2 decode workers with every request split (`<policy>+pd-always`) or only those whose uncached prefill on
the best decode worker passes `max_local_prefill_tokens` (`<policy>+pd-conditional`; the threshold is the
setting `kv_batch_tokens`, as live). KV transfers cost the profile's `kv_transfer`.

Engine scheduling: `--scheduling-policy priority` runs every engine as vLLM with `--scheduling-policy priority`
(`kvrouter.sim.waiting`); each request carries the `priority` of its band (`--priority-share`: -1 for the first
band with the default bands, 0 for the default band), as vLLM would receive it. fcfs (the default) ignores it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvrouter.config import POLICY_NAMES, ConfigError, Settings
from kvrouter.flow.settings import FlowConfig
from kvrouter.policies import build_policy
from kvrouter.policies.base import Policy
from kvrouter.replay.driver import (
    EngineFactory,
    ReplayOptions,
    ReplayResult,
    VirtualClock,
    floor_ttfts,
    replay_policy,
)
from kvrouter.replay.hotspot import hot_spot
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.report import summarize, table, write_outputs
from kvrouter.replay.routers import BLIND_GROUPS, RouterSpread
from kvrouter.replay.tenancy import Tenancy, assign
from kvrouter.replay.trace import TraceError, conversations, load_trace, unshared
from kvrouter.routing.disagg import DisaggSettings
from kvrouter.routing.sessions import SESSION_MODES
from kvrouter.sim.kv_transfer import fleet_roles
from kvrouter.sim.model import SCHEDULING_POLICIES, EngineModel
from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.typedefs import DisaggMode, ReplicaRole, SessionMode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="Mooncake-style JSONL trace (GMI variant detected).")
    parser.add_argument("--policies", default="round_robin,least_loaded,kv_aware", help="Comma-separated policies.")
    parser.add_argument("--replicas", type=int, default=4, help="Simulated engines.")
    parser.add_argument("--profile", default="dynamo-mocker", help="Engine profile (see `kvrouter sim --help`).")
    parser.add_argument("--speedup", type=float, default=1.0, help="Divide the trace's timestamps by this.")
    parser.add_argument(
        "--speeds",
        default=None,
        help="Per-engine speed, comma-separated (1,1,0.5,0.5: two engines at half speed); default all 1.",
    )
    parser.add_argument(
        "--unshared", action="store_true", help="Make every request's prefix unique (routing by load alone)."
    )
    parser.add_argument("--out", type=Path, default=None, help="Directory for report.json, CSVs and the plot.")
    parser.add_argument("--limit", type=int, default=None, help="Replay only the first N requests.")
    parser.add_argument("--block-tokens", type=int, default=None, help="Tokens per trace block (512 / 32).")
    parser.add_argument("--event-delay", type=float, default=0.0, help="Extra seconds before KV events land.")
    parser.add_argument("--scrape-interval", type=float, default=1.0, help="Seconds between gauge samples.")
    parser.add_argument(
        "--lost-removals", type=float, default=0.0, help="Share of engine-0's BlockRemoved events lost (0..1)."
    )
    parser.add_argument("--hot-share", type=float, default=0.0, help="Hot-spot variant: share of requests (0 = off).")
    parser.add_argument("--hot-start", type=float, default=1 / 3, help="Hot-spot start, fraction of the trace.")
    parser.add_argument("--hot-prefix-blocks", type=int, default=16, help="Hot tenant prefix, in trace blocks.")
    parser.add_argument("--replicate", action="store_true", help="Warm hot prefixes on a spare replica.")
    parser.add_argument("--drain-at", type=float, default=None, help="Drain the last engine at this virtual second.")
    parser.add_argument("--drain-warm", type=int, default=0, help="Hottest prefixes to warm elsewhere before it.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the trace's token ids.")
    parser.add_argument("--no-floor", action="store_true", help="Skip the idle-engine floor computation.")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE", help="Override a setting."
    )
    parser.add_argument(
        "--whole-answers",
        action="store_true",
        help="The router sees first tokens only when answers end (non-streaming, assemble_non_streaming off).",
    )
    parser.add_argument(
        "--engine-metrics",
        action="store_true",
        help="Feed the engines' prefill histograms to kv_aware's engine source (kv_engine_metrics, as live).",
    )
    parser.add_argument("--routers", type=int, default=1, help="Router instances in front of the engines.")
    parser.add_argument("--spread", default="round_robin", help="How arrivals reach the routers: round_robin, random.")
    parser.add_argument(
        "--share-delay-ms",
        default="0",
        help="Comma-separated delays before one router's load reaches the others (`off`: not shared); one row each.",
    )
    parser.add_argument(
        "--blind-group",
        default="on",
        help="With a share delay, decide through the blind group (kvrouter/routing/herding.py): on (ranked "
        "places, staggered decisions), nostagger (ranked places, no wait), random (random places), off; a comma "
        "list for one row each (`-nostagger`, `-randomplace`, `-herd`).",
    )
    parser.add_argument(
        "--share-calibration",
        default="off",
        help="With shared load, the instances fit each other's calibration observations (on; live: "
        "load_share_calibration) or only their own (off, the default); off,on for one row each (`-sharedcalib`).",
    )
    parser.add_argument(
        "--flow",
        default="off",
        help="The router queue (docs/flow-control.md): off, on, or off,on for one row each (`<policy>+queue`).",
    )
    parser.add_argument(
        "--flow-set",
        dest="flow_overrides",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="Override a field of the flow section (hold_passes=2, starvation_s=5, ...); JSON values allowed.",
    )
    parser.add_argument("--tenants", type=int, default=0, help="Regular tenants, conversations spread over them.")
    parser.add_argument("--noisy-share", type=float, default=0.0, help="A tenant `noisy` sends this share of arrivals.")
    parser.add_argument(
        "--priority-share", type=float, default=0.0, help="Share of requests in the most urgent band (high)."
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=None,
        help="The engines' vLLM --scheduling-policy: fcfs (vLLM's default) or priority, which orders each engine's "
        "queue and preemptions by the requests' priority (the band's; default: the profile's, fcfs).",
    )
    parser.add_argument(
        "--sessions",
        default="off",
        help="Session hints, conversations as sessions (requests sharing their first two trace blocks): off, soft, "
        "sticky, or a comma list for one row each (`<policy>+soft`, `<policy>+sticky`).",
    )
    parser.add_argument(
        "--pd",
        default=None,
        help="Disaggregated prefill/decode rows, a comma list of aggregated (every engine serves whole requests), "
        "always, conditional, off (the --roles fleet under that mode): `<policy>+agg`, `<policy>+pd-always`, ...",
    )
    parser.add_argument(
        "--roles",
        default="2P2D",
        help="The fleet's shape for --pd: NPMD (N prefill then M decode engines) or one role per engine, "
        "comma-separated (prefill, decode, both); as many as --replicas.",
    )
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=None,
        help="Conditional --pd rows: the most uncached prompt tokens a decode worker computes itself (the "
        "disaggregation section's max_local_prefill_tokens); default kv_batch_tokens, as live.",
    )
    parser.add_argument("--json", action="store_true", help="Print report.json's rows instead of the table.")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="Policies replayed at once (forked processes)."
    )


def _speeds(text: str | None, replicas: int) -> list[float] | None:
    if text is None:
        return None
    try:
        speeds = [float(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"--speeds: expected comma-separated numbers, got {text!r}") from None
    if len(speeds) != replicas or min(speeds) <= 0:
        raise ConfigError(f"--speeds: expected {replicas} positive numbers (one per engine), got {text!r}")
    return speeds


def _settings(overrides: list[str]) -> Settings:
    values: dict[str, Any] = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in Settings.model_fields:
            raise ConfigError(f"--set: expected NAME=VALUE with a known setting, got {item!r}")
        values[name] = value
    return Settings.model_validate(values)


def flow_settings(choice: str, overrides: list[str]) -> list[FlowConfig | None]:
    """`off,on` -> [None, FlowConfig(...)], the overrides applied to every `on`."""
    values: dict[str, Any] = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in FlowConfig.model_fields:
            raise ConfigError(f"--flow-set: expected NAME=VALUE with a field of the flow section, got {item!r}")
        try:
            values[name] = json.loads(value)
        except json.JSONDecodeError:
            values[name] = value
    try:
        config = FlowConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(f"--flow-set: {error.errors()[0]['msg']}") from None
    settings: list[FlowConfig | None] = []
    for item in choice.split(","):
        item = item.strip().lower()
        if item not in ("off", "on"):
            raise ConfigError(f"--flow: expected off, on or off,on, got {choice!r}")
        settings.append(config if item == "on" else None)
    return settings


def replay_policy_object(name: str, settings: Settings, clock: VirtualClock) -> Policy:
    """The policy as `build_policy` makes it, on the replay's clock."""
    return build_policy(name, settings, clock=clock)


def blind_groups(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or any(item not in BLIND_GROUPS for item in items):
        raise ConfigError(f"--blind-group: expected some of {', '.join(BLIND_GROUPS)}, got {text!r}")
    return items


def switches(text: str, flag: str) -> list[bool]:
    """`on,off` -> [True, False]."""
    values = {"on": True, "off": False}
    items = [item.strip().lower() for item in text.split(",") if item.strip()]
    if not items or any(item not in values for item in items):
        raise ConfigError(f"{flag}: expected on, off or on,off, got {text!r}")
    return [values[item] for item in items]


def share_delays(text: str) -> list[float | None]:
    """`off,0,10,50` -> [None, 0.0, 0.01, 0.05] (seconds; None: load not shared)."""
    delays: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("off", "none"):
            delays.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"--share-delay-ms: expected milliseconds or 'off', got {item!r}") from None
        if value < 0 or value != value:
            raise ConfigError(f"--share-delay-ms: expected milliseconds or 'off', got {item!r}")
        delays.append(value / 1000)
    if not delays:
        raise ConfigError("--share-delay-ms: expected at least one value")
    return delays


def session_modes(text: str) -> list[SessionMode]:
    """`off,soft,sticky` -> the modes, in order."""
    modes: list[SessionMode] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item not in SESSION_MODES:
            raise ConfigError(f"--sessions: expected some of {', '.join(SESSION_MODES)}, got {text!r}")
        modes.append(item)
    return modes


PD_ROWS: dict[str, DisaggMode | None] = {
    "aggregated": None,
    "always": "always",
    "conditional": "conditional",
    "off": "off",
}
"""`--pd` rows: None replays every engine as `both`; a mode replays the `--roles` fleet under it."""


def pd_rows(text: str | None) -> list[str | None]:
    """`aggregated,conditional` -> the rows in order; None (no --pd): one row, the fleet as it always was."""
    if text is None:
        return [None]
    rows: list[str | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item not in PD_ROWS:
            raise ConfigError(f"--pd: expected some of {', '.join(PD_ROWS)}, got {text!r}")
        rows.append(item)
    return rows


def pd_fleet(text: str, replicas: int) -> list[ReplicaRole]:
    """`--roles` for the --pd rows: a fleet with a prefill engine and a decode-capable one."""
    try:
        roles = fleet_roles(text, replicas)
    except ValueError as error:
        raise ConfigError(f"--{error} (--replicas)") from None
    if "prefill" not in roles:
        raise ConfigError(f"--roles: {text!r} has no prefill engine")
    return roles


def row_label(
    policy: str, spread: RouterSpread, flow: FlowConfig | None = None, session: str = "off", pd: str | None = None
) -> str:
    queue = ("" if flow is None else "+queue") + ("" if session == "off" else f"+{session}")
    if pd is not None:
        queue += "+agg" if pd == "aggregated" else f"+pd-{pd}"
    if spread.routers == 1:
        return policy + queue
    delay = spread.share_delay_s
    sharing = "unshared" if delay is None else f"share{delay * 1000:g}ms"
    herd = {"on": "", "nostagger": "-nostagger", "random": "-randomplace", "off": "-herd"}[spread.blind_group]
    herd = herd if delay else ""
    shared = "-sharedcalib" if spread.share_calibration and delay is not None else ""
    return f"{policy}{queue}@k{spread.routers}-{spread.spread}-{sharing}{herd}{shared}"


Job = Callable[[], tuple[ReplayResult, float]]


def _child(job: Job, connection: Connection) -> None:
    connection.send(job())
    connection.close()


def run_jobs(jobs: list[Job], parallel: int) -> list[tuple[ReplayResult, float]]:
    """Run each replay in a forked child (it inherits the prepared prompts for free), `parallel` at a time."""
    if parallel <= 1 or len(jobs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [job() for job in jobs]
    context = multiprocessing.get_context("fork")
    results: list[tuple[ReplayResult, float]] = []
    for start in range(0, len(jobs), parallel):
        running = []
        for job in jobs[start : start + parallel]:
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(job, sender))
            process.start()
            sender.close()
            running.append((process, receiver))
        for process, receiver in running:
            results.append(receiver.recv())
            process.join()
    return results


def run(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args.overrides)
        policies = [name.strip() for name in args.policies.split(",") if name.strip()]
        unknown = [name for name in policies if name not in POLICY_NAMES]
        if unknown or not policies:
            raise ConfigError(f"--policies: expected some of {', '.join(POLICY_NAMES)}, got {args.policies!r}")
        if args.replicas < 1 or args.speedup <= 0:
            raise ConfigError("--replicas must be at least 1 and --speedup positive")
        sharing = share_delays(args.share_delay_ms)
        blind = blind_groups(args.blind_group)
        calibrations = switches(args.share_calibration, "--share-calibration")
        spreads = [
            RouterSpread(
                routers=args.routers,
                spread=args.spread,
                seed=args.seed,
                share_delay_s=delay,
                blind_group=on,
                share_calibration=calibrate,
            )
            for delay in (sharing if args.routers > 1 else [0.0])
            for on in (blind if delay else ["on"])
            for calibrate in (calibrations if args.routers > 1 and delay is not None else [False])
        ]
        profile = get_profile(args.profile)
        speeds = _speeds(args.speeds, args.replicas)
        trace = load_trace(args.trace, speedup=args.speedup, block_tokens=args.block_tokens, limit=args.limit)
        trace = hot_spot(trace, share=args.hot_share, start=args.hot_start, prefix_blocks=args.hot_prefix_blocks)
        if args.unshared:
            trace = unshared(trace)
        flows = flow_settings(args.flow, args.flow_overrides)
        tenancy = Tenancy(args.tenants, args.noisy_share, args.priority_share, seed=args.seed)
        assigned = assign(trace, tenancy)
        trace = assigned.trace
        modes = session_modes(args.sessions)
        pds = pd_rows(args.pd)
        threshold = settings.kv_batch_tokens if args.max_local_prefill_tokens is None else args.max_local_prefill_tokens
        if threshold < 0:
            raise ConfigError("--max-local-prefill-tokens must be at least 0")
        roles = pd_fleet(args.roles, args.replicas) if args.pd is not None else None
        if roles is not None and (args.routers > 1 or any(flows) or args.replicate or args.drain_at is not None):
            raise ConfigError("--pd replays with one router and no --flow, --replicate or --drain-at")
    except (ConfigError, ValueError, TraceError, OSError) as error:
        print(f"kvrouter replay: {error}", file=sys.stderr)
        return 2

    scheduling = args.scheduling_policy

    def factory() -> EngineModel:
        return build_engine(profile, scheduling_policy=scheduling)

    engine_factory: EngineFactory = factory
    engines: EngineFactory | list[EngineFactory] = engine_factory
    if speeds is not None:
        engines = [
            functools.partial(build_engine, profile, speed=speed, scheduling_policy=scheduling) for speed in speeds
        ]
    started = time.perf_counter()
    block_size = engine_factory().block_size
    catalog = PromptCatalog(
        trace_block_tokens=trace.block_tokens, block_size=block_size, hash_seed=0, token_seed=args.seed
    )
    prompts = [catalog.prepare(request) for request in trace.requests]
    prepared_s = time.perf_counter() - started
    options = ReplayOptions(
        replicas=args.replicas,
        event_delay_s=args.event_delay,
        scrape_interval_s=args.scrape_interval,
        provisional_ttl_s=settings.provisional_ttl_s,
        feedback=settings.kv_feedback,
        survival=settings.kv_survival,
        lost_hits=settings.kv_lost_hits,
        prefill_tokens_per_s=settings.kv_prefill_tokens_per_s,
        lost_removals=args.lost_removals,
        replicate=args.replicate,
        drain_at_s=args.drain_at,
        drain_warm=args.drain_warm,
        whole_answers=args.whole_answers,
        batch_tokens=settings.kv_batch_tokens,
        tenants=assigned.tenant if tenancy.active else None,
        urgent=assigned.urgent,
        sessions=conversations(trace) if any(mode != "off" for mode in modes) else None,
        session_ttl_s=settings.session_ttl_s,
        session_max=settings.session_max,
        device=profile.device_sharing(),
        engine_metrics=args.engine_metrics and settings.kv_engine_metrics,
    )
    floors = None if args.no_floor else floor_ttfts(trace.requests, prompts, engine_factory)

    def job_for(
        name: str, spread: RouterSpread, flow: FlowConfig | None, mode: SessionMode = "off", pd: str | None = None
    ) -> Job:
        pd_mode = None if pd is None else PD_ROWS[pd]
        fleet = dataclasses.replace(
            options,
            routers=spread,
            flow=flow,
            session_mode=mode,
            roles=None if pd_mode is None else roles,
            disaggregation=DisaggSettings(pd_mode or "conditional", threshold),
            kv_transfer=profile.kv_transfer,
        )

        def job() -> tuple[ReplayResult, float]:
            began = time.process_time()
            clock = VirtualClock()
            result = replay_policy(
                requests=trace.requests,
                prompts=prompts,
                catalog=catalog,
                policy=replay_policy_object(name, settings, clock),
                engine_factory=engines,
                options=fleet,
                clock=clock,
                policy_factory=lambda: replay_policy_object(name, settings, clock),
            )
            result.policy = row_label(name, spread, flow, mode, pd)
            return result, time.process_time() - began

        return job

    rows = [(n, s, f, m, p) for n in policies for s in spreads for f in flows for m in modes for p in pds]
    outcomes = run_jobs([job_for(*row) for row in rows], args.jobs)
    results = [result for result, _ in outcomes]
    timings = {result.policy: seconds for result, seconds in outcomes}
    summaries = [summarize(result, floors) for result in results]
    meta = {
        "trace": str(args.trace),
        "requests": len(trace.requests),
        "replicas": args.replicas,
        "profile": args.profile,
        "speedup": args.speedup,
        "speeds": speeds,
        "unshared": args.unshared,
        "event_delay_s": args.event_delay,
        "scrape_interval_s": args.scrape_interval,
        "overrides": args.overrides,
        "lost_removals": args.lost_removals,
        "routers": {
            "count": args.routers,
            "spread": args.spread,
            "share_delay_ms": args.share_delay_ms,
            "blind_group": args.blind_group,
            "share_calibration": args.share_calibration,
        },
        "flow": {"rows": args.flow, "overrides": args.flow_overrides},
        "tenancy": dataclasses.asdict(tenancy),
        "scheduling_policy": scheduling or profile.scheduling_policy,
        "replicate": args.replicate,
        "drain": {"at_s": args.drain_at, "warm": args.drain_warm},
        "hot_spot": {"share": args.hot_share, "start": args.hot_start, "prefix_blocks": args.hot_prefix_blocks},
        "prepare_s": round(prepared_s, 3),
        "replay_cpu_s": {name: round(seconds, 3) for name, seconds in timings.items()},
        "warmups": {result.policy: result.warmups for result in results},
        "sessions": {result.policy: result.sessions for result in results if result.sessions},
        "pd": None
        if args.pd is None
        else {
            "rows": args.pd,
            "roles": roles,
            "max_local_prefill_tokens": threshold,
            "kv_transfer": dataclasses.asdict(profile.kv_transfer),
        },
        "wall_s": round(time.perf_counter() - started, 3),
    }
    if args.json:
        print(json.dumps({"replay": meta, "rows": summaries}, indent=2))
    else:
        print(
            f"{len(trace.requests)} requests, {args.replicas} x {args.profile}, speedup {args.speedup:g}; "
            f"prompts {prepared_s:.1f} s, replay CPU "
            + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items())
            + f", wall {time.perf_counter() - started:.1f} s in all"
        )
        print(table(summaries))
        if any(result.warmups for result in results):
            print("warm-ups sent: " + ", ".join(f"{result.policy} {result.warmups}" for result in results))
    if args.out is not None:
        write_outputs(args.out, results, summaries, floors, meta)
        print(f"wrote {args.out}/report.json, report.md, requests_*.csv, ttft_cdf.png")
    return 0
