"""deploy/gpu/vllm_fleet.py: which GPU and ports each replica gets, its vLLM flags, and the replicas.yaml it writes
(read back through kvrouter's own loader, with every KV-event endpoint matching the port vLLM binds)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from kvrouter.config import parse_fleet

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "gpu" / "vllm_fleet.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_fleet", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_fleet"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_replicas_fill_each_gpu_in_turn_with_ports_of_their_own() -> None:
    fleet = _script()
    plans = fleet.plan_replicas(["0", "1"], 3, 8100, 5600)
    assert [p.gpu for p in plans] == ["0", "0", "0", "1", "1", "1"]
    ports = [port for p in plans for port in (p.port, p.kv_port, p.replay_port)]
    assert len(set(ports)) == len(ports)
    assert plans[4].port == 8104 and (plans[4].kv_port, plans[4].replay_port) == (5608, 5609)
    with pytest.raises(ValueError):
        fleet.plan_replicas([], 1, 8100, 5600)


def test_each_replica_gets_the_flags_the_router_needs_and_the_memory_split(tmp_path: Path) -> None:
    fleet = _script()
    args, extra = fleet.parse_args(
        ["--model", str(tmp_path), "--gpus", "0", "--per-gpu", "4", "--kv-cache-memory-bytes", "6G",
         "--", "--load-format", "dummy"]
    )  # fmt: skip
    plan = fleet.fleet_plan(args, extra)
    argv = plan.command(plan.replicas[2], "python3")
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in argv
    assert argv[argv.index("--block-size") + 1] == "16"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.225"  # 0.9 shared by four
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "6G"
    assert argv[argv.index("--port") + 1] == "8102" and argv[-2:] == ["--load-format", "dummy"]
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:5604" and events["replay_endpoint"] == "tcp://*:5605"  # '*': vLLM binds
    env = plan.environment(plan.replicas[2], {"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["VLLM_SERVER_DEV_MODE"] == "1" and env["PATH"] == "/bin"


def test_the_written_replicas_yaml_is_what_kvrouter_reads(tmp_path: Path) -> None:
    dry = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tmp_path), "--gpus", "0,1", "--per-gpu", "2", "--dry-run"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    commands = [line for line in dry.stdout.splitlines() if line.startswith("CUDA_VISIBLE_DEVICES=")]
    assert len(commands) == 4
    fleet = parse_fleet(yaml.safe_load(dry.stdout[dry.stdout.index("model:") :]), tmp_path / "replicas.yaml")
    assert [r.name for r in fleet.replicas] == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
    assert fleet.block_size == 16 and fleet.tokenizer == str(tmp_path.resolve())
    for replica, command in zip(fleet.replicas, commands, strict=True):
        assert replica.kv_events is not None and not replica.kv_events.bind  # vLLM binds, the router connects
        bound = json.loads(command.split("--kv-events-config ", 1)[1].split("'")[1])
        assert replica.kv_events.endpoint.rsplit(":", 1)[1] == bound["endpoint"].rsplit(":", 1)[1]
        assert replica.kv_events.topic == bound["topic"]
        assert f"--port {replica.base_url.rsplit(':', 1)[1]}" in command
