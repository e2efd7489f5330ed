"""`kvrouter bench --fleet`: rows against replicas that are already running, with their prefix caches reset.

The replicas are `kvrouter sim` in a process of its own (as real vLLM would be); the bench must reset their
caches before every row, so each row starts cold although the fleet lives on: the first request of every row
finds nothing cached. `reset_prefix_caches` retries while an engine answers `{"success": false}` (vLLM does while
blocks are held) and names VLLM_SERVER_DEV_MODE when the endpoint is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from kvrouter.bench import plan_from_args
from kvrouter.cli import build_parser
from kvrouter.loadgen.fleet import FleetError, external_fleet, free_port_range, render_router_cmd, reset_prefix_caches


@pytest.fixture
def sim_fleet(tmp_path: Path) -> Iterator[Path]:
    replicas_file = tmp_path / "fleet" / "replicas.yaml"
    replicas_file.parent.mkdir()
    base = free_port_range(6)
    process = subprocess.Popen(
        [sys.executable, "-m", "kvrouter.cli", "sim", "--replicas", "2", "--base-port", str(base),
         "--kv-base-port", str(base + 2), "--write-replicas", str(replicas_file), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not replicas_file.is_file():
            assert process.poll() is None and time.monotonic() < deadline, "simulator did not start"
            time.sleep(0.2)
        time.sleep(0.5)
        yield replicas_file
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.slow
def test_bench_rows_run_against_a_running_fleet_each_from_cold_caches(sim_fleet: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "kvrouter.cli", "bench", "--fleet", str(sim_fleet), "--workload", "multi-tenant",
        "--tenants", "3", "--system-tokens", "600", "--output-tokens", "4", "--rate", "3", "--duration", "4",
        "--policies", "round_robin,kv_aware", "--users", "16", "--drain", "30", "--out", str(out),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "resetting the prefix caches of 2 replicas" in finished.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["parameters"]["fleet"] == str(sim_fleet) and report["parameters"]["replicas"] == 2
    names = {replica["name"] for replica in yaml.safe_load(sim_fleet.read_text())["replicas"]}
    for row in ("round_robin", "kv_aware"):
        result = report["results"][row]
        assert result["completed"] == result["scheduled"] > 0 and result["errors"] == 0, (row, result)
        assert set(result["replicas"]) == names
        assert 0 < result["hit_rate"] < 1  # 3 tenants: later requests hit, the first of each tenant cannot
        records = [json.loads(line) for line in (out / row / "records.jsonl").read_text().splitlines()]
        first = min(records, key=lambda record: record["start_s"])
        # The same schedule ran in the row before: without the reset this prompt would be cached already.
        assert first["cached_tokens"] == 0, (row, first)


def test_fleet_rows_refuse_a_time_scale(sim_fleet: Path) -> None:
    args = build_parser("bench").parse_args(["--fleet", str(sim_fleet), "--time-scale", "0.5"])
    with pytest.raises(ValueError, match="real time"):
        plan_from_args(args)
    plan = plan_from_args(build_parser("bench").parse_args(["--fleet", str(sim_fleet)]))
    assert plan.replicas == 2 and plan.fleet == sim_fleet


def test_a_bad_fleet_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "replicas.yaml"
    bad.write_text("replicas: []\n")
    with pytest.raises(ValueError, match="replicas"):
        plan_from_args(build_parser("bench").parse_args(["--fleet", str(bad)]))


class _ResetServer(ThreadingHTTPServer):
    """Answers POST /reset_prefix_cache as vLLM's dev endpoint does: {"success": false} while blocks are held."""

    def __init__(self, busy_answers: int, status: int = 200) -> None:
        super().__init__(("127.0.0.1", 0), _ResetHandler)
        self.busy_answers = busy_answers
        self.status = status
        self.calls = 0


class _ResetHandler(BaseHTTPRequestHandler):
    server: _ResetServer

    def do_POST(self) -> None:
        self.server.calls += 1
        body = json.dumps({"success": self.server.calls > self.server.busy_answers}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def reset_server(request: pytest.FixtureRequest) -> Iterator[_ResetServer]:
    busy, status = request.param
    server = _ResetServer(busy, status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("reset_server", [(2, 200)], indirect=True)
def test_reset_is_asked_again_while_the_engine_still_holds_blocks(reset_server: _ResetServer) -> None:
    url = f"http://127.0.0.1:{reset_server.server_address[1]}"
    reset_prefix_caches({"vllm-0": url}, timeout_s=10, retry_s=0.05)
    assert reset_server.calls == 3


@pytest.mark.parametrize("reset_server", [(10**6, 200)], indirect=True)
def test_a_reset_that_never_succeeds_fails_the_row_with_the_reason(reset_server: _ResetServer) -> None:
    url = f"http://127.0.0.1:{reset_server.server_address[1]}"
    with pytest.raises(FleetError, match=r"not reset within .*blocks still in use"):
        reset_prefix_caches({"vllm-0": url}, timeout_s=0.3, retry_s=0.05)


@pytest.mark.parametrize("reset_server", [(0, 404)], indirect=True)
def test_a_missing_reset_endpoint_names_vllm_server_dev_mode(reset_server: _ResetServer) -> None:
    url = f"http://127.0.0.1:{reset_server.server_address[1]}"
    with pytest.raises(FleetError, match="VLLM_SERVER_DEV_MODE=1"):
        reset_prefix_caches({"vllm-0": url}, timeout_s=5, retry_s=0.05)


def test_peer_router_templates_get_the_running_replicas(sim_fleet: Path) -> None:
    fleet = external_fleet(sim_fleet)
    urls = [replica["url"] for replica in yaml.safe_load(sim_fleet.read_text())["replicas"]]
    argv = render_router_cmd("peer --port {port} --worker-urls {worker_urls} {kv_event_source_flags}", 9, fleet)
    assert argv[:4] == ["peer", "--port", "9", "--worker-urls"] and argv[4:6] == urls
    sources = [argv[i + 1] for i, word in enumerate(argv) if word == "--kv-event-source"]
    assert [source.split("=", 1)[0] for source in sources] == urls
    assert all(source.split("=", 1)[1].startswith("tcp://127.0.0.1:") for source in sources)
