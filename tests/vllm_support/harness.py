"""What the real-vLLM tests drive: a kvrouter process in front of vLLM servers, and a probe that checks, request
by request, that kvrouter's predicted cached tokens equal what the engine reports.

`RouterProcess` runs `python -m kvrouter.cli` (the installed CLI, as an operator would) on a free port with a
replicas.yaml written by `write_replicas_yaml`, and stops it by PID. `CacheProbe.send` asks POST /debug/route
(a dry run) what each replica holds of a request, sends the request (through the router or straight to one
replica), and returns a `Step`: the prediction per replica, the replica that served it, the engine's
`usage.prompt_tokens_details.cached_tokens`, and the deltas of that replica's vllm:prefix_cache_hits_total and
queries counters. Sends are sequential and wait for the KV events to reach the router (`settle_s`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.vllm_support.server import SERVED_MODEL, VllmServer, free_port

REPLICA_HEADER = "x-kvrouter-replica"
NUM_GPU_BLOCKS = 160
"""The test replicas' cache, vLLM's count (one is its null block): 159 usable blocks of 32 = 5,088 tokens."""
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def http_call(
    method: str, url: str, body: Any = None, timeout: float = 120.0, headers: Mapping[str, str] | None = None
) -> Reply:
    """One plain HTTP exchange (stdlib only: the tests need no HTTP client beyond what the project ships)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            headers = {key.lower(): value for key, value in response.headers.items()}
            return Reply(response.status, headers, response.read().decode())
    except urllib.error.HTTPError as error:
        headers = {key.lower(): value for key, value in error.headers.items()}
        return Reply(error.code, headers, error.read().decode(errors="replace"))


def write_replicas_yaml(path: Path, servers: Sequence[VllmServer], tokenizer: Path) -> Path:
    fleet = {
        "model": SERVED_MODEL,
        "tokenizer": str(tokenizer),
        "block_size": servers[0].block_size,
        "replicas": [
            {
                "name": server.name,
                "url": server.url,
                "kv_events": {
                    "endpoint": server.events_endpoint,
                    "replay_endpoint": server.replay_endpoint,
                    "topic": server.topic,
                },
            }
            for server in servers
        ],
    }
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path


@dataclass
class RouterProcess:
    """`kvrouter --replicas FILE` (or another subcommand's argv) as a child process this test session owns."""

    replicas_yaml: Path
    log_dir: Path
    name: str = "router"
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("KVROUTER_")}
        env.update(self.extra_env or {})
        command = [
            sys.executable, "-m", "kvrouter.cli",
            "--replicas", str(self.replicas_yaml),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--health-interval", "0.5",
            *self.extra_args,
        ]  # fmt: skip
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def wait_ready(self, replicas: int, timeout_s: float = 120.0) -> None:
        """Until the router answers /health with every replica routable.

        The limit is generous because a start is only slow on a starved machine: CI's two cores run the vLLM
        engines beside the router (an idle NIXL engine alone burns most of a core), and importing transformers
        and loading the tokenizer then took over 60 s where it takes 5-8 s on an idle machine.
        """
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"kvrouter exited while starting:\n{self.log_tail()}")
            try:
                response = http_call("GET", f"{self.url}/health", timeout=2)
                last = response.text
                body = response.json()
                routable = [r for r in body.get("replicas", {}).values() if r.get("routable", r.get("healthy"))]
                if response.status == 200 and body.get("status") == "ok" and len(routable) >= replicas:
                    # /ready also covers the event source (in Redis mode: caught up with every replica's state).
                    ready = http_call("GET", f"{self.url}/ready", timeout=2)
                    if ready.status in (200, 404):
                        return
                    last = f"/ready {ready.status}: {ready.text}"
            except (OSError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"kvrouter not ready after {timeout_s:.0f} s (last /health: {last})\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                # Not stopped within its grace: a failure for the test that saw it (its log says why), but the
                # process must still go. SIGKILL itself can take seconds on a starved machine.
                process.kill()
                process.wait(timeout=30)
        self.process = None


def counter(metrics_text: str, name: str) -> float:
    """Sum of a counter over all its label sets (vLLM has one series per engine)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class Step:
    label: str
    predicted: dict[str, int]
    """Replica -> cached tokens kvrouter predicted (POST /debug/route) before the request was sent."""
    router_choice: str
    served_by: str
    prompt_tokens: int
    router_prompt_tokens: int | None
    cached_tokens: int
    """usage.prompt_tokens_details.cached_tokens as the engine reported it."""
    hits_delta: float
    queries_delta: float

    def describe(self) -> str:
        return (
            f"{self.label}: served by {self.served_by} (router chose {self.router_choice}), "
            f"prompt {self.prompt_tokens} (router {self.router_prompt_tokens}), engine cached {self.cached_tokens}, "
            f"hits +{self.hits_delta:.0f}, predicted {self.predicted}"
        )


class CacheProbe:
    def __init__(self, router_url: str, servers: Mapping[str, VllmServer], settle_s: float = 0.3) -> None:
        self.router_url = router_url
        self.servers = servers
        self.settle_s = settle_s

    def route(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        endpoint = "chat" if path.endswith("chat/completions") else "completion"
        response = http_call("POST", f"{self.router_url}/debug/route/{endpoint}", dict(body))
        if response.status != 200:
            raise AssertionError(f"/debug/route answered {response.status}: {response.text[:500]}")
        result: dict[str, Any] = response.json()
        return result

    def metrics(self, replica: str) -> str:
        return http_call("GET", f"{self.servers[replica].url}/metrics").text

    def reset(self, replica: str) -> None:
        response = http_call("POST", f"{self.servers[replica].url}/reset_prefix_cache")
        if response.status != 200:
            raise AssertionError(f"{replica}: /reset_prefix_cache answered {response.status}: {response.text}")

    def send(self, label: str, path: str, body: Mapping[str, Any], *, direct: str | None = None) -> Step:
        """Predict, send (through the router, or straight to replica `direct`), and collect the engine's view."""
        decision = self.route(path, body)
        predicted = {c["replica"]: int(c["cached_tokens"]) for c in decision["candidates"]}
        before = {name: self.metrics(name) for name in self.servers}
        payload = {"model": SERVED_MODEL, "max_tokens": 2, "temperature": 0, **body}
        url = f"{self.servers[direct].url}{path}" if direct else f"{self.router_url}{path}"
        response = http_call("POST", url, payload)
        if response.status != 200:
            raise AssertionError(f"{label}: {url} answered {response.status}: {response.text[:500]}")
        served_by = direct or response.headers[REPLICA_HEADER]
        usage = response.json()["usage"]
        prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        # The engine's counters travel with its outputs; give them a moment to reach /metrics.
        queries_before = counter(before[served_by], "vllm:prefix_cache_queries_total")
        deadline = time.monotonic() + 2.0
        after = self.metrics(served_by)
        while counter(after, "vllm:prefix_cache_queries_total") - queries_before < prompt_tokens:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
            after = self.metrics(served_by)
        time.sleep(self.settle_s)  # the request's KV events reach the router's index
        return Step(
            label=label,
            predicted=predicted,
            router_choice=str(decision["chosen"]),
            served_by=served_by,
            prompt_tokens=prompt_tokens,
            router_prompt_tokens=decision.get("prompt_tokens"),
            cached_tokens=int(details.get("cached_tokens") or 0),
            hits_delta=counter(after, "vllm:prefix_cache_hits_total")
            - counter(before[served_by], "vllm:prefix_cache_hits_total"),
            queries_delta=counter(after, "vllm:prefix_cache_queries_total") - queries_before,
        )

    def wait_routable(self, replica: str, timeout_s: float = 60.0) -> None:
        """Until the router lists `replica` as a routing candidate again (its breaker may hold it out a while)."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = http_call("GET", f"{self.router_url}/health").json()
            state = body.get("replicas", {}).get(replica, {})
            if state.get("routable", state.get("healthy")):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the router does not route to {replica} again after {timeout_s:.0f} s: {state}")
            time.sleep(0.25)

    def wait_predicted(
        self, path: str, body: Mapping[str, Any], replica: str, expected: int, timeout_s: float = 5.0
    ) -> int:
        """Poll /debug/route until `replica`'s prediction equals `expected` (events in flight); returns the last."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = {c["replica"]: int(c["cached_tokens"]) for c in self.route(path, body)["candidates"]}.get(replica, -1)
            if got == expected or time.monotonic() > deadline:
                return got
            time.sleep(0.1)


def stream_first_token(base_url: str, path: str, body: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """Stream one request; (seconds to the first token chunk, final usage). Reads the SSE lines as they come."""
    parsed = urllib.parse.urlsplit(base_url)
    payload = {
        "model": SERVED_MODEL, "temperature": 0, **body, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
    try:
        started = time.perf_counter()
        connection.request("POST", path, json.dumps(payload), {"content-type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise AssertionError(f"{base_url}{path} answered {response.status}: {response.read()[:300]!r}")
        first: float | None = None
        usage: dict[str, Any] = {}
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
        if first is None:
            raise AssertionError(f"{base_url}{path}: the stream carried no token")
        return first, usage
    finally:
        connection.close()


def stop_quietly(*things: Any) -> None:
    for thing in things:
        with contextlib.suppress(Exception):
            thing.stop()
