"""`kvrouter sim`: serve several simulated vLLM replicas from one process and write their replicas.yaml.

Replica i listens for HTTP on `--host`:`--base-port + i`; its KV-event PUB socket binds `tcp://HOST:(kv base +
2i)` and its replay ROUTER socket `tcp://HOST:(kv base + 2i + 1)` on the same `--host` (a wildcard host such as
0.0.0.0 binds `tcp://*:PORT`, as vLLM's default does), where the kv base defaults to `--base-port + 100`.
`--write-replicas FILE` writes a replicas.yaml that `kvrouter --replicas FILE` accepts as is (URLs, event
endpoints with bind false, block size, tokenizer directory; a wildcard host is reached as 127.0.0.1). Each replica
hashes blocks with its own seed, as separate vLLM processes do, so the router cannot rely on engine hashes.
Without `--tokenizer` the project's tiny tokenizer is built (once) and used; /v1/models gives its directory as the
model's `root`, as vLLM gives its model path. `--strict-model` refuses, as vLLM does, a request that names a model
other than `--model-name` or an adapter (404); by default any name is served. A profile with `replicas_per_device`
N > 1 (`h200-llama8b`) puts replicas 0..N-1 on one simulated GPU, N..2N-1 on the next: their engine passes share
it (`kvrouter.sim.device.LiveDevice`), so a pass takes longer while co-located replicas are busy.

Disaggregated prefill/decode: `--roles prefill,prefill,decode,decode` (or `2P2D`) gives the replicas roles, written
into replicas.yaml; the replicas of one process share one KV-transfer plane (`kvrouter.sim.kv_transfer.KvPeers`),
so a decode replica accepts the params any of the process's prefill replicas answered. `--fault NAME:KIND` makes
replica NAME fail its legs (`kvrouter.sim.server.PdFaults`): `prefill-STATUS` (answer prefill legs with STATUS),
`die-after-prefill`, `reject-transfers`.

`--scheduling-policy priority` starts every replica as vLLM with that flag: a request's `priority` field (an
integer, lower first) orders its engine's waiting queue and chooses whom a KV shortage preempts
(`kvrouter.sim.waiting`); with fcfs, vLLM's default, a nonzero `priority` is a 400, as vLLM answers it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
import zmq

from kvrouter.sim.device import LiveDevice
from kvrouter.sim.kv_transfer import KvPeers, fleet_roles
from kvrouter.sim.model import SCHEDULING_POLICIES
from kvrouter.sim.profiles import PROFILES, Profile, build_engine, get_profile
from kvrouter.sim.server import PdFaults, ReplicaSettings, build_replica_app
from kvrouter.typedefs import ReplicaRole

log = logging.getLogger("kvrouter.sim")

ENGINE_KEEPALIVE_S = 5.0
"""An idle client connection is closed after this long, as vLLM's server does (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
default 5 s), so a client that keeps idle connections longer meets here what it meets in front of vLLM."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4, help="Replicas to serve (default 4).")
    parser.add_argument("--profile", default="b200x4-moe-1t", choices=sorted(PROFILES), help="Hardware profile.")
    parser.add_argument("--base-port", type=int, default=8100, help="HTTP port of the first replica.")
    parser.add_argument("--kv-base-port", type=int, default=None, help="First KV-event port (base-port + 100).")
    parser.add_argument("--host", default="127.0.0.1", help="Address the HTTP servers listen on.")
    parser.add_argument("--write-replicas", type=Path, default=None, help="Write a replicas.yaml here.")
    parser.add_argument("--tokenizer", type=Path, default=None, help="Tokenizer directory (default: tiny).")
    parser.add_argument("--model-name", default=None, help="Served model name (default: the profile name).")
    parser.add_argument(
        "--strict-model",
        action="store_true",
        help="Answer a request naming another model 404 NotFoundError, as vLLM does (default: serve any name).",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=None,
        help="vLLM's --scheduling-policy for every replica: fcfs (vLLM's default: a nonzero request `priority` is a "
        "400) or priority (each engine orders its queue and preemptions by it); default: the profile's, fcfs.",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="Simulated seconds per wall second.")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per replica (vLLM's count).")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size in tokens.")
    parser.add_argument("--max-model-len", type=int, default=None, help="Context window (profile's by default).")
    parser.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request omits it.")
    parser.add_argument("--topic", default="kv-events", help="KV-event topic.")
    parser.add_argument("--lora-adapters", default="", help="Comma-separated LoRA adapter names to serve.")
    parser.add_argument(
        "--name-prefix",
        default="sim-",
        help="Replica names: this plus 0, 1, ... (unique across a models list).",
    )
    parser.add_argument("--hash-seed", type=int, default=0, help="Seed of replica 0's block hashes (+i for i).")
    parser.add_argument(
        "--roles",
        default=None,
        help="Replica roles for disaggregated prefill/decode: one per replica, comma-separated (prefill, decode, "
        "both), or NPMD (N prefill then M decode); default every replica 'both'.",
    )
    parser.add_argument(
        "--disaggregation",
        choices=("conditional", "always", "off"),
        default=None,
        help="With --roles: the disaggregation mode written into --write-replicas (default: the router's, "
        "conditional), so `kvrouter bench --sim-arg` rows compare modes on the same schedule.",
    )
    parser.add_argument(
        "--fault",
        dest="faults",
        action="append",
        default=[],
        metavar="NAME:KIND",
        help="Make replica NAME fail its P/D legs: prefill-STATUS, die-after-prefill or reject-transfers.",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    http_port: int
    pub_port: int
    replay_port: int


def free_port_run(count: int, host: str = "127.0.0.1", start: int | None = None, stop: int | None = None) -> int:
    """The first port of `count` consecutive ports free on `host` now (for tests and tools), by default below the
    ephemeral range (`kvrouter.loadgen.fleet.fixed_port_window`)."""
    import random
    import socket

    from kvrouter.ports import fixed_port_window

    window = fixed_port_window()
    start = window[0] if start is None else start
    stop = window[1] if stop is None else stop
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(start, stop - count)
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise OSError(f"no run of {count} free ports found")


WILDCARD_HOSTS = ("0.0.0.0", "::", "", "*")


def reach_host(host: str) -> str:
    """How a client on this machine reaches a server bound on `host` (URL form: IPv6 in brackets)."""
    if host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def event_bind_host(host: str) -> str:
    """The host of the event sockets' bind endpoints: the HTTP servers' `--host`, so that `--host 127.0.0.1`
    exposes nothing beyond this machine; a wildcard binds every interface (`tcp://*`)."""
    if host in WILDCARD_HOSTS:
        return "*"
    return f"[{host}]" if ":" in host else host


def layouts(count: int, base_port: int, kv_base_port: int | None, prefix: str = "sim-") -> list[Layout]:
    kv_base = kv_base_port if kv_base_port is not None else base_port + 100
    return [Layout(f"{prefix}{i}", base_port + i, kv_base + 2 * i, kv_base + 2 * i + 1) for i in range(count)]


def replica_faults(items: list[str], names: list[str]) -> dict[str, PdFaults]:
    """`--fault sim-0:prefill-500 --fault sim-2:reject-transfers` -> faults per replica name; raises ValueError."""
    faults: dict[str, PdFaults] = {}
    for item in items:
        name, _, kind = item.partition(":")
        if name not in names:
            raise ValueError(f"--fault {item!r}: no replica named {name!r}")
        fault = faults.setdefault(name, PdFaults())
        if kind == "die-after-prefill":
            fault.die_after_prefill = True
        elif kind == "reject-transfers":
            fault.reject_transfers = True
        elif kind.startswith("prefill-") and kind[8:].isdigit() and 400 <= int(kind[8:]) <= 599:
            fault.prefill_status = int(kind[8:])
        else:
            raise ValueError(f"--fault {item!r}: expected NAME:prefill-STATUS, die-after-prefill or reject-transfers")
    return faults


def fleet_document(
    replicas: list[Layout],
    *,
    host: str,
    block_size: int,
    tokenizer: Path,
    model: str,
    topic: str,
    lora_adapters: tuple[str, ...] = (),
    roles: list[ReplicaRole] | None = None,
    disaggregation: str | None = None,
) -> dict[str, object]:
    """The replicas.yaml content for these replicas (what `kvrouter.config.load_fleet` reads)."""
    reach = reach_host(host)
    role_of = dict(zip((r.name for r in replicas), roles or (), strict=False))
    extra: dict[str, object] = {"lora_adapters": list(lora_adapters)} if lora_adapters else {}
    if disaggregation is not None:
        extra["disaggregation"] = {"mode": disaggregation}
    return {
        "model": model,
        "tokenizer": str(tokenizer.resolve()),
        "block_size": block_size,
        **extra,
        "replicas": [
            {
                "name": r.name,
                "url": f"http://{reach}:{r.http_port}",
                "kv_events": {
                    "endpoint": f"tcp://{reach}:{r.pub_port}",
                    "replay_endpoint": f"tcp://{reach}:{r.replay_port}",
                    "topic": topic,
                    "bind": False,
                },
                **({"role": role_of[r.name]} if role_of.get(r.name, "both") != "both" else {}),
            }
            for r in replicas
        ],
    }


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        profile = get_profile(args.profile)
        if args.scheduling_policy is not None:
            profile = dataclasses.replace(profile, scheduling_policy=args.scheduling_policy)
        if args.replicas < 1 or args.time_scale <= 0:
            raise ValueError("--replicas must be >= 1 and --time-scale > 0")
        build_engine(profile, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks)
        roles = fleet_roles(args.roles, args.replicas)
        faults = replica_faults(args.faults, [layout.name for layout in layouts(args.replicas, 0, 0)])
    except ValueError as error:
        print(f"kvrouter sim: {error}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_serve(args, profile, roles, faults))
    except KeyboardInterrupt:
        pass
    except (OSError, zmq.ZMQError) as error:
        print(f"kvrouter sim: {error}", file=sys.stderr)
        return 1
    return 0


async def _serve(
    args: argparse.Namespace, profile: Profile, roles: list[ReplicaRole], faults: dict[str, PdFaults]
) -> None:
    import zmq.asyncio
    from aiohttp import web

    from kvrouter.sim.publisher import KvEventPublisher
    from kvrouter.sim.textio import SimTokenizer

    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from kvrouter.tinymodel import ensure_tokenizer

        tokenizer_dir = ensure_tokenizer()
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sim-tokenize")
    tokenizer = SimTokenizer(tokenizer_dir, executor)
    model_root = str(tokenizer_dir)  # /v1/models root, as vLLM gives its model path
    block_size = args.block_size or profile.block_size
    model_name = args.model_name or profile.name
    max_model_len = args.max_model_len or profile.max_model_len
    adapters = tuple(name.strip() for name in args.lora_adapters.split(",") if name.strip())
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    bind_host = event_bind_host(args.host)
    if bind_host.startswith("["):
        context.setsockopt(zmq.IPV6, 1)
    runners: list[web.AppRunner] = []
    plan = layouts(args.replicas, args.base_port, args.kv_base_port, args.name_prefix)
    peers = KvPeers()
    sharing = profile.device_sharing()
    # Replicas of one device: one processor-sharing clock for their passes.
    devices = [LiveDevice(model) for model in sharing.build_all(len(plan), args.time_scale)] if sharing.shared else []
    try:
        for index, layout in enumerate(plan):
            seed = args.hash_seed + index
            engine = build_engine(profile, block_size=block_size, num_gpu_blocks=args.num_gpu_blocks, hash_seed=seed)
            publisher = KvEventPublisher(
                context,
                endpoint=f"tcp://{bind_host}:{layout.pub_port}",
                replay_endpoint=f"tcp://{bind_host}:{layout.replay_port}",
                topic=args.topic,
            )
            settings = ReplicaSettings(
                name=layout.name,
                model_name=model_name,
                max_model_len=max_model_len,
                request_overhead_s=profile.request_overhead_s,
                time_scale=args.time_scale,
                hash_seed=seed,
                default_max_tokens=args.default_max_tokens,
                lora_adapters=adapters,
                role=roles[index],
                kv_transfer=profile.kv_transfer,
                strict_model=args.strict_model,
                model_root=model_root,
                scheduling_policy=profile.scheduling_policy,
            )
            device = devices[sharing.device_of(index)] if devices else None
            app = build_replica_app(
                settings, engine, tokenizer, publisher=publisher, peers=peers, faults=faults.get(layout.name),
                device=device,
            )  # fmt: skip
            runner = web.AppRunner(
                app, handler_cancellation=True, access_log=None, keepalive_timeout=ENGINE_KEEPALIVE_S
            )
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, args.host, layout.http_port).start()
            log.info("%s on http://%s:%d, events on %s", layout.name, args.host, layout.http_port, publisher.endpoint)
        if args.write_replicas is not None:
            document = fleet_document(
                plan, host=args.host, block_size=block_size, tokenizer=Path(tokenizer_dir), model=model_name,
                topic=args.topic, lora_adapters=adapters, roles=roles, disaggregation=args.disaggregation,
            )  # fmt: skip
            args.write_replicas.parent.mkdir(parents=True, exist_ok=True)
            args.write_replicas.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
            log.info("wrote %s", args.write_replicas)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(signum, stop.set)
        log.info("serving %d %s replicas (time scale %g)", len(plan), profile.name, args.time_scale)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        context.destroy(linger=0)  # closes sockets left open by a failed start, which term() would wait for
        executor.shutdown(wait=False)
