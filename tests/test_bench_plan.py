"""Bench and demo arguments: engine-time knobs are scaled to wall time once, bad arguments are refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvrouter import bench, demo
from kvrouter.cli import build_parser
from kvrouter.loadgen.fleet import FleetError, SimFleet, render_router_cmd


def _plan(*argv: str) -> bench.BenchPlan:
    return bench.plan_from_args(build_parser("bench").parse_args(list(argv)))


def test_engine_time_knobs_are_scaled_by_the_time_scale(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    plan = _plan("--workload", "mooncake", "--trace", str(trace), "--trace-speedup", "1.4", "--time-scale", "0.5",
                 "--duration", "600", "--policies", "round_robin,kv_aware")  # fmt: skip
    assert plan.params.trace_speedup == pytest.approx(0.7)
    assert plan.params.duration_s == 600
    assert [row.name for row in plan.rows] == ["round_robin", "kv_aware"]
    parameters = plan.parameters()
    assert parameters["trace_speedup_engine"] == pytest.approx(1.4)
    assert parameters["engine_duration_s"] == pytest.approx(300)
    chat = _plan("--rate", "20", "--think", "2", "--time-scale", "0.25")
    assert chat.params.rate == pytest.approx(5.0) and chat.params.think_s == pytest.approx(8.0)
    flags = chat.locust_flags()
    assert flags[flags.index("--kv-rate") + 1] == "5.0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "fastest"], "unknown policy 'fastest'"),
        (["--policies", ""], "nothing to run"),
        (["--router-cmd", "no-equals-sign"], "NAME=VALUE"),
        (["--policies", "round_robin", "--target", "round_robin=http://127.0.0.1:1"], "unique"),
        (["--time-scale", "0"], "positive"),
        (["--workload", "mooncake", "--trace", "/nonexistent.jsonl"], "trace file not found"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _plan(*argv)


def test_router_cmd_template_gets_worker_urls_and_event_sources(tmp_path: Path) -> None:
    sim = SimFleet(
        child=None,  # type: ignore[arg-type]
        replicas_file=tmp_path / "replicas.yaml",
        replicas={"sim-0": "http://127.0.0.1:9000", "sim-1": "http://127.0.0.1:9001"},
        kv_endpoints={"sim-0": "tcp://127.0.0.1:9100", "sim-1": "tcp://127.0.0.1:9102"},
        block_size=64,
    )
    argv = render_router_cmd(
        "vllm-router --port {port} --worker-urls {worker_urls} --policy kv_aware {kv_event_source_flags} "
        "--kv-event-block-size {block_size}",
        8123,
        sim,
    )
    assert argv == [
        "vllm-router", "--port", "8123", "--worker-urls", "http://127.0.0.1:9000", "http://127.0.0.1:9001",
        "--policy", "kv_aware", "--kv-event-source", "http://127.0.0.1:9000=tcp://127.0.0.1:9100",
        "--kv-event-source", "http://127.0.0.1:9001=tcp://127.0.0.1:9102", "--kv-event-block-size", "64",
    ]  # fmt: skip


def test_router_cmd_template_gets_the_model_tokenizer_and_endpoints(tmp_path: Path) -> None:
    fleet = {"replicas": {"sim-0": "http://127.0.0.1:9000"}, "kv_endpoints": {"sim-0": "tcp://127.0.0.1:9100"}}
    sim = SimFleet(None, tmp_path / "r.yaml", block_size=16, model="llama 8b", tokenizer="/m/tok", **fleet)  # type: ignore[arg-type]
    argv = render_router_cmd("peer --port {port} --model {model} --tok {tokenizer} --kv {kv_endpoints}", 1, sim)
    assert argv == ["peer", "--port", "1", "--model", "llama", "8b", "--tok", "/m/tok", "--kv", "tcp://127.0.0.1:9100"]
    quoted = render_router_cmd("peer --model '{model}'", 1, sim)
    assert quoted == ["peer", "--model", "llama 8b"]
    nameless = SimFleet(None, tmp_path / "r.yaml", block_size=16, **fleet)  # type: ignore[arg-type]
    with pytest.raises(FleetError, match=r"uses \{tokenizer\} but .* names no tokenizer"):
        render_router_cmd("peer --tok {tokenizer}", 1, nameless)
    assert render_router_cmd("peer --port {port}", 1, nameless) == ["peer", "--port", "1"]


def test_demo_is_a_valid_bench_of_three_policies() -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    plan = bench.plan_from_args(build_parser("bench").parse_args(demo.bench_argv(args)))
    assert [row.name for row in plan.rows] == ["round_robin", "least_loaded", "kv_aware"]
    assert plan.workload == "multi-tenant" and plan.replicas == 4 and plan.profile == "b200x4-moe-1t"
    assert plan.params.tenants >= 100
    # About two minutes: three rows of `duration` seconds plus start-up and drain.
    assert 3 * args.duration <= 100
