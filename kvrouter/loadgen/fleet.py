"""The processes of a bench run: simulated replicas, a router, Locust; and reading the replicas' /metrics.

Every process is a child started here with its output in a log file, stopped by its own pid (SIGTERM, then
SIGKILL after a grace period). Readiness is polled over HTTP; a child that exits early raises `FleetError` with
the tail of its log, so a broken router or simulator is reported as such instead of as a hung benchmark.
Locust always runs as a subprocess: it monkey-patches the interpreter with gevent, which must never happen to
the process that orchestrates (or to a router).

Replicas that run elsewhere (real vLLM on GPUs) come from their replicas.yaml (`external_fleet`); a row empties
their prefix caches first (`reset_prefix_caches`, vLLM's POST /reset_prefix_cache, retried while the engine
still holds blocks), so every row starts cold as it does on fresh simulated replicas.

Children run `python -P`: the working directory is not put on their sys.path, so a bench started from a source
checkout runs the installed package (with its compiled tables), not the tree it happens to stand in.
`missing_loadtest_modules` imports Locust and matplotlib in such a child before anything starts (never here:
gevent). `interrupts_stop_children` turns SIGTERM into the same unwinding as Ctrl-C, so the `finally` that owns
each child stops it by pid either way; `stop_all` finishes stopping every child even when a signal lands
during the cleanup.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.ports import fixed_port_window

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")

# Replica gauges sampled over time, and counters read at the end of a run (vLLM's names).
LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
RUN_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:time_to_first_token_seconds_count",
)


LOADTEST_MODULES = ("locust", "matplotlib")
LOADTEST_INSTALL = "pip install 'kvrouter[loadtest]'"


class FleetError(RuntimeError):
    """A child process failed to start or died; the message carries its log's tail."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGINT) received: unwinds like Ctrl-C so every child is stopped by the code that started it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def python_argv(*args: str) -> list[str]:
    """This interpreter, without the working directory on sys.path (-P): children import the installed kvrouter."""
    return [sys.executable, "-P", *args]


_IMPORT_PROBE = """
import importlib, json, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as error:
        missing.append(name)
print(json.dumps(missing))
"""


def missing_loadtest_modules(modules: Sequence[str] = LOADTEST_MODULES) -> list[str]:
    """The modules of the `loadtest` extra that do not import in a child like the bench's (checked in a child:
    importing Locust here would monkey-patch this process with gevent)."""
    probe = subprocess.run(
        python_argv("-c", _IMPORT_PROBE, *modules), capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    try:
        missing = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return list(modules)  # the probe itself failed: the environment cannot run the bench either
    return [str(name) for name in missing]


@contextlib.contextmanager
def interrupts_stop_children() -> Iterator[None]:
    """Within this block SIGTERM and SIGINT raise `Terminated` once; further signals are ignored so that the
    cleanup they start (stopping children, a few seconds each at most) runs to its end."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait(timeout=5)


def stop_all(children: Sequence[Child]) -> None:
    """Stop every child, last started first; a signal arriving meanwhile is re-raised after the last one."""
    interrupted: KeyboardInterrupt | None = None
    for child in reversed(children):
        try:
            child.stop()
        except KeyboardInterrupt as error:
            interrupted = error
            child.stop()
    if interrupted is not None:
        raise interrupted


@contextlib.contextmanager
def stopped_on_failure(child: Child) -> Iterator[Child]:
    """Stop `child` if the block fails or is interrupted (a readiness wait), so no caller is left holding none."""
    try:
        yield child
    except BaseException:
        stop_all([child])
        raise


def start_child(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Child:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as handle:
        process = subprocess.Popen(
            list(argv),
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    return Child(name, process, log)


def kvrouter_argv(*args: str) -> list[str]:
    return python_argv("-m", "kvrouter.cli", *args)


def free_port_range(count: int, start: int | None = None, end: int | None = None) -> int:
    """A base port such that base .. base+count-1 are all free on 127.0.0.1 right now (by default in
    `fixed_port_window`)."""
    window_start, window_end = fixed_port_window()
    start = window_start if start is None else start
    end = window_end if end is None else end
    base = start + (os.getpid() * 37) % (end - start - count)
    for _ in range(200):
        if all(_port_free(base + offset) for offset in range(count)):
            return base
        base = start + (base - start + count + 7) % (end - start - count)
    raise FleetError(f"found no {count} consecutive free ports")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as error:
        return int(error.code), ""


def wait_ready(child: Child, url: str, timeout_s: float = 60.0, accept_below: int = 300) -> None:
    """Poll `url` until it answers with a status below `accept_below`; fail fast if `child` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not child.alive():
            raise FleetError(f"{child.name} exited with code {child.process.returncode}:\n{child.log_tail()}")
        try:
            status, _ = http_get(url, timeout_s=2.0)
            if status < accept_below:
                return
            last = f"HTTP {status}"
        except (OSError, urllib.error.URLError) as error:
            last = str(error)
        time.sleep(0.2)
    raise FleetError(f"{child.name} not ready at {url} after {timeout_s:.0f} s ({last}):\n{child.log_tail()}")


@dataclass(frozen=True, slots=True)
class SimFleet:
    child: Child
    replicas_file: Path
    replicas: dict[str, str]
    """Replica name -> base URL."""
    kv_endpoints: dict[str, str]
    """Replica name -> ZMQ PUB endpoint of its KV events (when the simulator publishes them)."""
    block_size: int
    model: str = ""
    """The served model name (replicas.yaml `model`): what clients put in a request's `model`."""
    tokenizer: str = ""
    """The model's tokenizer directory (replicas.yaml `tokenizer`), for routers that tokenize."""


def start_sim(
    *,
    replicas: int,
    profile: str,
    replicas_file: Path,
    log: Path,
    time_scale: float = 1.0,
    tokenizer: Path | None = None,
    extra: Sequence[str] = (),
    strict_model: bool = False,
) -> SimFleet:
    """`strict_model`: the replicas refuse, as vLLM does, a request naming another model (404), so a router that
    rewrites the name fails here as it would on real replicas (bench's rows); off, any name is served (the soak
    and fault scripts, which test the router rather than the name)."""
    base_port = free_port_range(3 * replicas + 2)  # HTTP ports, then a PUB and a replay port per replica
    argv = kvrouter_argv(
        "sim", "--replicas", str(replicas), "--profile", profile, "--base-port", str(base_port),
        "--kv-base-port", str(base_port + replicas + 1), "--write-replicas", str(replicas_file),
        "--time-scale", str(time_scale), "--log-level", "warning",
    )  # fmt: skip
    if strict_model:
        argv.append("--strict-model")
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    argv += list(extra)
    with contextlib.suppress(FileNotFoundError):
        replicas_file.unlink()
    with stopped_on_failure(start_child("simulator", argv, log)) as child:
        deadline = time.monotonic() + 120
        while not replicas_file.is_file():
            if not child.alive():
                raise FleetError(f"simulator exited with code {child.process.returncode}:\n{child.log_tail()}")
            if time.monotonic() > deadline:
                raise FleetError(f"simulator wrote no {replicas_file} within 120 s:\n{child.log_tail()}")
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written whole, but give a slow disk a moment
        fleet = yaml.safe_load(replicas_file.read_text(encoding="utf-8"))
        urls = {str(r["name"]): str(r["url"]).rstrip("/") for r in fleet["replicas"]}
        endpoints = {str(r["name"]): str(r["kv_events"]["endpoint"]) for r in fleet["replicas"] if r.get("kv_events")}
        for url in urls.values():
            wait_ready(child, url + "/health")
        return SimFleet(
            child, replicas_file, urls, endpoints, int(fleet.get("block_size") or 16),
            model=str(fleet.get("model") or ""), tokenizer=str(fleet.get("tokenizer") or ""),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ExternalFleet:
    """Replicas that run elsewhere (real vLLM, say): what a row needs of them, as their replicas.yaml says."""

    replicas_file: Path
    replicas: dict[str, str]
    kv_endpoints: dict[str, str]
    block_size: int
    model: str = ""
    tokenizer: str = ""


def external_fleet(replicas_file: Path) -> ExternalFleet:
    """Replicas that are already running (real vLLM, say), as their replicas.yaml describes them."""
    from kvrouter.config import ConfigError, load_fleet

    try:
        fleet = load_fleet(replicas_file)
    except ConfigError as error:
        raise FleetError(str(error)) from None
    urls = {replica.name: replica.base_url for replica in fleet.replicas}
    endpoints = {replica.name: replica.kv_events.endpoint for replica in fleet.replicas if replica.kv_events}
    return ExternalFleet(
        replicas_file, urls, endpoints, fleet.block_size, model=fleet.model or "", tokenizer=fleet.tokenizer or ""
    )


def reset_prefix_caches(replicas: Mapping[str, str], timeout_s: float = 120.0, retry_s: float = 1.0) -> None:
    """Empty every replica's prefix cache (POST /reset_prefix_cache; vLLM serves it with VLLM_SERVER_DEV_MODE=1).

    vLLM answers `{"success": false}` while blocks are still held (requests of the previous row finishing or
    being aborted), so each replica is asked again every `retry_s` until it succeeds or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    for name, url in replicas.items():
        last = "no answer"
        while True:
            try:
                request = urllib.request.Request(url.rstrip("/") + "/reset_prefix_cache", data=b"", method="POST")
                with urllib.request.urlopen(request, timeout=10.0) as response:
                    body = response.read().decode("utf-8", errors="replace")
                # vLLM 0.26+ and the simulator answer {"success": bool}; older vLLMs an empty 200.
                if not body.strip() or json.loads(body).get("success", True) is not False:
                    break
                last = "success: false (blocks still in use)"
            except urllib.error.HTTPError as error:
                last = f"HTTP {error.code}"
                if error.code == 404:
                    raise FleetError(
                        f"{name} ({url}) has no POST /reset_prefix_cache: start vLLM with VLLM_SERVER_DEV_MODE=1"
                    ) from None
            except (OSError, urllib.error.URLError, ValueError, AttributeError) as error:
                last = str(error)
            if time.monotonic() > deadline:
                raise FleetError(f"{name} ({url}): prefix cache not reset within {timeout_s:.0f} s ({last})")
            time.sleep(retry_s)


def start_kvrouter(replicas_file: Path, port: int, policy: str, log: Path, extra: Sequence[str] = ()) -> Child:
    argv = kvrouter_argv(
        "--replicas", str(replicas_file), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--log-level", "warning", *extra,
    )  # fmt: skip
    with stopped_on_failure(start_child(f"kvrouter ({policy})", argv, log)) as child:
        wait_ready(child, f"http://127.0.0.1:{port}/health", timeout_s=90)
        return child


def render_router_cmd(template: str, port: int, sim: SimFleet | ExternalFleet) -> list[str]:
    """Fill a `--router-cmd` template: {port}, {worker_urls} (space-separated), {worker_urls_csv},
    {replicas_file}, {block_size}, {kv_event_sources} (WORKER_URL=tcp://... space-separated),
    {kv_event_source_flags} (`--kv-event-source WORKER_URL=tcp://...` once per replica, vllm-router's form),
    {kv_endpoints} (the replicas' tcp://... event endpoints, space-separated), {model} (the served model name) and
    {tokenizer} (its tokenizer directory). {model} and {tokenizer} are refused when the fleet names none."""
    pairs = [f"{sim.replicas[name]}={endpoint}" for name, endpoint in sim.kv_endpoints.items()]
    for placeholder, value in (("model", sim.model), ("tokenizer", sim.tokenizer)):
        if "{" + placeholder + "}" in template and not value:
            raise FleetError(f"--router-cmd uses {{{placeholder}}} but {sim.replicas_file} names no {placeholder}")
    values = {
        "port": str(port),
        "worker_urls": " ".join(sim.replicas.values()),
        "worker_urls_csv": ",".join(sim.replicas.values()),
        "replicas_file": str(sim.replicas_file),
        "block_size": str(sim.block_size),
        "kv_event_sources": " ".join(pairs),
        "kv_event_source_flags": " ".join(f"--kv-event-source {pair}" for pair in pairs),
        "kv_endpoints": " ".join(sim.kv_endpoints.values()),
        "model": sim.model,
        "tokenizer": sim.tokenizer,
    }
    return shlex.split(template.format(**values))


def start_router_cmd(name: str, template: str, port: int, sim: SimFleet | ExternalFleet, log: Path) -> Child:
    with stopped_on_failure(start_child(name, render_router_cmd(template, port, sim), log)) as child:
        # Other routers differ in health paths; any HTTP answer from /v1/models below 500 means it is serving.
        wait_ready(child, f"http://127.0.0.1:{port}/v1/models", timeout_s=120, accept_below=500)
        return child


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (replicas hosting several engines report one per engine)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float] | None:
    try:
        status, text = http_get(url.rstrip("/") + "/metrics", timeout_s=timeout_s)
    except (OSError, urllib.error.URLError):
        return None
    return parse_metrics(text) if status == 200 else None


def locust_argv(
    *,
    host: str,
    users: int,
    run_time_s: float,
    csv_prefix: Path,
    records: Path,
    flags: Sequence[str],
) -> list[str]:
    return [
        *python_argv("-m", "locust"), "-f", str(LOCUSTFILE), "--headless", "--host", host,
        "-u", str(users), "-r", str(users), "--run-time", f"{max(1, round(run_time_s))}s", "--stop-timeout", "5",
        "--only-summary", "--csv", str(csv_prefix), "--kv-records", str(records), *flags,
    ]  # fmt: skip
